"""A step's decoder layers in one C call (csrc/decoder.c), where every part of them runs on the engine's CPU
kernels: the C GEMMs (fp32; bf16 up to BF16_KERNEL_ROWS rows; int8 and w8a8 codes), the element-wise
kernels, decode attention and, for prefill spans, the C prefill kernel; adapter rows' LoRA updates on
csrc/lora.c; a hybrid's (Bamba's) mixer layers on csrc/mamba.c (decode rows, verify windows, prefill
chunks). Elsewhere (oneDNN's bf16 rows, SDPA prefills, tensor parallelism) the layers run one module at a
time as before.

The call does what DecoderLayer.forward does with the same kernels in the same order, so the output and the
pool are bit for bit the same; it saves the Python between the kernels (~80 us a layer: ctypes argument
conversion, tensor allocation, views), which at one sequence of a small model is a quarter of the step.
CONSORT_FUSED_LAYERS=0 turns it off.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from functools import partial
from itertools import accumulate
from ctypes import c_float, c_int64, c_void_p

import torch

from consort_engine.kv.state_pool import RowRuns, StateMetadata
from consort_engine.model.attention import AttentionMetadata
from consort_engine.model.cpu_kernels import cpu_kernels, kernel
from consort_engine.model.models.layers import MLP, Attention, DecoderLayer
from consort_engine.model.models.mamba2 import MAX_KERNEL_CONV, BambaLayer, Mamba2Mixer
from consort_engine.model.models.packed import GemmCall, c_address, gemm_call
from consort_engine.model.models.rope import RotaryEmbedding

OPS = {1: "q/k/v (or mixer input) projection", 2: "o (or mixer output) projection", 3: "gate/up projection",
       4: "down projection", 5: "decode attention", 6: "prefill attention", 7: "mixer step"}  # csrc/decoder.c's OP_*
ALIGN = 64             # bytes: each scratch buffer starts on a cache line


class _Linear(ctypes.Structure):
    _fields_ = [("fn", c_void_p), ("nargs", c_int64), ("w0", c_void_p), ("w1", c_void_p), ("w2", c_int64),
                ("w3", c_void_p), ("bias", c_void_p), ("n", c_int64), ("k", c_int64)]


class _LoraPair(ctypes.Structure):
    _fields_ = [("a", c_void_p), ("bt", c_void_p), ("r", c_int64), ("offset", c_int64), ("n", c_int64)]


class _Adapter(ctypes.Structure):
    _fields_ = [("pairs", c_void_p), ("first", c_void_p)]


class _Segment(ctypes.Structure):
    _fields_ = [("start", c_int64), ("end", c_int64), ("adapter", c_void_p)]


class _Mixer(ctypes.Structure):
    _fields_ = [(name, c_void_p) for name in ("conv_w", "conv_b", "dt_bias", "D", "norm", "A")] + [("index", c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", c_void_p), ("post_norm", c_void_p), ("q_norm", c_void_p), ("k_norm", c_void_p),
                ("k_cache", c_void_p), ("v_cache", c_void_p),
                ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear), ("mixer", c_void_p)]


MIXER_DIMS = ("inner", "conv_dim", "m_heads", "m_head_dim", "groups", "d_state", "d_conv")


class _Model(ctypes.Structure):
    _fields_ = [(name, c_int64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter", "block_size",
                                              "elem", "blk_stride", "tok_stride", "head_stride", "rot",
                                              *MIXER_DIMS)] + \
               [("eps", c_float), ("scale", c_float), ("dt_lo", c_float), ("dt_hi", c_float)] + \
               [(name, c_void_p) for name in ("cos", "sin", "rms_norm", "add_rms_norm", "rope", "silu_mul",
                                              "store_kv", "paged_attention", "prefill_attention", "lora_jobs",
                                              "time_steps", "mamba_step", "gated_rms_norm", "mamba_conv",
                                              "mamba_scan")]


class _Step(ctypes.Structure):
    _fields_ = [("rows", c_int64), ("batched_rows", c_int64), ("positions", c_void_p), ("slots", c_void_p),
                ("bt", c_void_p), ("ctx", c_void_p), ("cu", c_void_p), ("bt_width", c_int64),
                ("batched_seqs", c_int64), ("pbt", c_void_p), ("pctx", c_void_p), ("pcu", c_void_p),
                ("pbt_width", c_int64), ("prefill_seqs", c_int64)] + \
               [(name, c_void_p) for name in ("residual", "h", "x", "qkv", "attn", "gu", "act")] + \
               [("n_segments", c_int64), ("segments", c_void_p), ("n_decode", c_int64), ("decode_rows", c_void_p),
                ("decode_slots", c_void_p), ("conv", c_void_p), ("conv_slot", c_int64), ("conv_mixer", c_int64),
                ("ssm", c_void_p), ("ssm_slot", c_int64), ("ssm_mixer", c_int64), ("n_windows", c_int64),
                ("win_rows", c_void_p), ("win_lengths", c_void_p), ("win_slots", c_void_p), ("kept", c_void_p),
                ("n_chunks", c_int64), ("starts", c_void_p), ("ends", c_void_p), ("chunk_slots", c_void_p),
                ("n_cuts", c_int64), ("cut_chunk", c_void_p), ("cut_off", c_void_p), ("cut_row", c_void_p),
                ("ckpt_conv", c_void_p), ("ckpt_conv_row", c_int64), ("ckpt_conv_mixer", c_int64),
                ("ckpt_ssm", c_void_p), ("ckpt_ssm_row", c_int64), ("ckpt_ssm_mixer", c_int64),
                ("conv_out", c_void_p)]


def _linear(call: GemmCall) -> _Linear:
    w = (*call.weights, 0, 0, 0)[:4]
    return _Linear(call.fn, len(call.weights), w[0], w[1], w[2], w[3], call.bias, call.n, call.k)


def _parts(layer) -> tuple | None:
    """(input norm, post-attention norm, attention or None, mixer or None, MLP) of a layer the call runs: a
    DecoderLayer, or a hybrid's attention or mixer layer (BambaLayer); None for any other."""
    if type(layer) is DecoderLayer:
        parts = layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn, None, layer.mlp
    elif type(layer) is BambaLayer:
        parts = layer.input_layernorm, layer.pre_ff_layernorm, layer.self_attn, layer.mamba, layer.feed_forward
    else:
        return None
    _, _, attn, mixer, mlp = parts
    if type(mlp) is not MLP or (type(attn) is not Attention if mixer is None else type(mixer) is not Mamba2Mixer):
        return None
    return parts


