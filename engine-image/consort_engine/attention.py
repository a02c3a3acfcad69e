"""Paged attention: K/V live in a block pool per layer, [num_blocks, block_size, kv_heads, head_dim]
(flash-attn's paged layout); every sequence reads them through its block table.

A step's tokens are laid out as [batched group | prefill spans]:
- the batched group (decode tokens, short queries such as spec-verify windows) is attended in ONE
  call per layer: on CPU a C kernel that reads the pool in place through the block tables
  (csrc/paged_attention.c); otherwise a gather of the blocks + SDPA with a length mask.
- prefill spans (one per sequence chunk) use SDPA: causal over the chunk's own K/V when nothing
  precedes it, otherwise over the gathered context with a bottom-right causal mask.
With flash-attn installed on CUDA (and block_size a multiple of 256, its paged-KV constraint) every
token goes through flash_attn_varlen_func with the block table instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

try:  # pragma: no cover - only on CUDA machines with flash-attn
    from flash_attn import flash_attn_varlen_func
except Exception:  # noqa: BLE001 - any import failure means "not available"
    flash_attn_varlen_func = None


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
    # flash-attn varlen path (CUDA): one call covers every token
    cu_context_lens: torch.Tensor | None = None
    max_query_len_all: int = 0


# ---------------------------------------------------------------------------------------------
# CPU kernel: compiled once per machine (a second or two), cached under ~/.cache/consort/kernels
# ---------------------------------------------------------------------------------------------
_KERNEL_SRC = Path(__file__).with_name("csrc") / "paged_attention.c"
_kernel_lib: ctypes.CDLL | None | bool = False   # False = not tried yet


def _build_kernel() -> ctypes.CDLL | None:
    if os.environ.get("CONSORT_CPU_KERNEL", "1") == "0" or not _KERNEL_SRC.exists():
        return None
    src = _KERNEL_SRC.read_bytes()
    cc = os.environ.get("CC", "cc")
    flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode() + os.uname().machine.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("CONSORT_CACHE", Path.home() / ".cache" / "consort")) / "kernels"
    so = cache / f"paged_attention-{key}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / so.name
            try:
                subprocess.run([cc, *flags, "-o", str(out), str(_KERNEL_SRC), "-lm"], check=True,
                               capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError):
                return None
            os.replace(out, so)     # atomic: concurrent engines never load a half-written file
    # torch has loaded its libgomp already; the kernel's DT_NEEDED libgomp.so.1 resolves to it
    lib = ctypes.CDLL(str(so))
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    for name in ("paged_attention_f32", "paged_attention_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [P, L, P, P, P, L, P, I, P, P, I, I, I, I, I, ctypes.c_float]
        fn.restype = I
    return lib


def cpu_kernel() -> ctypes.CDLL | None:
    global _kernel_lib
    if _kernel_lib is False:
        _kernel_lib = _build_kernel()
    return _kernel_lib


class PagedAttention(torch.nn.Module):
    """One layer's attention over the pool. q [T, H, D]; k, v [T, KVH, D] -> out [T, H * D]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: str):
        super().__init__()
        self.h, self.kvh, self.d, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.backend = backend            # cpu_kernel | torch | flash
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        kc, vc = self.k_cache, self.v_cache
        bs = kc.shape[1]
        kc.view(-1, self.kvh, self.d).index_copy_(0, meta.slot_mapping, k)
        vc.view(-1, self.kvh, self.d).index_copy_(0, meta.slot_mapping, v)
        if self.backend == "flash":
            return self._flash(q, meta)
        out = torch.empty(q.shape[0], self.h * self.d, dtype=q.dtype, device=q.device)
        tb = meta.num_batched_tokens
        if tb:
            if self.backend == "cpu_kernel":
                self._kernel(q, out, meta)
            else:
                out[:tb] = self._gathered_decode(q[:tb], meta, bs)
        for p in meta.prefills:
            qs = q[p.start:p.end].transpose(0, 1).unsqueeze(0)               # [1, H, n, D]
            if p.cached == 0:
                ks, vs = k[p.start:p.end], v[p.start:p.end]
                o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1).unsqueeze(0),
                                                   vs.transpose(0, 1).unsqueeze(0),
                                                   is_causal=True, scale=self.scale, enable_gqa=True)
            else:
                ks = kc[p.block_ids].view(-1, self.kvh, self.d)[:p.context_len]
                vs = vc[p.block_ids].view(-1, self.kvh, self.d)[:p.context_len]
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
        lib = cpu_kernel()
        fn = lib.paged_attention_f32 if q.dtype == torch.float32 else lib.paged_attention_bf16
        bt = meta.block_tables
        rc = fn(q.data_ptr(), q.stride(0), self.k_cache.data_ptr(), self.v_cache.data_ptr(),
                out.data_ptr(), out.stride(0), bt.data_ptr(), bt.shape[1], meta.context_lens.data_ptr(),
                meta.cu_query_lens.data_ptr(), bt.shape[0], self.h, self.kvh, self.d,
                self.k_cache.shape[1], self.scale)
        if rc != 0:
            raise RuntimeError(f"paged_attention kernel failed ({rc})")

    def _gathered_decode(self, q: torch.Tensor, meta: AttentionMetadata, bs: int) -> torch.Tensor:
        """One query token per sequence: gather the blocks, SDPA with a length mask."""
        bt = meta.block_tables.long()
        b = bt.shape[0]
        length = bt.shape[1] * bs
        ks = self.k_cache[bt].view(b, length, self.kvh, self.d).transpose(1, 2)
        vs = self.v_cache[bt].view(b, length, self.kvh, self.d).transpose(1, 2)
        mask = torch.arange(length, device=q.device)[None, :] < meta.context_lens[:, None]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), ks, vs, attn_mask=mask[:, None, None, :],
                                           scale=self.scale, enable_gqa=True)
        return o.reshape(b, -1)

    def _flash(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:  # pragma: no cover
        o = flash_attn_varlen_func(q, self.k_cache, self.v_cache, cu_seqlens_q=meta.cu_query_lens,
                                   cu_seqlens_k=meta.cu_context_lens, max_seqlen_q=meta.max_query_len_all,
                                   max_seqlen_k=meta.max_context_len, softmax_scale=self.scale,
                                   causal=True, block_table=meta.block_tables)
        return o.reshape(q.shape[0], -1)


def choose_backend(device: torch.device, dtype: torch.dtype, block_size: int) -> str:
    """flash (CUDA + flash-attn), cpu_kernel (CPU, fp32/bf16, a C compiler) or torch.

    CONSORT_ATTENTION_BACKEND=torch forces the portable path (tests compare the two)."""
    if os.environ.get("CONSORT_ATTENTION_BACKEND") == "torch":
        return "torch"
    if device.type == "cuda":
        return "flash" if flash_attn_varlen_func is not None and block_size % 256 == 0 else "torch"
    if dtype in (torch.float32, torch.bfloat16) and cpu_kernel() is not None:
        return "cpu_kernel"
    return "torch"
