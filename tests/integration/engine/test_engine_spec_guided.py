"""Guided (structured output) requests speculate: n-gram drafts checked against the grammar before
verify, one mask row per verify position, the matcher advanced over accepted tokens only. Greedy
output is identical with speculation on and off, and guided rows do accept drafts. In-process
engine on the demo model; copy-heavy prompts (the legal output shape repeated) so drafts exist."""
from __future__ import annotations

import json
import re

import pytest

from consort_engine.config import EngineConfig
from consort_engine.core.engine import LLMEngine
from consort_engine.text.guided import Grammars, GuidedSpec
from consort_engine.model.loader import eos_token_ids, load_model_config
from consort_engine.kv.sequence import SamplingParams, Sequence
from consort_engine.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "count", "kind"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "count": {"type": "integer", "minimum": 0, "maximum": 1000},
                         "kind": {"enum": ["vector", "map", "set"]}}}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
CHOICES = ["vector of strings", "map of lists", "set of integers"]
CASES = {
    "json_schema": (GuidedSpec("json_schema", json.dumps(SCHEMA, sort_keys=True), "response_format"),
                    '{"name":"box","count":3,"kind":"map"} ' * 6 + "again:"),
    "regex": (GuidedSpec("regex", DATE, "guided_regex"), "2024-05-17 2023-11-02 " * 8 + "next:"),
    "choice": (GuidedSpec("choice", json.dumps(CHOICES), "guided_choice"), " ".join(CHOICES * 5) + " pick:"),
}


@pytest.fixture(scope="module")
def setup(demo_model):
    tok = Tokenizer.from_dir(demo_model)
    vocab = json.loads((demo_model / "config.json").read_text())["vocab_size"]
    grammars = Grammars(tok.hf, vocab, sorted(eos_token_ids(demo_model, load_model_config(demo_model))))
    engines = {mode: LLMEngine(EngineConfig(name="spec-guided", model=str(demo_model), speculative=mode,
                                            num_speculative_tokens=3, max_num_seqs=8))
               for mode in ("off", "ngram")}
    return tok, grammars, engines


def run(engine: LLMEngine, grammars: Grammars, prompts: list[list[int]], spec: GuidedSpec) -> list[Sequence]:
    seqs = [Sequence(list(p), SamplingParams(temperature=0.0, max_tokens=64, guided=spec)) for p in prompts]
    for s in seqs:
        s.matcher = grammars.matcher(spec)
        engine.scheduler.add(s)
    for _ in range(2000):      # bounded: a bug cannot loop forever
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    return seqs


@pytest.mark.parametrize("kind", list(CASES))
def test_guided_greedy_output_is_identical_with_speculation_and_drafts_are_accepted(setup, kind):
    tok, grammars, engines = setup
    spec, text = CASES[kind]
    base = tok.hf.encode(text, add_special_tokens=False).ids
    prompts = [base, base + [11], base[:-1]]      # a small batch: windows next to one-row steps
    off = run(engines["off"], grammars, prompts, spec)
    sched = engines["ngram"].scheduler
    drafted, accepted = sched.spec.num_draft_tokens, sched.spec.num_accepted_tokens
    on = run(engines["ngram"], grammars, prompts, spec)
    assert [s.output_token_ids for s in on] == [s.output_token_ids for s in off]
    assert [s.finish_reason for s in on] == [s.finish_reason for s in off]
    assert sched.spec.num_draft_tokens > drafted, f"{kind}: no guided row drafted"
    if kind != "choice":    # the gibberish model spells a choice its own way (" o" "f"), not the drafts' " of"
        assert sched.spec.num_accepted_tokens > accepted, f"{kind}: no guided draft accepted"
    for s in on:             # the grammar held: the gibberish model's output has the requested shape
        assert s.finish_reason == "stop", s.finish_reason
        out = tok.decode(s.output_token_ids, True)
        if kind == "json_schema":
            assert set(json.loads(out)) == {"name", "count", "kind"}, out
        elif kind == "regex":
            assert re.fullmatch(DATE, out), out
        else:
            assert out in CHOICES, out
    stats = engines["ngram"].stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_sampled_guided_requests_speculate_and_every_output_matches_the_schema(setup):
    """Sampled guided rows: typical acceptance over the verify rows, each masked at its own window
    position, and the token drawn at the first refusal comes from that position's mask: every seed's
    output still parses and has the schema's keys, and guided drafts are proposed and accepted."""
    tok, grammars, engines = setup
    spec, text = CASES["json_schema"]
    base = tok.hf.encode(text, add_special_tokens=False).ids
    engine = engines["ngram"]
    sched = engine.scheduler
    drafted, accepted = sched.spec.num_draft_tokens, sched.spec.num_accepted_tokens
    seqs = [Sequence(list(base), SamplingParams(temperature=0.7, seed=seed, max_tokens=64, guided=spec))
            for seed in range(6)]
    for s in seqs:
        s.matcher = grammars.matcher(spec)
        engine.scheduler.add(s)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    assert sched.spec.num_draft_tokens > drafted and sched.spec.num_accepted_tokens > accepted
    for s in seqs:
        assert s.finish_reason == "stop", (s.finish_reason, tok.decode(s.output_token_ids, True))
        out = json.loads(tok.decode(s.output_token_ids, True))
        assert set(out) == {"name", "count", "kind"} and out["kind"] in ("vector", "map", "set"), out
        assert isinstance(out["count"], int) and 0 <= out["count"] <= 1000, out
    stats = engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
