"""Triton paged attention for the batched group (decode rows + short verify windows), any block size.

Reads K/V in place through the block tables (no gathered copy): one program per (query row, head),
an online softmax over the row's visible context in BLOCK_N-token tiles. Rows of one sequence are
consecutive (cu_query_lens); row i of a window of n rows sees context_len - (n - 1 - i) tokens, which
is causal inside the window. GQA: head h reads kv head h // (H / KVH).
Pool layout: [num_blocks, block_size, kv_heads, head_dim] (the flash/torch layout).
Runs on CUDA; under TRITON_INTERPRET=1 (set before importing triton) it runs on CPU tensors, which
is how the tests verify it on machines without a GPU.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "not available"
    triton = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, bt_ptr, ctx_ptr, cuq_ptr, row_seq_ptr, scale,
                                stride_qt, stride_qh, stride_ot, stride_oh,
                                stride_kb, stride_kt, stride_kh, stride_btb,
                                GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        seq = tl.load(row_seq_ptr + row)
        q_end = tl.load(cuq_ptr + seq + 1)
        visible = tl.load(ctx_ptr + seq) - (q_end - 1 - row)      # causal inside the window
        kv_head = head // GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(q_ptr + row * stride_qt + head * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        m = tl.full([], float("-inf"), tl.float32)
        denom = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, visible, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < visible
            block = tl.load(bt_ptr + seq * stride_btb + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
            base = block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], 1) * scale
            scores = tl.where(n_mask, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 0))
            p = tl.exp(scores - m_new)
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            denom = denom * alpha + tl.sum(p, 0)
            m = m_new
        out = acc / denom
        tl.store(o_ptr + row * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, cu_query_lens: torch.Tensor, scale: float,
                    out: torch.Tensor | None = None, single_query: bool = False) -> torch.Tensor:
    """q [Tb, H, D]; caches [blocks, block_size, KVH, D]; block_tables [B, max_blocks] int32;
    context_lens [B] (after this step); cu_query_lens [B + 1]. Returns (or fills) out [Tb, H * D].
    single_query: one row per sequence (decode graphs), so row i is sequence i: cu_query_lens[:-1]."""
    tb, h, d = q.shape
    _, block_size, kvh, _ = k_cache.shape
    assert k_cache.stride(3) == 1 and v_cache.stride() == k_cache.stride() and q.stride(2) == 1
    if out is None:
        out = torch.empty(tb, h * d, dtype=q.dtype, device=q.device)
    b = block_tables.shape[0]
    if single_query:
        row_seq = cu_query_lens[:-1]
    else:
        query_lens = (cu_query_lens[1:] - cu_query_lens[:-1]).long()
        row_seq = torch.repeat_interleave(torch.arange(b, device=q.device, dtype=torch.int32), query_lens,
                                          output_size=tb)
    _paged_attention_kernel[(tb, h)](
        q, k_cache, v_cache, out, block_tables, context_lens, cu_query_lens, row_seq, scale,
        q.stride(0), q.stride(1), out.stride(0), d,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=h // kvh, BLOCK_SIZE=block_size, BLOCK_N=64, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d))
    return out
