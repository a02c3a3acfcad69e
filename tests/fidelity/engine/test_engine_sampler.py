"""Sampler: greedy, seeded reproducibility, top-k / top-p / typical support, logprobs."""
from __future__ import annotations

import torch

from consort_engine.model.sampler import Sampler
from consort_engine.kv.sequence import SamplingParams, Sequence


def seqs_with(*params: SamplingParams) -> list[Sequence]:
    return [Sequence(prompt_token_ids=[1, 2, 3], sampling=p) for p in params]


def logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_no_logprobs_by_default():
    x = logits(8)
    tokens, lps = Sampler().sample(x, seqs_with(*[SamplingParams(temperature=0.0)] * 8))
    assert tokens == x.argmax(-1).tolist()
    assert lps is None


def test_mixed_greedy_rows_stay_argmax():
    x = logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5, seed=i) for i in range(6)]
    tokens, _ = Sampler().sample(x, seqs_with(*params))
    assert [tokens[i] for i in (1, 3, 5)] == x.argmax(-1)[[1, 3, 5]].tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    x = logits(1, vocab=1000)
    p = SamplingParams(temperature=1.0, seed=42)
    a = [Sampler().sample(x, seqs_with(p))[0][0] for _ in range(3)]
    assert len(set(a)) == 1
    # same row inside a different batch, at a different position: same token
    big = torch.cat([logits(3, vocab=1000, seed=5), x])
    others = [SamplingParams(temperature=0.7, seed=None)] * 3
    assert Sampler().sample(big, seqs_with(*others, p))[0][3] == a[0]
    # different seeds explore: over 20 seeds we see more than one token on a flat-ish distribution
    flat = torch.zeros(1, 1000)
    draws = {Sampler().sample(flat, seqs_with(SamplingParams(temperature=1.0, seed=s)))[0][0] for s in range(20)}
    assert len(draws) > 10
    # the output index is part of the seed: the next token of the same request is drawn afresh
    s = seqs_with(SamplingParams(temperature=1.0, seed=42))[0]
    first = Sampler().sample(flat, [s])[0][0]
    seconds = set()
    for _ in range(5):
        s.token_ids.append(first)
        seconds.add(Sampler().sample(flat, [s])[0][0])
    assert len(seconds) > 1


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    x = probs.log().expand(4000, 3).contiguous()
    tokens, _ = Sampler().sample(x, seqs_with(*[SamplingParams(temperature=1.0)] * 4000))
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_draws_follow_a_wide_distribution_and_never_a_masked_token():
    torch.manual_seed(1234)
    x = torch.randn(64, generator=torch.Generator().manual_seed(9)) * 2
    x[::3] = -float("inf")                         # every third token masked: probability 0
    probs = torch.softmax(x, -1)
    n = 20000
    tokens, _ = Sampler().sample(x.expand(n, 64).contiguous(), seqs_with(*[SamplingParams(temperature=1.0)] * n))
    freq = torch.bincount(torch.tensor(tokens), minlength=64).float() / n
    assert freq[::3].sum() == 0
    assert (freq - probs).abs().max() < 0.015, (freq - probs).abs().max()    # ~5 sigma at the largest p


def test_top_k_restricts_support():
    x = logits(1, vocab=100, seed=3).expand(500, 100).contiguous()
    tokens, _ = Sampler().sample(x, seqs_with(*[SamplingParams(temperature=5.0, top_k=3)] * 500))
    allowed = set(x[0].topk(3).indices.tolist())
    assert set(tokens) <= allowed and len(set(tokens)) == 3


def test_top_p_restricts_support_per_row():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log().expand(600, 4).contiguous()
    params = [SamplingParams(temperature=1.0, top_p=0.7)] * 300 + [SamplingParams(temperature=1.0, top_p=0.9)] * 300
    tokens, _ = Sampler().sample(x, seqs_with(*params))
    assert set(tokens[:300]) == {0, 1}          # 0.5 + 0.3 reaches 0.7
    assert set(tokens[300:]) == {0, 1, 2}       # 0.95 needed for 0.9


