"""The engine on CUDA equals transformers on the same GPU, per attention backend and block size, with
decode CUDA graphs and with --enforce-eager.
Never executed on the machine that wrote it (no GPU there): run `pytest tests/gpu` on a CUDA machine."""
from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _hf_greedy_cuda(model_dir, prompts, n, dtype):
    """transformers' greedy tokens on the GPU, with the logits the near-tie rule reads (fidelity_helpers)."""
    from fidelity_helpers import Reference, hf_model
    model = hf_model(model_dir, dtype).cuda()
    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        out.append(Reference(p, g.sequences[0, len(p):].tolist(), [], [row[0].float().cpu() for row in g.logits]))
    return out


def _has_flash_attn() -> bool:
    from consort_engine.model import attention
    return attention.flash_attn_varlen_func is not None


# flash-attn reads paged KV only with block_size % 256 == 0: (flash, 16) is never a case (the
# engine picks triton there), so it is not parametrized rather than skipped.
CASES = [pytest.param("flash", 256, marks=pytest.mark.skipif(not torch.cuda.is_available() or not _has_flash_attn(),
                                                             reason="needs flash-attn")),
         ("triton", 16), ("triton", 256), ("torch", 16), ("torch", 256)]


@pytest.mark.parametrize(("backend", "block_size"), CASES)
def test_greedy_equals_transformers_on_the_same_gpu(backend, block_size, tmp_path, monkeypatch):
    from fidelity_helpers import assert_greedy_matches, make_checkpoint
    from consort_engine.config import EngineConfig
    from consort_engine.model.model_runner import ModelRunner
    from test_engine_model_runner import make_prompts, run_mixed_schedule

    if backend != "flash":
        monkeypatch.setenv("CONSORT_ATTENTION_BACKEND", backend)
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = "bfloat16" if backend == "flash" else "float32"      # flash-attn has no fp32 kernels
    ckpt = make_checkpoint("llama", tmp_path)
    runner = ModelRunner(EngineConfig(model=str(ckpt), device="cuda", block_size=block_size, num_blocks=64,
                                      dtype=dtype))
    assert runner.backend == backend
    prompts, shared = make_prompts(runner.vocab_size)
    seqs, _ = run_mixed_schedule(runner, prompts, shared)
    n = len(seqs[0].output_token_ids)
    refs = _hf_greedy_cuda(ckpt, prompts, n, getattr(torch, dtype))
    if dtype == "float32":          # equal, but at most one sequence parted at a near-tie
        assert_greedy_matches(refs, [s.output_token_ids for s in seqs], name=f"{backend}/{block_size}")
    for i, (s, ref) in enumerate(zip(seqs, refs)):   # bf16 kernels differ in summation order: the first agrees
        assert s.output_token_ids[0] == ref.tokens[0], f"seq {i}"


GRAPH_CASES = [CASES[0], ("triton", 16), ("triton", 256)]     # the backends that capture decode graphs


