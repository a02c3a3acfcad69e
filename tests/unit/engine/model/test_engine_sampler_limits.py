"""Issue 25: no sampling value a request can carry raises inside the engine's step (where a failure
ends every request in flight on the replica), and per-request sampler state is built once."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consort_engine.model.sampler import Sampler
from consort_engine.kv.sequence import Sequence
from consort_engine.serving.errors import ApiError
from consort_engine.serving.limits import MAX_LOGIT_BIAS
from consort_engine.serving.prepare import check_vocab
from consort_engine.serving.protocol import parse_completion

VOCAB = 300
HUGE = 10 ** 400
# Boundary, huge and non-finite values for every numeric sampling field: each either parses (and must
# then sample) or is a typed 400.
EDGES = st.sampled_from([None, 0, -1, 1, 2, 0.5, 1e-300, 1e-7, 0.01, 0.999999, 1.0, 1.5, 100, 1e300, 2 ** 63 - 1,
                         2 ** 63, 2 ** 64, -2 ** 63, HUGE, float("nan"), float("inf"), float("-inf")])
FIELDS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "seed")
BODY = st.fixed_dictionaries({}, optional={
    **{f: EDGES for f in FIELDS},
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.sampled_from([-100, -1e-9, 0, 55.5, 100]),
                                  max_size=MAX_LOGIT_BIAS),
})


def parsed(body: dict) -> Sequence | None:
    try:
        sp = parse_completion({"prompt": "x", **body}).sampling
        check_vocab(sp, VOCAB)
    except ApiError as e:
        assert e.status == 400 and e.param, e
        return None
    seq = Sequence(prompt_token_ids=list(range(VOCAB)), sampling=sp)   # every token seen: the penalties bite
    return seq


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies=st.lists(BODY, min_size=1, max_size=6))
def test_whatever_parses_samples_without_raising(bodies):
    seqs = [s for s in map(parsed, bodies) if s is not None]
    if not seqs:
        return
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(len(seqs), VOCAB, generator=gen) * 20
        tokens, _ = Sampler().sample(x, seqs)
        assert all(0 <= t < VOCAB for t in tokens)
        for s, t in zip(seqs, tokens):
            s.token_ids.append(t)


@pytest.mark.parametrize("body", [
    {"top_k": 2 ** 64, "temperature": 0.8},                       # was: "Overflow when unpacking long"
    {"temperature": 1e-300, "top_p": 0.9},                        # was: logits inf -> NaN -> a bucket index of -2**63
    {"temperature": 1e-7, "top_p": 0.5, "seed": 2 ** 63 - 1},
    {"repetition_penalty": 0.01, "top_p": 0.9, "temperature": 0.01},
    {"repetition_penalty": 100, "typical_p": 1e-300, "temperature": 0.5},
])
def test_the_values_that_failed_the_step_now_sample(body):
    seqs = [parsed(body), parsed({"temperature": 0.7})]
    x = torch.randn(2, VOCAB) * 20
    tokens, _ = Sampler().sample(x, seqs)
    assert all(0 <= t < VOCAB for t in tokens)


class CountingDict(dict):
    reads = 0

    def __iter__(self):
        CountingDict.reads += 1
        return super().__iter__()

    def items(self):
        CountingDict.reads += 1
        return super().items()


def test_logit_bias_tensors_are_built_once_per_sequence():
    """Rebuilt from the dict every step, 8 rows of 100k entries cost 0.6 s a step on the engine thread."""
    seqs = [parsed({"temperature": 0}), parsed({"temperature": 0})]
    for s in seqs:
        s.sampling.logit_bias = CountingDict({5: 100.0, 7: -3.5})
    x = torch.zeros(2, VOCAB)
    CountingDict.reads = 0
    for _ in range(4):
        tokens, _ = Sampler().sample(x, seqs)
        assert tokens == [5, 5]
    assert CountingDict.reads == 2      # once per sequence, at its first step
    got = Sampler.penalize(x, seqs, [s.sampling for s in seqs])
    assert got[0, 5] == 100.0 and got[1, 7] == -3.5 and got[0, 6] == 0.0
