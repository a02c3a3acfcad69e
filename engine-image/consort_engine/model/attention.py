"""Paged attention: K/V live in a block pool per layer, [num_blocks, block_size, kv_heads, head_dim]
(flash-attn's paged layout); every sequence reads them through its block table. The pool holds the
model's dtype, or with --kv-cache-dtype a narrower one (kv_cache_dtype): bfloat16, or fp8 (e4m3), which
halves what decode attention reads per token and doubles the tokens a pool of the same memory holds.

A step's tokens are laid out as [batched group | prefill spans]:
- the batched group (decode tokens, short queries such as spec-verify windows) is attended in ONE
  call per layer: on CPU a C kernel that reads the pool in place through the block tables
  (csrc/paged_attention.c); otherwise a gather of the blocks + SDPA with a length mask.
- prefill spans (one per sequence chunk): on CPU with float32 activations over a float32 or bfloat16
  pool, or bfloat16 ones over a bfloat16 pool without AMX (widened to float32 for the kernel: SDPA's
  bf16 path ran the bf16 prefill mix at 0.76x), and head size 64/128 (AVX-512 or AVX2 + FMA builds),
  all of them in one call of the C prefill kernel (csrc/prefill_attention.c), reading the pool in place
  like the batched group; otherwise SDPA: causal over the chunk's own K/V when nothing precedes it,
  else over the gathered context with a bottom-right causal mask.
With flash-attn installed on CUDA (and block_size a multiple of 256, its paged-KV constraint) every
token goes through flash_attn_varlen_func with the block table instead (decode CUDA graphs: through
flash_attn_with_kvcache, which reads the lengths from a tensor); on CUDA otherwise the batched
group goes through a Triton kernel that reads the pool in place (triton_attention.py, any block size).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from consort_common.machine import cpu_model_and_flags
from consort_engine.model.cpu_kernels import cpu_kernels, kernel
from consort_engine.model.triton_attention import paged_attention as triton_paged_attention, triton_available
from consort_engine.model.hookless import HooklessModule

AMX = "amx_bf16" in cpu_model_and_flags()[1]      # bf16 prefill spans stay with SDPA there (_prefill_kernel)
FP8 = torch.float8_e4m3fn                          # the fp8 KV pool's element (kv_cache_dtype)
KV_ELEMENTS = {"bfloat16": torch.bfloat16, "fp8": FP8}   # --kv-cache-dtype's choices besides auto

try:  # pragma: no cover - only on CUDA machines with flash-attn
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    FLASH_IMPORT_ERROR = ""
except Exception as e:  # noqa: BLE001 - any import failure means "not available"; CUDA runners log why
    flash_attn_varlen_func = flash_attn_with_kvcache = None
    # a wheel built for another torch fails here (undefined symbol), which would otherwise go unseen
    FLASH_IMPORT_ERROR = f"{type(e).__name__}: {e}"


@dataclass
class PrefillSpan:
    """Tokens [start, end) of the step belong to one sequence chunk at positions [cached, context_len)."""
    start: int
    end: int
    cached: int                              # tokens of this sequence already in the pool before this chunk
    context_len: int                         # cached + (end - start)
    block_ids: torch.Tensor | None = None    # int64 blocks covering context_len (only when cached > 0)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor               # [T] int64: pool slot (block * block_size + offset) of each new token
    num_batched_tokens: int = 0              # tokens [0, Tb) are the batched group
    block_tables: torch.Tensor | None = None  # [Bb, max_blocks] int32, padded with 0
    context_lens: torch.Tensor | None = None  # [Bb] int32: context after this step
    cu_query_lens: torch.Tensor | None = None  # [Bb + 1] int32: query rows of each sequence in the group
    max_context_len: int = 0
    max_query_len: int = 0
    prefills: list[PrefillSpan] = field(default_factory=list)
    # the prefill spans as one group for the CPU prefill kernel: rows [num_batched_tokens, T), per span
    # its block table, context and query rows (relative to num_batched_tokens)
    prefill_block_tables: torch.Tensor | None = None
    prefill_context_lens: torch.Tensor | None = None
    prefill_cu_query_lens: torch.Tensor | None = None
    # flash-attn varlen path (CUDA): one call covers every token
    cu_context_lens: torch.Tensor | None = None
    max_query_len_all: int = 0
    state: object = None                     # hybrid models: state_pool.StateMetadata of the mixer layers
    # decode CUDA graphs (cuda_graphs.py): every row is its sequence's one new token and the ints above
    # are bounds frozen at capture; flash reads the lengths from context_lens (flash_attn_with_kvcache)
    single_query: bool = False


def pool_shape(backend: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple:
    """Per-layer K (or V) pool shape. The CPU kernel keeps each head's block contiguous
    [blocks, kv_heads, block_size, D]; flash-attn and the torch path use [blocks, block_size, kv_heads, D]."""
    if backend == "cpu_kernel":
        return (num_blocks, num_kv_heads, block_size, head_dim)
    return (num_blocks, block_size, num_kv_heads, head_dim)


class PagedAttention(HooklessModule):
    """One layer's attention over the pool. q [T, H, D]; k, v [T, KVH, D] -> out [T, H * D]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: str):
        super().__init__()
        self.h, self.kvh, self.d, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.backend = backend            # cpu_kernel | triton | torch | flash
        self.heads_first = backend == "cpu_kernel"
        self.k_cache = self.v_cache = torch.empty(0)

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[2] if self.heads_first else self.k_cache.shape[1]

    def store(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, KVH, D] into the pool at slots [T]."""
        kc, vc = self.k_cache, self.v_cache
        if not self.heads_first:
            for cache, x in ((kc, k), (vc, v)):
                rows, new = cache.view(-1, self.kvh, self.d), x.to(cache.dtype)
                if cache.dtype == FP8:       # index_copy_ has no float8 kernel: copy the bytes
                    rows, new = rows.view(torch.uint8), new.view(torch.uint8)
                rows.index_copy_(0, slots, new)
            return
        assert k.stride()[1:] == (self.d, 1) and v.stride()[1:] == (self.d, 1)
        kernel("store_kv", k.dtype, kc.dtype)(
            k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kc.data_ptr(), vc.data_ptr(),
            slots.data_ptr(), k.shape[0], self.kvh, self.d, kc.shape[2], kc.stride(0), kc.stride(2), kc.stride(1))

    def _context(self, cache: torch.Tensor, block_ids: torch.Tensor, n: int) -> torch.Tensor:
        """[n, KVH, D]: the first n tokens of a sequence, gathered from its blocks."""
        blocks = cache[block_ids]
        if self.heads_first:
            blocks = blocks.transpose(1, 2)
        return blocks.reshape(-1, self.kvh, self.d)[:n]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        kc, vc = self.k_cache, self.v_cache
        bs = self.block_size
        self.store(k, v, meta.slot_mapping)
        if self.backend == "flash":
            return self._flash(q, meta)
        out = torch.empty(q.shape[0], self.h * self.d, dtype=q.dtype, device=q.device)
        tb = meta.num_batched_tokens
        if tb:
            if self.backend == "cpu_kernel":
                self._kernel(q, out, meta)
            elif self.backend == "triton":
                triton_paged_attention(q[:tb], kc, vc, meta.block_tables, meta.context_lens,
                                       meta.cu_query_lens, self.scale, out=out[:tb], single_query=meta.single_query)
            else:
                out[:tb] = self._gathered_decode(q[:tb], meta, bs)
        if meta.prefills and self._prefill_kernel(q, out, meta):
            return out
        for p in meta.prefills:
            qs = q[p.start:p.end].transpose(0, 1).unsqueeze(0)               # [1, H, n, D]
            if p.cached == 0:
                ks, vs = k[p.start:p.end], v[p.start:p.end]
                if kc.dtype != q.dtype:     # attend over what the cache holds, as decode will
                    ks, vs = ks.to(kc.dtype).to(q.dtype), vs.to(kc.dtype).to(q.dtype)
                o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0),
                                                   vs.transpose(0, 1).unsqueeze(0),
                                                   is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                ks = self._context(kc, p.block_ids, p.context_len).to(q.dtype)
                vs = self._context(vc, p.block_ids, p.context_len).to(q.dtype)
                n = p.end - p.start
                rows = torch.arange(p.cached, p.context_len, device=q.device)[:, None]
                mask = torch.arange(p.context_len, device=q.device)[None, :] <= rows   # bottom-right causal
                o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0),
                                                   vs.transpose(0, 1).unsqueeze(0),
                                                   attn_mask=mask, scale=self.scale, enable_gqa=True)
                assert o.shape[2] == n
            out[p.start:p.end] = o[0].transpose(0, 1).reshape(p.end - p.start, -1)
        return out

    def _kernel(self, q: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata) -> None:
        bt = meta.block_tables
        kc = self.k_cache
        rc = kernel("paged_attention", q.dtype, kc.dtype)(
            q.data_ptr(), q.stride(0), kc.data_ptr(), self.v_cache.data_ptr(), out.data_ptr(), out.stride(0),
            bt.data_ptr(), bt.shape[1], meta.context_lens.data_ptr(), meta.cu_query_lens.data_ptr(),
            bt.shape[0], self.h, self.kvh, self.d, self.block_size, kc.stride(0), kc.stride(2), kc.stride(1),
            self.scale)
        if rc != 0:
            raise RuntimeError(f"paged_attention kernel failed ({rc})")

    def _prefill_kernel(self, q: torch.Tensor, out: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Every prefill span through a C kernel reading the pool in place (head size 64/128, AVX-512 or AVX2
        build): float32 queries over a float32, bfloat16 or fp8 pool; bfloat16 queries over a bfloat16 or fp8
        pool on the bf16 pair dot product where the library has it (AVX-512 BF16), else widened to float32 and
        the output rounded back; except bf16 pools with AMX, where SDPA's bf16 GEMMs run on AMX tiles (not
        compared there). False where none applies (then SDPA runs)."""
        if meta.prefill_block_tables is None or (chosen := self.prefill_kernel(q.dtype)) is None:
            return False
        fn, dtype = chosen
        widen = dtype != q.dtype
        tb, bt, kc = meta.num_batched_tokens, meta.prefill_block_tables, self.k_cache
        qp, op = (q[tb:].float(), torch.empty(out.shape[0] - tb, out.shape[1])) if widen else (q[tb:], out[tb:])
        rc = fn(qp.data_ptr(), qp.stride(0), kc.data_ptr(), self.v_cache.data_ptr(), op.data_ptr(), op.stride(0),
                bt.data_ptr(), bt.shape[1], meta.prefill_context_lens.data_ptr(), meta.prefill_cu_query_lens.data_ptr(),
                bt.shape[0], self.h, self.kvh, self.d, self.block_size, kc.stride(0), kc.stride(2), kc.stride(1),
                self.scale)
        if rc == -3:        # queries it cannot read as bf16 pairs (an odd row stride)
            return False
        if rc != 0:
            raise RuntimeError(f"prefill_attention kernel failed ({rc})")
        if widen:
            out[tb:] = op
        return True

    def prefill_kernel(self, q_dtype: torch.dtype) -> tuple[object, torch.dtype] | None:
        """The C prefill kernel for queries of q_dtype over this pool (_prefill_kernel's rules) and the dtype
        it takes them in (q_dtype, or float32 where they are widened); None where SDPA runs them."""
        kv = self.k_cache.dtype
        if self.backend != "cpu_kernel" or kv not in (torch.float32, torch.bfloat16, FP8) \
                or self.d not in (64, 128) or self.h % self.kvh or self.h // self.kvh > 16:
            return None
        if q_dtype == torch.float32:
            dtypes = (q_dtype,)
        elif q_dtype == torch.bfloat16 and (kv == FP8 or (kv == torch.bfloat16 and not AMX)):
            dtypes = (q_dtype, torch.float32)     # an fp8 pool's rows widened to bf16 pairs, AMX or not
        else:
            return None
        for dtype in dtypes:
            try:
                return kernel("prefill_attention", dtype, kv), dtype
            except AttributeError:      # bf16: no pair dot product in this build; fp32: no AVX-512 / AVX2 + FMA
                continue
        return None

    def _gathered_decode(self, q: torch.Tensor, meta: AttentionMetadata, bs: int) -> torch.Tensor:
        """One query token per sequence: gather the blocks, SDPA with a length mask."""
        bt = meta.block_tables.long()
        b = bt.shape[0]
        length = bt.shape[1] * bs
        ks = self.k_cache[bt].view(b, length, self.kvh, self.d).transpose(1, 2).to(q.dtype)
        vs = self.v_cache[bt].view(b, length, self.kvh, self.d).transpose(1, 2).to(q.dtype)
        mask = torch.arange(length, device=q.device)[None, :] < meta.context_lens[:, None]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask[:, None, None, :],
                                           scale=self.scale, enable_gqa=True)
        return o.reshape(b, -1)

    def _flash(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # pragma: no cover
        if meta.single_query:    # decode graphs: lengths only from tensors, one query row per sequence
            o = flash_attn_with_kvcache(q.contiguous().unsqueeze(1), self.k_cache, self.v_cache,
                                        cache_seqlens=meta.context_lens, block_table=meta.block_tables,
                                        softmax_scale=self.scale, causal=True)
            return o.reshape(q.shape[0], -1)
        o = flash_attn_varlen_func(q.contiguous(), self.k_cache, self.v_cache, cu_seqlens_q=meta.cu_query_lens,
                                   cu_seqlens_k=meta.cu_context_lens, max_seqlen_q=meta.max_query_len_all,
                                   max_seqlen_k=meta.max_context_len, softmax_scale=self.scale,
                                   causal=True, block_table=meta.block_tables)
        return o.reshape(q.shape[0], -1)


def kv_cache_dtype(choice: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's element type for --kv-cache-dtype: auto is the weights' dtype; bfloat16 (half a float32
    pool's bytes) or fp8 (float8 e4m3, unscaled and saturating at +-448: half a bfloat16 pool's). Every
    backend but flash-attn 2 reads them (choose_backend); on CUDA fp8 needs compute capability 8.9 or newer
    (the Triton kernel's e4m3 loads). ValueError for a choice this device cannot serve."""
    if choice == "auto":
        return dtype
    if choice not in KV_ELEMENTS:
        raise ValueError(f"kv cache dtype {choice!r}: one of auto, {', '.join(KV_ELEMENTS)}")
    want = KV_ELEMENTS[choice]
    if want == FP8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError("kv cache dtype fp8: this GPU has no e4m3 conversions (compute capability below 8.9); "
                         "use auto or bfloat16")
    return want


def default_block_size(device_type: str) -> int:
    """KV block size when none is given: 256 on CUDA (flash-attn's paged-KV granularity, so flash reads
    the pool in place), 16 on CPU (the C kernel's sweet spot; finer prefix sharing)."""
    return 256 if device_type == "cuda" else 16


def flash_capable(device: torch.device) -> bool:
    """flash-attn 2 runs on Ampere and newer (compute capability 8.x+); a T4 / V100 fails at call time."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def flash_refusal(device: torch.device, dtype: torch.dtype, block_size: int,
                  kv_dtype: torch.dtype | None = None) -> str | None:
    """Why flash-attn does not serve a CUDA runner of this dtype, block size and pool element (None: the
    model's dtype); None when it does."""
    if flash_attn_varlen_func is None:
        return f"flash-attn does not import ({FLASH_IMPORT_ERROR})"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype}: flash-attn has no fp32 kernels"
    if kv_dtype not in (None, dtype):
        return f"kv cache dtype {kv_dtype}: flash-attn 2 reads a pool of the model's dtype only"
    if block_size % 256:
        return f"block size {block_size}: flash-attn reads paged KV in 256-token pages"
    if not flash_capable(device):
        return "compute capability below 8.0: flash-attn 2 needs Ampere or newer"
    return None


def choose_backend(device: torch.device, dtype: torch.dtype, block_size: int,
                   kv_dtype: torch.dtype | None = None) -> str:
    """flash (CUDA + flash-attn on Ampere+, fp16/bf16, block_size % 256 == 0, a pool of the model's dtype),
    triton (other CUDA cases), cpu_kernel (CPU, fp32/bf16, a C compiler) or torch. flash-attn has no fp32
    kernels (it rejects the call), so a float32 specialist on CUDA takes Triton even with 256-token blocks;
    so does a narrower pool (kv_dtype), which the Triton kernel widens as it loads.

    CONSORT_ATTENTION_BACKEND=torch forces the portable path (tests compare the two); =triton forces the
    Triton kernel (on CPU only under TRITON_INTERPRET=1, which is how tests run it without a GPU)."""
    forced = os.environ.get("CONSORT_ATTENTION_BACKEND")
    if forced == "torch" or (forced == "triton" and triton_available()):
        return forced
    if device.type == "cuda":
        if flash_refusal(device, dtype, block_size, kv_dtype) is None:
            return "flash"
        return "triton" if triton_available() else "torch"
    if dtype in (torch.float32, torch.bfloat16) and cpu_kernels() is not None:
        return "cpu_kernel"
    return "torch"