@pytest.mark.parametrize(("backend", "block_size"), GRAPH_CASES)
def test_decode_graphs_give_the_greedy_output_of_enforce_eager_and_transformers(backend, block_size, tmp_path,
                                                                                 monkeypatch, caplog):
    from fidelity_helpers import assert_greedy_matches, make_checkpoint
    from consort_engine.config import EngineConfig
    from consort_engine.model.cuda_graphs import capture_sizes
    from consort_engine.model.model_runner import ModelRunner
    from test_engine_model_runner import make_prompts, run_mixed_schedule

    if backend != "flash":
        monkeypatch.setenv("CONSORT_ATTENTION_BACKEND", backend)
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = "bfloat16" if backend == "flash" else "float32"
    ckpt = make_checkpoint("llama", tmp_path)

    def greedy(enforce_eager: bool):
        runner = ModelRunner(EngineConfig(model=str(ckpt), device="cuda", block_size=block_size, num_blocks=64,
                                          dtype=dtype, max_num_seqs=16, enforce_eager=enforce_eager))
        assert runner.backend == backend
        with caplog.at_level(logging.INFO, logger="consort.engine"):
            runner.warmup()                    # captures the graphs unless enforce_eager
        prompts, shared = make_prompts(runner.vocab_size)
        seqs, _ = run_mixed_schedule(runner, prompts, shared)
        return runner, prompts, [s.output_token_ids for s in seqs]

    graphs, prompts, with_graphs = greedy(False)
    assert f"captured {len(capture_sizes(16))} decode CUDA graphs in" in caplog.text
    assert graphs.decode_graphs is not None and graphs.decode_graphs.num_runs > 0, "no decode step replayed a graph"
    eager, _, without = greedy(True)
    assert eager.decode_graphs is None
    if dtype == "float32":
        assert with_graphs == without
    else:   # bf16: graphs decode through flash_attn_with_kvcache, eager through the varlen kernel (another
        # split of the reduction), so a near tie may flip later tokens: the first must agree
        assert [t[0] for t in with_graphs] == [t[0] for t in without]
    refs = _hf_greedy_cuda(ckpt, prompts, len(with_graphs[0]), getattr(torch, dtype))
    if dtype == "float32":
        assert_greedy_matches(refs, with_graphs, name=f"graphs {backend}/{block_size}")
    for i, (ours, ref) in enumerate(zip(with_graphs, refs)):   # bf16: the first token must agree
        assert ours[0] == ref.tokens[0], f"seq {i}"


def test_pinned_staging_round_trips_mixed_shapes():
    from consort_engine.model.host_staging import PinnedStaging
    staging = PinnedStaging(torch.device("cuda"))
    for step in range(3):          # the pinned buffer is reused (and grows) across steps
        ts = [torch.arange(n * (step + 1), dtype=torch.int64) for n in (5, 0, 300)] + [torch.ones(4, 7).long()]
        got = staging.to_device(ts)
        assert all(g.is_cuda and torch.equal(g.cpu(), t) for g, t in zip(got, ts))


@pytest.mark.parametrize("flags", [[], ["--enforce-eager"]], ids=["graphs", "eager"])
def test_bench_offline_runs_on_cuda(flags):
    proc = subprocess.run([sys.executable, "-m", "consort_common.cli", "bench", "offline", "--quick",
                           "--device", "cuda", "--dtype", "bfloat16", *flags], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    captured = re.search(r"KV blocks, (\d+) decode CUDA graphs", proc.stdout)    # run_engine's start-up line
    assert (captured is None) if flags else (captured and int(captured.group(1)) > 0), proc.stdout[-3000:]


def test_the_draft_policy_profiles_a_gpu_step_up_to_256_sequences_and_keeps_the_greedy_output(tmp_path):
    """Policy goodput on CUDA: the warm-up profile reaches 256 sequences (a GPU step is bound by reading
    the weights far beyond a CPU's), and n-gram drafting leaves the greedy output as it is."""
    import random

    from fidelity_helpers import make_checkpoint
    from consort_engine.config import EngineConfig
    from consort_engine.core.engine import LLMEngine
    from consort_engine.kv.sequence import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    ckpt = make_checkpoint("llama", tmp_path)

    def engine(speculative: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(ckpt), device="cuda", dtype="float32", speculative=speculative,
                                      max_num_seqs=256, max_num_batched_tokens=2048))

    drafting = engine("ngram")
    drafting.warmup()
    cost = drafting.spec.cost
    assert cost.seqs[0] == 1 and cost.seqs[-1] == 256 and all(d > 0 for d in cost.decode_s), cost
    rng = random.Random(3)
    vocab = drafting.runner.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(8, 40))] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours, plain = drafting.generate(prompts, params), engine("off").generate(prompts, params)
    # verify rows and one-row decodes may sum in another order on the GPU: a near tie can part a sequence
    assert [o[0] for o in ours] == [p[0] for p in plain]
    assert sum(o == p for o, p in zip(ours, plain)) >= 60, "drafting changed the greedy output"