def test_top_p_keeps_the_support_transformers_keeps():
    """Peaked rows (the nucleus within the first 64 candidates), wide ones (within 1,024) and flat ones
    (the whole vocabulary), p from 0.1 to 0.99, rows with p = 1 untouched: the kept tokens are transformers'."""
    from transformers import TopPLogitsWarper

    g = torch.Generator().manual_seed(21)
    x = torch.randn(60, 5000, generator=g) * torch.tensor([0.3, 3.0, 8.0]).repeat(20)[:, None]
    ps = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.99, 1.0]).repeat(10)[:, None]
    got = torch.isinf(Sampler._top_p(x, ps))
    boundary = 0
    for i in range(x.shape[0]):
        want = torch.isinf(TopPLogitsWarper(top_p=float(ps[i]))(None, x[i:i + 1].clone()))[0]
        if not torch.equal(got[i], want):
            # float rounding at the edge: transformers sums the tail ascending, we sum the head
            # descending; where p sits within float error of a partial sum the two cut one token apart
            boundary += 1
            kept = x[i].softmax(-1)[~got[i]].sum()
            assert int((got[i] != want).sum()) == 1 and abs(float(kept) - float(ps[i])) < 1e-6, i
    assert boundary <= 1


def test_typical_p_drops_atypical_tokens():
    probs = torch.tensor([0.90, 0.04, 0.03, 0.02, 0.01])
    x = probs.log().expand(300, 5).contiguous()
    tokens, _ = Sampler().sample(x, seqs_with(*[SamplingParams(temperature=1.0, typical_p=0.5)] * 300))
    # entropy ~0.5 nats: the 0.9 token (surprise 0.1) is the most typical and alone covers the mass
    assert set(tokens) == {0}


def test_logprobs_match_log_softmax():
    x = logits(3, vocab=40)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, logprobs=0, seed=1)]
    tokens, lps = Sampler().sample(x, seqs_with(*params))
    ref = torch.log_softmax(x, -1)
    assert lps[1] is None
    assert lps[0]["token_id"] == tokens[0] == int(x[0].argmax())
    assert abs(lps[0]["logprob"] - ref[0, tokens[0]].item()) < 1e-5
    v, i = ref[0].topk(5)
    assert [t for t, _ in lps[0]["top"]] == i.tolist()
    assert all(abs(a - b) < 1e-5 for (_, a), b in zip(lps[0]["top"], v.tolist()))
    assert lps[2]["top"] == [] and abs(lps[2]["logprob"] - ref[2, tokens[2]].item()) < 1e-5


# --- logits processors: the same math as transformers' processors / OpenAI's definition -------------

def history(prompt: list[int], output: list[int], p: SamplingParams) -> Sequence:
    s = Sequence(prompt_token_ids=prompt, sampling=p)
    s.token_ids.extend(output)
    return s


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    x = logits(3, vocab=64, seed=3)
    seqs = [history([1, 5, 5, 9], [9, 33], SamplingParams(repetition_penalty=1.3)),
            history([2, 3], [], SamplingParams(repetition_penalty=0.7)),
            history([4, 4], [60], SamplingParams())]                       # untouched row in the same batch
    got = Sampler.penalize(x, seqs, [s.sampling for s in seqs])
    for i, s in enumerate(seqs):
        ids = torch.tensor([s.token_ids])
        want = RepetitionPenaltyLogitsProcessor(s.sampling.repetition_penalty)(ids, x[i:i + 1].clone())
        assert torch.allclose(got[i:i + 1], want), i
    assert not torch.equal(got[0], x[0]) and torch.equal(got[2], x[2])