def _projections(layer) -> tuple:
    """A layer's projections in csrc/decoder.c's PROJ_* order (a mixer's in_proj / out_proj for q/k/v / o)."""
    _, _, attn, mixer, mlp = _parts(layer)
    first, second = (attn.qkv_proj, attn.o_proj) if mixer is None else (mixer.in_proj, mixer.out_proj)
    return first, second, mlp.gate_up_proj, mlp.down_proj


def _adapters(layers: Sequence) -> dict[str, tuple]:
    """Every adapter on the layers' projections as its C table (csrc/decoder.c adapter_t), with the arrays the
    table points into; the A and Bt tensors stay with the projections (Linear.lora) while the plan lives."""
    out = {}
    for name in sorted({name for layer in layers for lin in _projections(layer) for name in lin.lora}):
        pairs, first = [], [0]
        for layer in layers:
            for lin in _projections(layer):
                pairs += [_LoraPair(a.data_ptr(), bt.data_ptr(), a.shape[0], offset, n)
                          for offset, n, a, bt in lin.lora.get(name, ())]
                first.append(len(pairs))
        arrays = ((_LoraPair * len(pairs))(*pairs), (c_int64 * len(first))(*first))
        out[name] = (_Adapter(*map(ctypes.addressof, arrays)), arrays)
    return out


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _attention(layers: Sequence) -> list[Attention]:
    return [layer.self_attn for layer in layers if layer.self_attn is not None]


def _pools(layers: Sequence) -> tuple[int, int]:
    """Where the layers' pools start and end, which a plan points into."""
    attn = _attention(layers)
    return (attn[0].attn.k_cache.data_ptr(), attn[-1].attn.v_cache.data_ptr()) if attn else (0, 0)


def _mixer(mixer, dtype: torch.dtype) -> tuple[_Mixer, torch.Tensor] | None:
    """A mixer's C parameters (csrc/decoder.c mixer_t) and the A tensor they point into; None where its decode
    step is not on the C kernels."""
    if not mixer.fast or mixer.d_conv > MAX_KERNEL_CONV or not all(
            p.dtype == dtype for p in (mixer.conv1d.weight, mixer.dt_bias, mixer.D, mixer.norm.weight)):
        return None
    A = mixer.decay_rates()
    return _Mixer(mixer.conv1d.weight.data_ptr(), _pointer(mixer.conv1d.bias), mixer.dt_bias.data_ptr(),
                  mixer.D.data_ptr(), mixer.norm.weight.data_ptr(), A.data_ptr(), mixer.index), A


