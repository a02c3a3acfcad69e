"""ModelRunner vs transformers on tiny random checkpoints, driven by hand (no scheduler).

A small driver plays the block manager and scheduler: blocks come from a shuffled free list,
prompts run in chunks mixed with other sequences' decode steps, one sequence reuses another's
full prefix blocks (a prefix-cache hit), and every sampled row's logits are compared with
transformers' logits for the same position.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
from fidelity_helpers import NearTies, check_logprobs_close, greedy_agrees, hf_greedy, hf_model

from consort_engine.config import EngineConfig
from consort_engine.model.model_runner import ModelRunner
from consort_engine.model.models.packed import has_bf16_dot
from consort_engine.kv.sequence import ScheduledBatch, SamplingParams, Sequence

BS = 4          # the block size of most cases here (the driver takes the runner's)
NEW = 6
SHARED = 32     # seq 5's prompt starts with seq 4's first 32 tokens: full blocks of 4, 8 and 16 tokens


class Driver:
    """Sequential block allocation from a shuffled pool; greedy tokens appended after each step."""

    def __init__(self, runner: ModelRunner, seed: int = 0):
        self.runner = runner
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)

    def ensure_blocks(self, seq: Sequence, upto: int) -> None:
        while len(seq.block_table) * self.runner.block_size < upto:
            seq.block_table.append(self.free.pop())

    def step(self, work: list[tuple[Sequence, int]]) -> list[tuple[Sequence, torch.Tensor]]:
        seqs = [s for s, _ in work]
        new = [n for _, n in work]
        sample = [s.num_computed_tokens + n == s.num_tokens for s, n in work]
        for s, n in work:
            self.ensure_blocks(s, s.num_computed_tokens + n)
        before = [(list(s.token_ids), s.num_computed_tokens, list(s.block_table)) for s in seqs]
        logits = self.runner.execute(ScheduledBatch(seqs, new, sample, mode="mixed"))
        assert [(list(s.token_ids), s.num_computed_tokens, list(s.block_table)) for s in seqs] == before, \
            "execute must not mutate the sequences"
        assert logits.dtype == torch.float32 and logits.shape == (sum(sample), self.runner.vocab_size)
        out, row = [], 0
        for s, n, smp in zip(seqs, new, sample):
            s.num_computed_tokens += n
            if smp:
                out.append((s, logits[row]))
                s.token_ids.append(int(logits[row].argmax()))
                row += 1
        return out


def run_mixed_schedule(runner: ModelRunner, prompts: list[list[int]], shared_prefix_of: dict[int, int]):
    """Step 1-2: chunked prefills mixed with decodes; later steps: batched decode of everyone.

    Returns per sequence the list of logits rows in generation order."""
    d = Driver(runner)
    seqs = [Sequence(prompt_token_ids=p, sampling=SamplingParams(temperature=0.0)) for p in prompts]
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(seqs))}
    index = {id(s): i for i, s in enumerate(seqs)}

    def record(results):
        for s, row in results:
            got[index[id(s)]].append(row)

    # step 1: seq0 whole (short: batched group), seq3 first chunk of 20 (fresh SDPA), seq4 first 12
    record(d.step([(seqs[0], len(prompts[0])), (seqs[3], 20), (seqs[4], 12)]))
    # step 2: seq0 decode, seq1 whole, seq2 whole (fresh SDPA), seq3 rest (short chunk over a cached
    # prefix: batched group), seq4 rest (long chunk over a cached prefix: SDPA with offset mask)
    record(d.step([(seqs[0], 1), (seqs[1], len(prompts[1])), (seqs[2], len(prompts[2])),
                   (seqs[3], len(prompts[3]) - 20), (seqs[4], len(prompts[4]) - 12)]))
    # prefix-cache hit: seq5 starts on seq4's first full blocks, already computed (none when a block
    # is longer than the shared prefix: a partly filled block is never shared)
    bs = runner.block_size
    for child, parent in shared_prefix_of.items():
        shared = (SHARED // bs) * bs
        assert prompts[child][:SHARED] == prompts[parent][:SHARED]
        seqs[child].block_table = list(seqs[parent].block_table[: shared // bs])
        seqs[child].num_computed_tokens = shared
        seqs[child].num_cached_tokens = shared
    while True:
        work = [(s, s.num_tokens - s.num_computed_tokens) for s in seqs if s.num_tokens - s.num_prompt_tokens < NEW]
        if not work:
            break
        record(d.step(work))
    return seqs, got


def make_prompts(vocab: int) -> tuple[list[list[int]], dict[int, int]]:
    g = torch.Generator().manual_seed(7)
    lens = [3, 9, 30, 29, 45]
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    prompts.append(prompts[4][:SHARED] + torch.randint(3, vocab, (9,), generator=g).tolist())
    return prompts, {5: 4}


@pytest.mark.parametrize("backend", ["cpu_kernel", "torch", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_fp32_logits_and_greedy_tokens_match_transformers(arch, backend, checkpoint, monkeypatch, request):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        # the Triton kernel runs on CPU only under its interpreter, which must be on before triton is
        # imported: rerun this very case in a fresh process with it on
        pytest.importorskip("triton")
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", request.node.nodeid, "-q", "-p", "no:cacheprovider"],
                              env=env, capture_output=True, text=True, timeout=900, cwd=request.config.rootpath)
        assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
        return
    if backend != "cpu_kernel":
        monkeypatch.setenv("CONSORT_ATTENTION_BACKEND", backend)
    ckpt = checkpoint(arch)
    runner = ModelRunner(EngineConfig(model=str(ckpt), block_size=BS, num_blocks=128, dtype="float32"))
    assert runner.backend == backend
    assert runner.dtype == torch.float32 and runner.block_size == BS and runner.num_blocks == 128
    prompts, shared = make_prompts(runner.vocab_size)
    seqs, got = run_mixed_schedule(runner, prompts, shared)
    refs = hf_greedy(ckpt, prompts, NEW)
    compare_greedy(seqs, got, refs)


def compare_greedy(seqs: list[Sequence], got: list[list[torch.Tensor]], refs) -> None:
    """Greedy tokens equal transformers' (at most one sequence may part at a near-tie, and is
    compared up to there), the logits of every step compared within float tolerance."""
    ties = NearTies(limit=1)
    for i, (s, ref) in enumerate(zip(seqs, refs)):
        assert len(got[i]) == NEW
        same, tied = greedy_agrees(ref.logits, ref.tokens, s.output_token_ids, name=f"seq {i}")
        if tied:
            ties.add(f"seq {i} step {same}")
        for step, (ours, theirs) in enumerate(zip(got[i][:same + 1], ref.logits)):
            torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4, msg=f"seq {i} step {step}")


def test_the_greedy_rule_accepts_a_near_tie_and_nothing_wider(checkpoint):
    """compare_greedy's rule on transformers' own output: a runner-up one float step below the
    choice (another CPU's summation order) may be taken, and the comparison stops there; a
    runner-up further away than the near-tie tolerance may not."""
    ckpt = checkpoint("llama")
    prompts, _ = make_prompts(512)
    ref = hf_greedy(ckpt, prompts[:1], NEW)[0]
    assert greedy_agrees(ref.logits, ref.tokens, ref.tokens) == (NEW, False)
    step = 2
    choice, runner_up = (int(t) for t in ref.logits[step].topk(2).indices)
    ours = ref.tokens[:step] + [runner_up] + [0] * (NEW - step - 1)
    assert float(ref.logits[step][choice] - ref.logits[step][runner_up]) > 2e-4
    with pytest.raises(AssertionError, match="step 2: ours"):
        greedy_agrees(ref.logits, ref.tokens, ours)
    near = [row.clone() for row in ref.logits]
    near[step][runner_up] = torch.nextafter(near[step][choice], torch.tensor(-torch.inf))
    assert greedy_agrees(near, ref.tokens, ours) == (step, True)


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("backend", ["cpu_kernel", "torch"])
def test_the_gpu_block_sizes_match_transformers_on_cpu(backend, block_size, checkpoint, monkeypatch):
    """The schedule tests/gpu runs, at its block sizes (16: triton; 256: flash-attn's pages), here on CPU:
    a failure there is then the CUDA path's, not the schedule's (seq 5 shares seq 4's full blocks at 16)."""
    if backend != "cpu_kernel":
        monkeypatch.setenv("CONSORT_ATTENTION_BACKEND", backend)
    ckpt = checkpoint("llama")
    runner = ModelRunner(EngineConfig(model=str(ckpt), block_size=block_size, num_blocks=64, dtype="float32"))
    assert runner.backend == backend and runner.block_size == block_size
    prompts, shared = make_prompts(runner.vocab_size)
    seqs, got = run_mixed_schedule(runner, prompts, shared)
    compare_greedy(seqs, got, hf_greedy(ckpt, prompts, NEW))


@pytest.mark.parametrize("compute", ["auto", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_on_cpu_stays_within_top5_of_fp32_transformers(arch, compute, checkpoint, monkeypatch):
    """auto: bf16 activations where the CPU has a bf16 dot product (AMX, AVX-512 BF16), else bf16
    weights and KV cache with fp32 activations; bf16: all bf16."""
    if compute == "bf16":
        monkeypatch.setenv("CONSORT_BF16_COMPUTE", "1")
    ckpt = checkpoint(arch)
    runner = ModelRunner(EngineConfig(model=str(ckpt), block_size=BS, num_blocks=128, dtype="bfloat16"))
    assert runner.dtype == torch.bfloat16 and runner.kv_cache.dtype == torch.bfloat16
    bf16_activations = compute == "bf16" or has_bf16_dot()
    assert runner.compute_dtype == (torch.bfloat16 if bf16_activations else torch.float32)
    weights = runner.model.embed_tokens.weight
    assert torch.equal(weights, weights.to(torch.bfloat16).to(weights.dtype)), "weights hold bf16 values"
    prompts, shared = make_prompts(runner.vocab_size)
    seqs, got = run_mixed_schedule(runner, prompts, shared)
    refs = hf_greedy(ckpt, prompts, NEW)
    exact = 0
    for i, (s, ref) in enumerate(zip(seqs, refs)):
        top = [list(zip(*[t.tolist() for t in torch.log_softmax(r, -1).topk(5)][::-1])) for r in got[i]]
        exact += check_logprobs_close(ref, s.output_token_ids, top, name=f"seq {i}")
        # logits track the fp32 reference closely (bf16 weights and activations)
        assert torch.nn.functional.cosine_similarity(got[i][0], ref.logits[0], dim=0) > 0.99
    assert exact >= len(seqs)      # on average at least one exact greedy token per sequence


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
])
def test_rope_scaling_variants_match_transformers(scaling, checkpoint):
    ckpt = checkpoint("llama", rope_scaling=scaling)
    runner = ModelRunner(EngineConfig(model=str(ckpt), block_size=BS, num_blocks=64))
    tokens = torch.randint(3, runner.vocab_size, (1, 150), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf_model(ckpt)(tokens).logits[0]
    s = Sequence(prompt_token_ids=tokens[0].tolist())
    s.block_table = list(range(40))
    ours = runner.execute(ScheduledBatch([s], [150], [True], mode="prefill"))
    torch.testing.assert_close(ours[0], ref[-1], atol=2e-4, rtol=1e-4)


def test_pool_sizing_warmup_and_metadata(checkpoint):
    ckpt = checkpoint("qwen2")
    runner = ModelRunner(EngineConfig(model=str(ckpt), block_size=16, max_num_seqs=8))
    # sized from free memory, capped at what max_num_seqs full-length sequences can use
    assert 0 < runner.num_blocks <= 8 * (1024 // 16)
    assert runner.max_model_len == 1024 and runner.vocab_size == 512
    assert runner.hf_config.tie_word_embeddings and runner.hf_config.attention_bias
    assert runner.eos_token_ids >= {2}
    runner.warmup()
    empty = runner.execute(ScheduledBatch([_prefilled([5, 6, 7, 8], [0])], [2], [False], mode="prefill"))
    assert empty.shape == (0, runner.vocab_size)


def _prefilled(tokens: list[int], table: list[int]) -> Sequence:
    s = Sequence(prompt_token_ids=tokens)
    s.block_table = table
    return s