def test_min_p_matches_transformers():
    from transformers import MinPLogitsWarper

    x = logits(4, vocab=64, seed=4)
    for m in (0.05, 0.3):
        params = [SamplingParams(min_p=m)] * 4
        want = MinPLogitsWarper(min_p=m)(None, x.clone())
        assert torch.equal(torch.isinf(Sampler._min_p(x, torch.full((4, 1), m))), torch.isinf(want)), m
    # sampled with min_p, only tokens min_p keeps are ever drawn
    keep = ~torch.isinf(MinPLogitsWarper(min_p=0.3)(None, x.clone()))
    tokens, _ = Sampler().sample(x.repeat(50, 1), seqs_with(*[SamplingParams(temperature=1.0, min_p=0.3)] * 200))
    assert all(keep[i % 4, t] for i, t in enumerate(tokens))


def test_logit_bias_matches_transformers_sequence_bias_and_steers_greedy():
    from transformers import SequenceBiasLogitsProcessor

    x = logits(2, vocab=64, seed=5)
    bias = {7: 100.0, int(x[0].argmax()): -100.0, 20: 1.5}
    seqs = [history([1], [], SamplingParams(temperature=0.0, logit_bias=bias)), history([1], [], SamplingParams())]
    got = Sampler.penalize(x, seqs, [s.sampling for s in seqs])
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(torch.tensor([[1]]), x[:1].clone())
    assert torch.allclose(got[:1], want) and torch.equal(got[1], x[1])
    tokens, _ = Sampler().sample(x, seqs_with(SamplingParams(temperature=0.0, logit_bias=bias), SamplingParams(temperature=0.0)))
    assert tokens == [7, int(x[1].argmax())]


def test_frequency_and_presence_penalties_follow_openai_and_count_only_the_output():
    x = logits(2, vocab=64, seed=6)
    out = [5, 5, 5, 9, 12]
    p = SamplingParams(frequency_penalty=0.4, presence_penalty=-0.7)
    seqs = [history([5, 12, 30], out, p), history([5], out, SamplingParams())]
    got = Sampler.penalize(x, seqs, [s.sampling for s in seqs])
    # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, c over generated tokens
    want = x[0].clone()
    for j in set(out):
        c = out.count(j)
        want[j] -= c * 0.4 + (c > 0) * -0.7
    assert torch.allclose(got[0], want) and torch.equal(got[1], x[1])
    assert got[0, 30] == x[0, 30]                                              # prompt-only token: untouched


def test_penalties_kept_step_by_step_equal_a_fresh_count_of_the_whole_history():
    """The running per-sequence counts (only the tokens since the last step are added) give bit for bit
    what the penalties computed from the whole token history give, step after step, including a
    sequence seen for the first time mid-generation and a history that shrank (counted again)."""
    import random

    from transformers import RepetitionPenaltyLogitsProcessor

    rng, vocab = random.Random(11), 96
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=-0.7),
              SamplingParams(repetition_penalty=0.8), SamplingParams(frequency_penalty=1.1),
              SamplingParams(logit_bias={3: 2.0}, presence_penalty=0.5)]
    seqs = [history([rng.randrange(vocab) for _ in range(n)], [], p) for n, p in zip((40, 3, 17, 9), params)]
    for step in range(30):
        x = logits(len(seqs), vocab=vocab, seed=100 + step)
        batch = seqs if step >= 5 else seqs[:2]          # rows 2-3 join the batch late
        got = Sampler.penalize(x[:len(batch)], batch, [s.sampling for s in batch])
        for i, s in enumerate(batch):
            want = x[i:i + 1].clone()
            for t, b in s.sampling.logit_bias.items():
                want[0, t] += b
            if s.sampling.repetition_penalty != 1.0:
                want = RepetitionPenaltyLogitsProcessor(s.sampling.repetition_penalty)(torch.tensor([s.token_ids]), want)
            c = torch.bincount(torch.tensor(s.output_token_ids, dtype=torch.int64), minlength=vocab).float()
            want = want[0] - s.sampling.frequency_penalty * c - s.sampling.presence_penalty * (c > 0)
            assert torch.equal(got[i], want), (step, i)
        for s in seqs:
            s.token_ids.extend(rng.choice([[rng.randrange(vocab)], [s.token_ids[-1]] * 2, []]))
        if step == 20:
            del seqs[0].token_ids[-3:]                   # a shorter history than last counted: recounted