def _table_shape(block_tables: torch.Tensor | None) -> tuple[int, int]:
    """(width, sequences) of a group's block tables; zeros for a group the step does not have."""
    return (0, 0) if block_tables is None else (block_tables.shape[1], block_tables.shape[0])


def _state_pools(step: _Step, st: StateMetadata) -> None:
    """A hybrid step's conv and SSM slot pools, with their slot and mixer strides (csrc/decoder.c step_t)."""
    step.conv, step.conv_slot, step.conv_mixer = st.conv.data_ptr(), st.conv.stride(0), st.conv.stride(1)
    step.ssm, step.ssm_slot, step.ssm_mixer = st.ssm.data_ptr(), st.ssm.stride(0), st.ssm.stride(1)


def _windows(step: _Step, runs: RowRuns) -> None:
    """Runs of rows each stepped from its slot (a verify step's windows, or their kept rows at the commit)."""
    ids = runs.ids
    step.n_windows, step.win_rows, step.win_lengths, step.win_slots = ids[0].shape[0], *(t.data_ptr() for t in ids)


class FusedLayers:
    """The C plan of a model's decoder layers for one activation dtype: every layer's weights and pools as
    pointers, built once (plan) and run per step (run) where it applies."""

    def __init__(self, model: _Model, layers: ctypes.Array, max_rows: int | None, widths: tuple[int, ...],
                 dtype: torch.dtype, pools: tuple[int, int], adapters: dict[str, tuple],
                 mixers: list[tuple[_Mixer, torch.Tensor]]):
        self.model, self.layers, self.max_rows = model, layers, max_rows
        self.widths, self.dtype, self.pools, self.adapters = widths, dtype, pools, adapters
        self.mixers = mixers           # what the layers' mixer pointers point at: kept while the plan lives
        lib = cpu_kernels()
        self.fn, self.commit_fn = lib.decoder_layers, lib.commit_windows

    @classmethod
    def plan(cls, layers: Sequence, rotary: RotaryEmbedding, dtype: torch.dtype) -> FusedLayers | None:
        """The plan for `layers` (DecoderLayers, or a hybrid's attention and mixer layers, over their pools) with
        `dtype` activations, or None where some part of them is not on the engine's kernels (or
        CONSORT_FUSED_LAYERS=0)."""
        if os.environ.get("CONSORT_FUSED_LAYERS", "1") == "0" or dtype not in (torch.float32, torch.bfloat16) \
                or cpu_kernels() is None or not hasattr(cpu_kernels(), "decoder_layers") or not layers:
            return None
        parts = [_parts(layer) for layer in layers]
        if None in parts or not _attention(layers):
            return None
        first = _attention(layers)[0]
        attn = first.attn
        if attn.backend != "cpu_kernel" or attn.k_cache.dim() != 4:
            return None
        structs, bounds, mixers = [], [], []
        for layer, (in_norm, post_norm, a, mixer, _) in zip(layers, parts):
            linears = _projections(layer)
            if any(lin.parallel is not None or lin.packed is None for lin in linears):
                return None
            calls = [gemm_call(lin.packed, dtype) for lin in linears]
            if any(c is None for c in calls):
                return None
            bounds += [lin.packed.max_rows for lin in linears if hasattr(lin.packed, "max_rows")]
            if mixer is not None:
                if (m := _mixer(mixer, dtype)) is None:
                    return None
                mixers.append(m)
                structs.append(_Layer(in_norm.weight.data_ptr(), post_norm.weight.data_ptr(), 0, 0, 0, 0,
                                      *map(_linear, calls), ctypes.addressof(m[0])))
                continue
            if a.attn.k_cache.dtype != attn.k_cache.dtype or a.attn.k_cache.stride() != attn.k_cache.stride():
                return None
            structs.append(_Layer(in_norm.weight.data_ptr(), post_norm.weight.data_ptr(),
                                  _pointer(None if a.q_norm is None else a.q_norm.weight),
                                  _pointer(None if a.k_norm is None else a.k_norm.weight),
                                  a.attn.k_cache.data_ptr(), a.attn.v_cache.data_ptr(), *map(_linear, calls), 0))
        kv = attn.k_cache.dtype
        prefill = attn.prefill_kernel(dtype)
        prefill_fn = c_address(prefill[0]) if prefill is not None and prefill[1] == dtype else None
        kernels = [c_address(kernel(name, dtype)) for name in ("rms_norm", "add_rms_norm", "rope", "silu_mul")]
        kernels += [c_address(kernel(name, dtype, kv)) for name in ("store_kv", "paged_attention")]
        hybrid = [c_address(kernel(name, dtype)) for name in ("mamba_time_steps", "mamba_step", "gated_rms_norm",
                                                              "mamba_conv", "mamba_scan")]
        lora_jobs = c_address(kernel("lora_jobs", dtype))
        if None in kernels or lora_jobs is None or (mixers and None in hybrid):
            return None
        h, kvh, d = first.h, first.kvh, first.d
        inter = parts[0][4].gate_up_proj.shard_sizes[0]
        hidden = layers[0].input_layernorm.weight.shape[0]
        mx = next((p[3] for p in parts if p[3] is not None), None)
        dims = (0,) * len(MIXER_DIMS) if mx is None else \
            (mx.inner, mx.conv_dim, mx.heads, mx.head_dim, mx.groups, mx.d_state, mx.d_conv)
        kc = attn.k_cache
        model = _Model(hidden, h, kvh, d, inter, attn.block_size, torch.finfo(dtype).bits // 8,
                       kc.stride(0), kc.stride(2), kc.stride(1), 2 * rotary.cos.shape[1], *dims,
                       layers[0].input_layernorm.eps, attn.scale, *(mx.dt_limit if mx is not None else (0, 0)),
                       rotary.cos.data_ptr(), rotary.sin.data_ptr(), *kernels, prefill_fn or 0, lora_jobs,
                       *(hybrid if mixers else (0,) * len(hybrid)))
        # scratch per row, in elements: the layer output, the normed rows, q/k/v (a mixer's gate | xbc | dt),
        # attention (its y), gate/up, SiLU x up (its gated norm), a mixer's conv output (prefill chunks)
        inner, proj, conv = (mx.inner, mx.inner + mx.conv_dim + mx.heads, mx.conv_dim) if mx is not None else (0,) * 3
        widths = (hidden, hidden, max((h + 2 * kvh) * d, proj), max(h * d, inner), 2 * inter, max(inter, inner), conv)
        return cls(model, (_Layer * len(structs))(*structs), min(bounds, default=None), widths, dtype,
                   _pools(layers), _adapters(layers), mixers)

    @classmethod
    def refresh(cls, plan: FusedLayers | None | bool, layers: Sequence, rotary: RotaryEmbedding,
                dtype: torch.dtype) -> FusedLayers | None:
        """`plan` while it is still that of these layers' pools (a runner may give the layers new ones), else
        a new one; False: none made yet."""
        if plan is False or (plan is not None and plan.pools != _pools(layers)):
            return cls.plan(layers, rotary, dtype)
        return plan

    def applies(self, h: torch.Tensor, meta: AttentionMetadata,
                segments: Sequence[tuple[int, int, str]] = ()) -> bool:
        """Whether this step's rows run here: the dtype planned, rows every GEMM takes, prefill spans only with
        the C prefill kernel, a hybrid's rows in decode rows, verify windows and prefill chunks (each on the C
        kernels), adapter segments (lora.segments_of) of adapters the plan has."""
        rows, st = h.shape[0], meta.state
        if st is not None:
            decode = 0 if st.decode_ids is None else st.decode_ids[0].shape[0]
            windows = 0 if st.windows is None else sum(st.windows.runs.lengths)
            chunks = sum(end - start for start, end, _ in st.chunks)
            if not self.mixers or decode + windows + chunks != rows or st.conv.dtype != self.dtype \
                    or (chunks and st.chunk_ids is None):
                return False
        return (h.dtype == self.dtype and rows > 0 and (self.max_rows is None or rows <= self.max_rows)
                and all(name in self.adapters for _, _, name in segments)
                and (not meta.prefills or (self.model.prefill_attention and meta.prefill_block_tables is not None)))

    def _state(self, step: _Step, st: StateMetadata, rows: int, conv_out: int) -> torch.Tensor | None:
        """A hybrid step's fields of `step` (csrc/decoder.c step_t): the state pools, the decode rows, verify
        windows and prefill chunks (with their checkpoints); conv_out: the chunks' conv scratch. Returns the
        buffer each mixer's projection goes to where the step has windows (commit_windows steps from it)."""
        kept = None
        _state_pools(step, st)
        if st.decode_ids is not None:
            step.n_decode, step.decode_rows, step.decode_slots = st.decode_ids[0].shape[0], \
                *(t.data_ptr() for t in st.decode_ids)
        if st.windows is not None:
            _windows(step, st.windows.runs)
            m = self.model
            kept = torch.empty(len(self.mixers), rows, m.inner + m.conv_dim + m.m_heads, dtype=self.dtype)
            step.kept = kept.data_ptr()
        if st.chunks:
            (starts, ends, slots), (cut_chunk, cut_off, cut_row) = st.chunk_ids
            step.n_chunks, step.starts, step.ends, step.chunk_slots = starts.shape[0], starts.data_ptr(), \
                ends.data_ptr(), slots.data_ptr()
            step.n_cuts, step.cut_chunk, step.cut_off, step.cut_row = cut_chunk.shape[0], \
                cut_chunk.data_ptr(), cut_off.data_ptr(), cut_row.data_ptr()
            if st.ckpt_conv is not None:
                c, k = st.ckpt_conv, st.ckpt_ssm
                step.ckpt_conv, step.ckpt_conv_row, step.ckpt_conv_mixer = c.data_ptr(), c.stride(0), c.stride(1)
                step.ckpt_ssm, step.ckpt_ssm_row, step.ckpt_ssm_mixer = k.data_ptr(), k.stride(0), k.stride(1)
            step.conv_out = conv_out
        return kept

    def _commit(self, st: StateMetadata, kept: torch.Tensor, y: torch.Tensor, runs: RowRuns) -> None:
        """The kept runs of the verify windows stepped again into their slots by every mixer in one C call
        (csrc/decoder.c commit_windows), from the projections `kept` the verify step left (y: scratch), as
        HybridState.commit_windows steps them mixer by mixer."""
        step = _Step(rows=kept.shape[1], attn=y.data_ptr(), kept=kept.data_ptr())
        _state_pools(step, st)
        _windows(step, runs)
        rc = self.commit_fn(ctypes.byref(self.model), self.layers, len(self.layers), ctypes.byref(step))
        if rc:
            raise MemoryError(f"decoder layer {rc // 16}: the mixer step kernel has no memory for its buffers")

    def run(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            segments: Sequence[tuple[int, int, str]] = ()) -> torch.Tensor:
        """h: the embeddings [T, hidden] (the residual stream, updated in place) -> the last layer's output plus
        the residual stream, as CausalLM.forward returns it; segments: the rows that carry an adapter."""
        rows, elem = h.shape[0], self.model.elem
        sizes = [-(-rows * w * elem // ALIGN) * ALIGN // elem for w in self.widths]
        scratch = torch.empty(sum(sizes), dtype=h.dtype)
        base = scratch.data_ptr()
        out, x, qkv, attn, gu, act, conv_out = (base + start * elem for start in (0, *accumulate(sizes[:-1])))
        nb, none = meta.num_batched_tokens, (None, None, None)
        batched = (meta.block_tables, meta.context_lens, meta.cu_query_lens) if nb else none
        prefill = (meta.prefill_block_tables, meta.prefill_context_lens,
                   meta.prefill_cu_query_lens) if meta.prefills else none
        segs = (_Segment * len(segments))(*(_Segment(start, end, ctypes.addressof(self.adapters[name][0]))
                                            for start, end, name in segments))
        step = _Step(rows, nb, positions.data_ptr(), meta.slot_mapping.data_ptr(), *map(_pointer, batched),
                     *_table_shape(batched[0]), *map(_pointer, prefill), *_table_shape(prefill[0]),
                     h.data_ptr(), out, x, qkv, attn, gu, act, len(segments), ctypes.addressof(segs))
        kept = None if meta.state is None else self._state(step, meta.state, rows, conv_out)
        rc = self.fn(ctypes.byref(self.model), self.layers, len(self.layers), ctypes.byref(step))
        if kept is not None:     # what each mixer's step took, as Mamba2Mixer.forward keeps it (y: scratch)
            m, y = self.model, torch.empty(rows, self.model.inner, dtype=h.dtype)
            win = meta.state.windows
            win.inputs[:] = [(p[:, m.inner:m.inner + m.conv_dim], p[:, m.inner + m.conv_dim:], y) for p in kept]
            win.commit = partial(self._commit, meta.state, kept, y)
        if rc:
            layer, op = divmod(rc, 16)
            if op in (1, 2, 3, 4, 7):
                what = OPS[op] + (" kernel" if op == 7 else " (GEMM or LoRA update)")
                raise MemoryError(f"decoder layer {layer}: the {what} has no memory for its buffers ({rows} rows)")
            raise RuntimeError(f"decoder layer {layer}: {OPS.get(op, op)} kernel failed")
        return scratch[:rows * self.widths[0]].view(rows, -1) + h
