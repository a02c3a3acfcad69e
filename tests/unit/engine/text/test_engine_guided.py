"""Structured output: request parsing, the batch bitmask, matcher advance and EOS, on the demo
tokenizer with real xgrammar, and a real (CPU) engine decoding guided and free rows in one batch."""
from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import pytest
import torch

from consort_engine.demo_model import write_demo_model
from consort_engine.text.guided import (CompileBusy, CompileSlots, CompileTimeout, GrammarError, Grammars, GuidedSpec,
                                        _unpack, apply_mask, choice_ebnf)
from consort_engine.text.tokenizer import Tokenizer
from consort_engine.serving.errors import ApiError
from consort_engine.serving.protocol import parse_chat, parse_completion

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 99}}, "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("guided") / "demo", seed=0)


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def grammars(model_dir, tok) -> Grammars:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    eos = tok.hf.token_to_id(tok.eos_token)
    return Grammars(tok.hf, vocab, [eos])


def test_parse_each_form():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    g = parse_chat({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                                       "strict": True}}}).sampling.guided
    assert g == GuidedSpec("json_schema", json.dumps(SCHEMA, separators=(",", ":")), "response_format.json_schema.schema")
    assert parse_chat({**chat, "response_format": {"type": "json_object"}}).sampling.guided.kind == "json_object"
    assert parse_chat({**chat, "response_format": {"type": "text"}}).sampling.guided is None
    c = parse_completion({"prompt": "a", "guided_choice": ["yes", "no"]}).sampling.guided
    assert (c.kind, json.loads(c.spec), c.param) == ("choice", ["yes", "no"], "guided_choice")
    r = parse_completion({"prompt": "a", "structured_outputs": {"regex": "[0-9]+"}}).sampling.guided
    assert (r.kind, r.spec, r.param) == ("regex", "[0-9]+", "structured_outputs.regex")
    assert parse_completion({"prompt": "a", "guided_json": json.dumps(SCHEMA)}).sampling.guided.kind == "json_schema"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{nope"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_bad_forms_are_typed_400s(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **body})
    assert e.value.status == 400 and e.value.param == param


def test_uncompilable_names_the_field(grammars):
    with pytest.raises(GrammarError) as e:
        grammars.compile(GuidedSpec("regex", "a(b", "guided_regex"))
    assert e.value.param == "guided_regex" and "does not compile" in str(e.value)
    with pytest.raises(GrammarError):
        grammars.compile(GuidedSpec("grammar", "root ::= undefined_rule", "guided_grammar"))


def test_compile_cache_returns_same_object(grammars):
    g = GuidedSpec("json_schema", json.dumps(SCHEMA, separators=(",", ":")), "x")
    assert grammars.compile(g) is grammars.compile(GuidedSpec(g.kind, g.spec, "other"))


def test_unpack_bit_order():
    mask = torch.tensor([[0b101, -1]], dtype=torch.int32)   # tokens 0 and 2 in word 0; all of word 1
    allowed = _unpack(mask, 40)
    assert allowed[0, :3].tolist() == [True, False, True]
    assert not allowed[0, 3:32].any() and allowed[0, 32:].all()


def test_mask_follows_grammar_and_eos_only_at_end(grammars, tok):
    vocab, eos = grammars.vocab_size, tok.hf.token_to_id(tok.eos_token)
    m = grammars.matcher(GuidedSpec("choice", json.dumps(["yes", "no"]), "guided_choice"))
    logits = torch.zeros(2, vocab)
    out = apply_mask(logits, [m, None])
    assert torch.isfinite(out[1]).all()                        # unguided row untouched
    allowed = torch.isfinite(out[0]).nonzero().view(-1).tolist()
    assert eos not in allowed and allowed
    assert all("yes".startswith(t) or "no".startswith(t) for t in (tok.decode([a], False) for a in allowed))
    for t in tok.hf.encode("yes", add_special_tokens=False).ids:
        assert m.accept_token(t)
    allowed = torch.isfinite(apply_mask(logits, [m, None])[0]).nonzero().view(-1).tolist()
    assert allowed == [eos]                                     # the grammar is complete: only EOS
    assert m.accept_token(eos) and m.is_terminated()


def test_choice_ebnf_escapes():
    assert choice_ebnf(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def _engine(model_dir, speculative: str = "off"):
    from consort_engine.config import EngineConfig
    from consort_engine.core.engine import LLMEngine
    return LLMEngine(EngineConfig(name="demo", model=str(model_dir), device="cpu", dtype="float32",
                                  num_blocks=64, speculative=speculative))


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_engine_guided_and_free_rows_in_one_batch(model_dir, tok, grammars, speculative):
    from consort_engine.kv.sequence import SamplingParams, Sequence
    eng = _engine(model_dir, speculative)
    eng.warmup()
    spec = GuidedSpec("json_schema", json.dumps(SCHEMA, separators=(",", ":")), "x")
    prompt = tok.hf.encode("hello there", add_special_tokens=False).ids
    seqs = []
    for seed in range(4):
        s = Sequence(list(prompt), SamplingParams(temperature=1.0, seed=seed, max_tokens=64, guided=spec))
        s.matcher = grammars.matcher(spec)
        seqs.append(s)
    free = Sequence(list(prompt), SamplingParams(temperature=0.0, max_tokens=24))
    for s in [*seqs, free]:
        eng.scheduler.add(s)
    while eng.has_unfinished():
        eng.step()
    for s in seqs:
        assert s.finish_reason == "stop" and s.matcher.is_terminated()
        jsonschema.validate(json.loads(tok.decode(s.output_token_ids, True)), SCHEMA)
    assert free.num_output_tokens == 24 or free.finish_reason == "stop"
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_draft_is_cut_at_the_first_refused_token_and_window_rows_follow_the_draft(grammars, tok):
    """grammar_prefix walks a draft and rolls back; fill_window gives row j the mask after draft[:j]:
    the same rows one-token decoding would get, and the matcher ends where it began."""
    from consort_engine.text.guided import fill_window, grammar_prefix
    spec = GuidedSpec("regex", "ab(c|d)+", "guided_regex")
    ids = [tok.hf.encode(t, add_special_tokens=False).ids for t in ("a", "b", "c", "x", "d")]
    assert all(len(i) == 1 for i in ids)
    a, b, c, x, d = (i[0] for i in ids)
    m = grammars.matcher(spec)
    assert grammar_prefix(m, [a, b, c, x, d]) == 3 and grammar_prefix(m, [b]) == 0   # rolled back: 'b' first is refused
    vocab = grammars.vocab_size
    logits = torch.zeros(4, vocab)
    masked = apply_mask(logits, [], [(0, m, [a, b, c])])
    one = grammars.matcher(spec)
    for row, t in enumerate([a, b, c, None]):
        expect = apply_mask(torch.zeros(1, vocab), [one])
        assert torch.equal(torch.isinf(masked[row]), torch.isinf(expect[0])), row
        if t is not None:
            assert one.accept_token(t)
    assert masked[3, d].item() == 0 and torch.isinf(masked[3, x]) and torch.isinf(masked[0, b])
    assert m.accept_token(a)          # the window left the matcher at its start


@pytest.mark.parametrize("string", [{"type": "string", "maxLength": 12}, {"type": "string"}], ids=["bounded", "free"])
def test_json_strings_hold_well_formed_utf8_only(grammars, string):
    """UTF-8-encoded surrogates (ED A0-BF xx) are not UTF-8: they decode as three U+FFFD, so a string the
    grammar counted as one character too few came out longer than its maxLength (seen on a sampled draw)."""
    spec = GuidedSpec("json_schema", json.dumps({"type": "object", "properties": {"s": string}, "required": ["s"],
                                                 "additionalProperties": False}), "response_format")
    assert grammars.matcher(spec).accept_string('{"s": "ab\u3042'.encode())           # a real 3-byte character
    assert not grammars.matcher(spec).accept_string(b'{"s": "ab\xed\xbb\xb4')          # U+DEF4, a surrogate
    assert not grammars.matcher(spec).accept_string(b'{"s": "ab\x01')                  # a raw control character


async def test_compile_slots_bound_concurrency_and_time_and_keep_the_loop_free():
    """Issue 25: compiles had no time or concurrency bound on the shared worker pool. Two slots, 0.3 s:
    two 1 s compiles time out (and finish in the background, holding their slots), a third finds no
    slot; the loop keeps ticking throughout; once they finish, a quick compile runs."""
    slots = CompileSlots(2, 0.3)
    finished: list[int] = []

    def slow(i: int):
        time.sleep(1.0)
        finished.append(i)
        return i

    ticks: list[float] = []

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    t = asyncio.create_task(ticker())
    t0 = time.monotonic()
    results = await asyncio.gather(*(slots.run(lambda i=i: slow(i)) for i in range(3)), return_exceptions=True)
    waited = time.monotonic() - t0
    assert [type(r).__name__ for r in results] == ["CompileTimeout", "CompileTimeout", "CompileBusy"]
    assert waited < 0.8, waited                      # answered at the deadline, not when the compiles end
    await asyncio.sleep(1.0)
    assert sorted(finished) == [0, 1]                # the third never ran
    assert await slots.run(lambda: "quick") == "quick"
    t.cancel()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert max(gaps) < 0.1, max(gaps)


async def test_compile_slots_pass_the_compile_error_through():
    def bad():
        raise GrammarError("guided_regex", "'guided_regex' does not compile: nope")
    with pytest.raises(GrammarError):
        await CompileSlots(1, 5.0).run(bad)
    assert isinstance(CompileTimeout(), Exception) and isinstance(CompileBusy(), Exception)
