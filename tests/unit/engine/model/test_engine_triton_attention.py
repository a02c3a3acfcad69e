"""The Triton paged-attention kernel, run on CPU under Triton's interpreter (TRITON_INTERPRET=1 must be set
before triton is imported, so every case runs in a fresh subprocess), against attention over the gathered
context with a bottom-right causal mask (what the torch path computes)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASES = [  # block_size, heads, kv_heads, head_dim, query rows per sequence, context lens
    (8, 4, 4, 16, [1, 1, 1], [1, 9, 30]),
    (16, 8, 2, 32, [1, 3, 1, 5], [17, 40, 2, 64]),       # GQA + verify windows
    (32, 6, 3, 24, [4, 1], [33, 100]),                    # head_dim not a power of two
    (256, 4, 1, 16, [1, 2], [300, 257]),
]


def _reference(q, kc, vc, bt, ctx, qlens, scale):
    import torch
    import torch.nn.functional as F
    out, row = [], 0
    bs, kvh, d = kc.shape[1], kc.shape[2], kc.shape[3]
    for s, (n, c) in enumerate(zip(qlens, ctx)):
        blocks = bt[s, : (c + bs - 1) // bs].long()
        ks = kc[blocks].reshape(-1, kvh, d)[:c].transpose(0, 1)[None]
        vs = vc[blocks].reshape(-1, kvh, d)[:c].transpose(0, 1)[None]
        rows = torch.arange(c - n, c)[:, None]
        mask = torch.arange(c)[None, :] <= rows
        o = F.scaled_dot_product_attention(q[row:row + n].transpose(0, 1)[None], ks, vs, attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out.append(o[0].transpose(0, 1).reshape(n, -1))
        row += n
    return torch.cat(out)


def _run_case(bs, h, kvh, d, qlens, ctx, dtype_name):
    import torch
    from consort_engine.model.triton_attention import paged_attention
    torch.manual_seed(0)
    q_name, _, kv_name = dtype_name.partition("/")       # queries / pool element (the same unless given)
    dtype, kv_dtype = getattr(torch, q_name), getattr(torch, kv_name or q_name)
    max_blocks = max((c + bs - 1) // bs for c in ctx)
    num_blocks = len(ctx) * max_blocks + 3
    kc = torch.randn(num_blocks, bs, kvh, d).to(kv_dtype)
    vc = torch.randn(num_blocks, bs, kvh, d).to(kv_dtype)
    perm = torch.randperm(num_blocks - 1)[: len(ctx) * max_blocks] + 1    # scattered, block 0 = padding
    bt = perm.view(len(ctx), max_blocks).to(torch.int32)
    for s, c in enumerate(ctx):
        bt[s, (c + bs - 1) // bs:] = 0
    q = torch.randn(sum(qlens), h, d, dtype=dtype)
    cu = torch.tensor([0] + qlens).cumsum(0).to(torch.int32)
    scale = d ** -0.5
    got = paged_attention(q, kc, vc, bt, torch.tensor(ctx, dtype=torch.int32), cu, scale)
    want = _reference(q.float(), kc.float(), vc.float(), bt, ctx, qlens, scale)
    return float((got.float() - want).abs().max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16/float8_e4m3fn"])   # the last: an fp8 pool
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-h{c[1]}-kv{c[2]}-q{sum(c[4])}")
def test_triton_kernel_matches_gathered_attention(case, dtype):
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, __file__, json.dumps([*case, dtype])], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = float(proc.stdout.strip().splitlines()[-1])
    assert err < (1e-4 if dtype == "float32" else 3e-2), err     # the reference reads the same (widened) pool


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(_run_case(*json.loads(sys.argv[1])))
