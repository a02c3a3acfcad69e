"""Incremental detokenizer, stop strings and chat template (consort_engine.text.tokenizer)."""
from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from consort_engine.text.tokenizer import (HEAD_CHARS_PER_TOKEN, HEAD_MARGIN, IncrementalDetokenizer, StopStringMatcher,
                                      Tokenizer, TooManyTokens)

CORPUS = [
    "template <typename T> struct vector { T* data; std::size_t size; };",
    "int main() { std::cout << \"héllo wörld ✓ 你好\" << std::endl; return 0; }",
    "for (auto& x : v) { x += 1; }  // range-for über alles",
    "std::unique_ptr<int> p = std::make_unique<int>(42);",
] * 20

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    """A real byte-level BPE trained on a small corpus, saved and loaded the way a checkpoint ships it."""
    hf = HFTokenizer(models.BPE(unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(CORPUS, trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    d = tmp_path_factory.mktemp("tok")
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": TEMPLATE}))
    return Tokenizer.from_dir(d)


def test_limit_counts_a_huge_prompt_on_its_head_and_a_short_one_exactly(tok: Tokenizer):
    limit = 50
    text = " ".join(CORPUS) * 40
    assert len(text) > HEAD_CHARS_PER_TOKEN * (limit + HEAD_MARGIN)      # long enough to take the head path
    with pytest.raises(TooManyTokens) as huge:
        tok.encode(text, limit=limit)
    assert huge.value.at_least and limit + HEAD_MARGIN < huge.value.count < len(tok.encode(text))
    short = CORPUS[0] * 3
    n = len(tok.encode(short))
    with pytest.raises(TooManyTokens) as exact:
        tok.encode(short, limit=n - 1)
    assert exact.value.count == n and not exact.value.at_least
    assert len(tok.encode(short, limit=n)) == n


def test_encode_adds_bos_and_chat_does_not_double_it(tok: Tokenizer):
    ids = tok.encode("int main()")
    assert ids[0] == tok.bos_token_id == 0
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>\nhi</s>\n<|assistant|>\n"
    chat_ids = tok.encode_chat(text)
    assert chat_ids[0] == 0 and chat_ids[1] != 0
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith("</s>\n")


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(CORPUS[:4]), cuts=st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_incremental_detokenizer_matches_full_decode(tok: Tokenizer, text: str, cuts: list[int]):
    prompt = tok.encode("std::")
    out = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt)
    pieces, i = [], 0
    for c in cuts * 50:
        if i >= len(out):
            break
        pieces.append(detok.step(out[i:i + c]))
        assert "\ufffd" not in pieces[-1]
        i += c
    if i < len(out):
        pieces.append(detok.step(out[i:]))
    pieces.append(detok.flush())
    assert "".join(pieces) == tok.decode(out) == text


def test_incremental_detokenizer_holds_split_utf8(tok: Tokenizer):
    ids = tok.encode("你好✓", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [0])
    got = [detok.step([t]) for t in ids]
    assert "".join(got) + detok.flush() == "你好✓"
    assert all("\ufffd" not in g for g in got)


def feed_all(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    m = StopStringMatcher(stops)
    emitted, stopped = [], False
    for d in deltas:
        out, stopped = m.feed(d)
        emitted.append(out)
        if stopped:
            break
    if not stopped:
        emitted.append(m.flush())
    return "".join(emitted), stopped, emitted


def test_stop_string_across_deltas_is_truncated_and_never_leaks():
    text, stopped, parts = feed_all(["</end>"], ["abc</", "en", "d>tail"])
    assert (text, stopped) == ("abc", True)
    assert parts[0] == "abc"          # "</" is held back: it could start the stop string
    assert parts[1] == ""


def test_false_prefix_is_released_and_earliest_stop_wins():
    assert feed_all(["\n\n"], ["a\n", "b\n", "c"]) == ("a\nb\nc", False, ["a", "\nb", "\nc", ""])
    assert feed_all(["xyz", "b"], ["axy", "zb"])[:2] == ("a", True)
    assert feed_all(["cd", "bcd"], ["abcd"])[:2] == ("a", True)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\n<>", max_size=40), stops=st.lists(st.text(alphabet="ab\n<>", min_size=1,
       max_size=4), min_size=1, max_size=3), cuts=st.lists(st.integers(1, 5), min_size=1, max_size=10))
def test_stop_matcher_equals_reference(text: str, stops: list[str], cuts: list[int]):
    deltas, i = [], 0
    for c in cuts * 40:
        if i >= len(text):
            break
        deltas.append(text[i:i + c])
        i += c
    got, stopped, parts = feed_all(stops, deltas)
    # reference: after each delta, the earliest-starting stop string complete in the text so far wins
    expect, hit, end = text, False, 0
    for d in deltas:
        end += len(d)
        found = [text[:end].find(s) for s in stops if s in text[:end]]
        if found:
            expect, hit = text[:min(found)], True
            break
    assert got == expect and stopped == hit
    # nothing emitted before the stop ever contains the start of a stop string that completes later
    for k in range(1, len(parts)):
        assert "".join(parts[:k]) == expect[:len("".join(parts[:k]))]


class BruteForceStops:
    """The matcher before issue 25, every stop string searched for in the held text + delta each step
    (O(stops x text)): the reference the automaton must agree with, delta by delta."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending, self.stopped, self.matched = stops, "", False, None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self.pending + delta
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            idx, self.matched = min(hits)
            self.pending, self.stopped = "", True
            return buf[:idx], True
        hold = max((n for s in self.stops for n in range(1, min(len(s) - 1, len(buf)) + 1)
                    if buf.endswith(s[:n])), default=0)
        self.pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab<", max_size=80),
       stops=st.lists(st.text(alphabet="ab<", min_size=1, max_size=8), min_size=1, max_size=16),
       cuts=st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_stop_automaton_agrees_with_the_brute_force_matcher_on_many_overlapping_stops(text, stops, cuts):
    m, ref = StopStringMatcher(stops), BruteForceStops(stops)
    i = 0
    for c in cuts * 20:
        d = text[i:i + c]
        i += c
        assert m.feed(d) == ref.feed(d), (d, m.pending, ref.pending)
        assert m.pending == ref.pending and m.matched == ref.matched
        if i >= len(text):
            break
    assert m.flush() == (ref.pending if not ref.stopped else "")


def test_a_step_costs_the_new_text_not_the_number_of_stop_strings():
    """Issue 25: with many stop strings each token cost O(stops x text) on the event loop (150,000 short
    stops: ~0.2 s a token per choice, so n=64 froze every stream). Now a step walks the new characters."""
    m = StopStringMatcher([f"q{i:06d}" for i in range(50_000)])    # the brute force: ~5 s for these 50 steps
    t0 = time.perf_counter()
    for _ in range(50):
        assert m.feed("ab q0") == ("ab ", False) or m.pending
    assert time.perf_counter() - t0 < 0.25


def test_stop_matcher_reports_the_stop_string_it_cut_at():
    m = StopStringMatcher(["abcde", "cd", "bc"])
    assert m.feed("xabcdef") == ("x", True) and m.matched == "abcde"   # the earliest start wins
    m = StopStringMatcher(["ab", "abc"])
    assert m.feed("zab") == ("z", True) and m.matched == "ab"          # a tie: the shorter one
    m = StopStringMatcher(["</end>"])
    assert m.feed("a</e") == ("a", False) and m.feed("nd>b") == ("", True) and m.matched == "</end>"
