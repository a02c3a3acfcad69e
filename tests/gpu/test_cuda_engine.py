"""The engine on CUDA equals transformers on the same GPU, per attention backend and block size.
Never executed on the machine that wrote it (no GPU there): run `pytest tests/gpu` on a CUDA machine."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _hf_greedy_cuda(model_dir, prompts, n, dtype):
    from fidelity_helpers import hf_model
    model = hf_model(model_dir, dtype).cuda()
    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def _has_flash_attn() -> bool:
    from consort_engine import attention
    return attention.flash_attn_varlen_func is not None


# flash-attn reads paged KV only with block_size % 256 == 0: (flash, 16) is never a case (the
# engine picks triton there), so it is not parametrized rather than skipped.
CASES = [pytest.param("flash", 256, marks=pytest.mark.skipif(not torch.cuda.is_available() or not _has_flash_attn(),
                                                             reason="needs flash-attn")),
         ("triton", 16), ("triton", 256), ("torch", 16), ("torch", 256)]


@pytest.mark.parametrize(("backend", "block_size"), CASES)
def test_greedy_equals_transformers_on_the_same_gpu(backend, block_size, tmp_path, monkeypatch):
    from fidelity_helpers import make_checkpoint
    from consort_engine.config import EngineConfig
    from consort_engine.model_runner import ModelRunner
    from test_model_runner import make_prompts, run_mixed_schedule

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
    for i, (s, ref) in enumerate(zip(seqs, refs)):
        if dtype == "float32":
            assert s.output_token_ids == ref, f"seq {i}"
        else:   # bf16 kernels differ in summation order: the first token must agree
            assert s.output_token_ids[0] == ref[0], f"seq {i}"


def test_bench_offline_runs_on_cuda():
    proc = subprocess.run([sys.executable, "-m", "consort_operator.cli", "bench", "offline", "--quick",
                           "--device", "cuda", "--dtype", "bfloat16"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
