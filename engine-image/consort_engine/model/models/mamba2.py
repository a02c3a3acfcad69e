"""A hybrid's mixer layer (Bamba's, transformers' BambaDecoderLayer): RMSNorm, then attention or a Mamba2
mixer, then RMSNorm with the residual add and the MLP.

Mixer layers hold no KV: their conv and SSM state live in the runner's state slot pool ([max_num_seqs,
mixer layers, ...], see state_pool.py), one slot per running sequence. Per step:
- every single-token row (decode) of the batch goes through ONE batched recurrence step per layer,
  reading and writing the states of their slots by index;
- every multi-token row group (a prefill chunk) runs the chunked SSD scan from its slot's state and
  writes the state after its last token back (chunked prefill continues from it). A chunk with
  checkpoints (prefix caching) scans up to each one and saves the state there too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from consort_engine.model.attention import AttentionMetadata
from consort_engine.model.cpu_kernels import kernel
from consort_engine.model.loader import ModelConfig
from consort_engine.kv.state_pool import RowRuns, StateMetadata
from consort_engine.model.models import ssd
from consort_engine.model.models.layers import MLP, Attention, Linear, RMSNorm
from consort_engine.model.models.rope import RotaryEmbedding
from consort_engine.model.hookless import HooklessModule


class Conv1d(HooklessModule):
    """The depthwise conv's parameters under the checkpoint's names (weight [C, 1, K], bias [C])."""

    def __init__(self, channels: int, kernel: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(channels), requires_grad=False) if bias else None


class GatedRMSNorm(HooklessModule):
    """RMSNorm of y * silu(gate) over groups of the channels (transformers' BambaRMSNormGated)."""

    def __init__(self, dim: int, groups: int, eps: float, fast: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.groups, self.eps, self.fast = groups, eps, fast

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.fast:     # csrc/elementwise.c: one call instead of ~12 tensor ops
            out = torch.empty_like(y)
            kernel("gated_rms_norm", y.dtype)(y.data_ptr(), gate.data_ptr(), gate.stride(0), out.data_ptr(),
                                              self.weight.data_ptr(), y.shape[0], y.shape[1], self.groups, self.eps)
            return out
        dtype = y.dtype
        y = y.float() * F.silu(gate.float())
        g = y.view(y.shape[0], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view_as(y).to(dtype)


MAX_KERNEL_CONV = 9     # csrc/mamba.c's prefill conv holds up to 9 taps (d_conv; Mamba2 models use 4)


class Mamba2Mixer(HooklessModule):
    def __init__(self, cfg: ModelConfig, index: int, fast: bool = False):
        super().__init__()
        raw = cfg.raw
        self.index = index                                   # this mixer's row in the state pool
        self.fast = fast                                     # CPU kernels: decode step, prefill conv and scans in C
        self.heads = int(raw["mamba_n_heads"])
        self.inner = int(raw.get("mamba_expand", 2)) * cfg.hidden_size
        self.head_dim = self.inner // self.heads
        self.groups = int(raw.get("mamba_n_groups", 1))
        self.d_state = int(raw.get("mamba_d_state", 256))
        self.d_conv = int(raw.get("mamba_d_conv", 4))
        self.chunk_size = int(raw.get("mamba_chunk_size", 256))
        self.conv_dim = self.inner + 2 * self.groups * self.d_state
        self.dt_limit = time_step_limit(raw.get("time_step_limit"))
        self.in_proj = Linear(cfg.hidden_size, [self.inner + self.conv_dim + self.heads],
                              bool(raw.get("mamba_proj_bias", False)))
        self.conv1d = Conv1d(self.conv_dim, self.d_conv, bool(raw.get("mamba_conv_bias", True)))
        self.dt_bias = nn.Parameter(torch.ones(self.heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.heads), requires_grad=False)
        self.D = nn.Parameter(torch.ones(self.heads), requires_grad=False)
        self.norm = GatedRMSNorm(self.inner, self.groups, cfg.rms_norm_eps, fast)
        self.out_proj = Linear(self.inner, [cfg.hidden_size], bool(raw.get("mamba_proj_bias", False)))

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per sequence: conv state [conv_dim, d_conv - 1], SSM state [heads, head_dim, d_state]."""
        return (self.conv_dim, self.d_conv - 1), (self.heads, self.head_dim, self.d_state)

    def step(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, y: torch.Tensor, runs: RowRuns,
             conv_state: torch.Tensor, ssm_state: torch.Tensor, keep: bool = True) -> None:
        """The recurrence over runs of rows, each token by token from its slot's state: in C with the CPU
        kernels (dt: the time steps, softplus(dt + dt_bias)), else tensor ops position by position (dt as
        projected). keep: the state after each run goes into its slot; else the slots stay as they were."""
        if self.fast:
            self._step_kernel(xbc, dt, A, y, *runs.ids, conv_state, ssm_state, keep)
            return
        if not keep:        # step copies of the slots' state
            idx, runs = runs.on_copies
            conv_state, ssm_state = conv_state[idx], ssm_state[idx]
        for rows, slots in runs.by_position:
            self._step(xbc, dt, A, y, rows, slots, conv_state, ssm_state)

    def _step(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, y: torch.Tensor,
              rows: torch.Tensor | slice, slots: torch.Tensor | slice, conv_state: torch.Tensor,
              ssm_state: torch.Tensor) -> None:
        """step in tensor ops (models/ssd.py); rows and slots may be slices."""
        n, gs = self.inner, self.groups * self.d_state
        out, conv_new = ssd.conv_step(xbc[rows], conv_state[slots], self.conv1d.weight[:, 0], self.conv1d.bias)
        conv_state[slots] = conv_new.to(conv_state.dtype)
        xs, B, C = out.split([n, gs, gs], dim=-1)
        b = xs.shape[0]
        ys, ssm_new = ssd.state_update(ssm_state[slots], xs.view(b, self.heads, self.head_dim), dt[rows], A,
                                       B.view(b, self.groups, -1), C.view(b, self.groups, -1), self.D, self.dt_bias)
        ssm_state[slots] = ssm_new
        y[rows] = ys.reshape(b, -1)

    def step_again(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], runs: RowRuns,
                   conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Verify windows' kept rows stepped again into their slots, from the inputs this mixer's forward
        kept (xbc, dt as `step` takes it, y as scratch): hybrid_state.commit_windows."""
        xbc, dt, y = inputs
        self.step(xbc, dt, self.decay_rates(), y, runs, conv_state, ssm_state)

    def decay_rates(self) -> torch.Tensor:
        """A = -exp(A_log) per head, float32: what the steps and scans take (the state decays by exp(dt A))."""
        return -torch.exp(self.A_log.float())

    def time_steps(self, dt: torch.Tensor) -> torch.Tensor:
        """softplus(dt + dt_bias) for every row of the step, rounded to the model dtype as the torch path
        rounds it: what the C kernels take as dt (csrc/mamba.c mamba_time_steps with them, else tensor ops)."""
        bias = self.dt_bias.to(dt.dtype)
        if not self.fast:
            return F.softplus(dt + bias)
        out = torch.empty(dt.shape, dtype=dt.dtype)
        kernel("mamba_time_steps", dt.dtype)(dt.data_ptr(), dt.stride(0), bias.data_ptr(), out.data_ptr(),
                                             out.stride(0), dt.shape[0], dt.shape[1])
        return out

    def _step_kernel(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, y: torch.Tensor,
                     rows: torch.Tensor, lengths: torch.Tensor | None, slots: torch.Tensor, conv_state: torch.Tensor,
                     ssm_state: torch.Tensor, keep: bool = True) -> None:
        """step in C (csrc/mamba.c), all runs in one call; no lengths: runs of one row."""
        w, b = self.conv1d.weight, self.conv1d.bias
        rc = kernel("mamba_step", y.dtype)(
            xbc.data_ptr(), xbc.stride(0), dt.data_ptr(), dt.stride(0), rows.data_ptr(),
            None if lengths is None else lengths.data_ptr(), slots.data_ptr(), rows.shape[0], int(keep),
            conv_state.data_ptr(), conv_state.stride(0), ssm_state.data_ptr(), ssm_state.stride(0),
            w.data_ptr(), None if b is None else b.data_ptr(), A.data_ptr(), self.D.data_ptr(),
            y.data_ptr(), y.stride(0), self.conv_dim, self.d_conv, self.heads, self.head_dim, self.groups,
            self.d_state)
        if rc:
            raise MemoryError(f"mamba_step: no memory for its buffer ({rows.shape[0]} rows)")

    def _scan_kernel(self, xbc: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, y: torch.Tensor,
                     st: StateMetadata, ssm_state: torch.Tensor) -> None:
        """The SSD scans of every prefill chunk at once, in C (csrc/mamba.c, the recurrence token by token):
        xbc holds the chunks' conv output rows, dt the time steps (softplus(dt + dt_bias)); their slots'
        SSM state and checkpoint rows are written."""
        (starts, ends, slots), (cut_chunk, cut_off, cut_row) = st.chunk_ids
        ckpt = None if st.ckpt_ssm is None else st.ckpt_ssm[:, self.index]
        kernel("mamba_scan", y.dtype)(
            xbc.data_ptr(), xbc.stride(0), dt.data_ptr(), dt.stride(0), starts.data_ptr(), ends.data_ptr(),
            slots.data_ptr(), starts.shape[0], cut_chunk.data_ptr(), cut_off.data_ptr(), cut_row.data_ptr(),
            cut_chunk.shape[0], ssm_state.data_ptr(), ssm_state.stride(0), None if ckpt is None else ckpt.data_ptr(),
            0 if ckpt is None else ckpt.stride(0), A.data_ptr(), self.D.data_ptr(),
            self.dt_limit[0], self.dt_limit[1], y.data_ptr(), y.stride(0), self.heads, self.head_dim,
            self.groups, self.d_state)

    def _conv_kernel(self, xbc: torch.Tensor, conv_out: torch.Tensor, st: StateMetadata,
                     conv_state: torch.Tensor) -> None:
        """conv_chunk for every prefill chunk at once, in C (csrc/mamba.c): their rows of conv_out, their
        slots' conv state and the conv state at their checkpoints."""
        (starts, ends, slots), (cut_chunk, cut_off, cut_row) = st.chunk_ids
        ckpt = None if st.ckpt_conv is None else st.ckpt_conv[:, self.index]
        b = self.conv1d.bias
        kernel("mamba_conv", xbc.dtype)(
            xbc.data_ptr(), xbc.stride(0), starts.data_ptr(), ends.data_ptr(), slots.data_ptr(), starts.shape[0],
            cut_chunk.data_ptr(), cut_off.data_ptr(), cut_row.data_ptr(), cut_chunk.shape[0], conv_state.data_ptr(),
            conv_state.stride(0), None if ckpt is None else ckpt.data_ptr(), 0 if ckpt is None else ckpt.stride(0),
            self.conv1d.weight.data_ptr(), None if b is None else b.data_ptr(), conv_out.data_ptr(),
            conv_out.stride(0), self.conv_dim, self.d_conv)

    def forward(self, x: torch.Tensor, st: StateMetadata) -> torch.Tensor:
        proj = self.in_proj(x)
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.heads], dim=-1)
        conv_state, ssm_state = st.conv[:, self.index], st.ssm[:, self.index]      # [S, ...] views of the pool
        w = self.conv1d.weight[:, 0]
        A = self.decay_rates()
        y = torch.empty(x.shape[0], self.inner, dtype=x.dtype, device=x.device)
        n, gs = self.inner, self.groups * self.d_state
        steps = self.time_steps(dt) if self.fast else dt      # dt as `step` (and the C scan) take it
        if st.decode_ids is not None and self.fast:
            rows, slots = st.decode_ids
            self._step_kernel(xbc, steps, A, y, rows, None, slots, conv_state, ssm_state)
        elif st.decode_rows is not None:        # one batched step for every single-token row
            self._step(xbc, dt, A, y, st.decode_rows, st.decode_slots, conv_state, ssm_state)
        win = st.windows
        if win is not None:     # verify windows: their slots stay as they were until commit_windows
            win.inputs[self.index] = (xbc, steps, y)     # for step_again: y is free once the layer's output is
            self.step(xbc, steps, A, y, win.runs, conv_state, ssm_state, keep=False)
        if self.fast and st.chunk_ids is not None and self.d_conv <= MAX_KERNEL_CONV:   # all chunks: two calls
            conv_out = torch.empty(x.shape[0], self.conv_dim, dtype=x.dtype)
            self._conv_kernel(xbc, conv_out, st, conv_state)
            self._scan_kernel(conv_out, steps, A, y, st, ssm_state)
            return self.out_proj(self.norm(y, gate))
        for (start, end, slot), cuts in zip(st.chunks, st.chunk_checkpoints):   # prefill chunks: SSD scans
            if cuts:       # the conv state at a cut: the d_conv - 1 inputs before it
                window = torch.cat((conv_state[slot].to(xbc.dtype), xbc[start:end].t()), dim=1)
                for off, row in cuts:
                    st.ckpt_conv[row, self.index] = window[:, off:off + self.d_conv - 1]
            out, conv_new = ssd.conv_chunk(xbc[start:end], conv_state[slot], w, self.conv1d.bias)
            conv_state[slot] = conv_new.to(conv_state.dtype)
            xs, B, C = out.split([n, gs, gs], dim=-1)
            state = ssm_state[slot]
            a = 0
            for b, row in [*cuts, (end - start, -1)]:     # scan up to each cut, save, go on from there
                if b > a:
                    k = b - a
                    ys, state = ssd.chunk_scan(xs[a:b].view(k, self.heads, self.head_dim), dt[start + a:start + b], A,
                                               B[a:b].view(k, self.groups, -1), C[a:b].view(k, self.groups, -1),
                                               self.D, self.dt_bias, self.chunk_size, state, self.dt_limit)
                    y[start + a:start + b] = ys.reshape(k, -1)
                if row >= 0:
                    st.ckpt_ssm[row, self.index] = state
                a = b
            ssm_state[slot] = state
        return self.out_proj(self.norm(y, gate))


def time_step_limit(v) -> tuple[float, float]:
    """config.json's time_step_limit ([lo, hi], hi possibly {"__float__": "Infinity"}) as floats."""
    if not v:
        return 0.0, float("inf")
    return tuple(float(x["__float__"]) if isinstance(x, dict) else float(x) for x in v)


class BambaLayer(HooklessModule):
    def __init__(self, cfg: ModelConfig, attention: bool, mixer_index: int, backend: str, fast: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fast)
        self.self_attn = Attention(cfg, backend, fast) if attention else None
        self.mamba = None if attention else Mamba2Mixer(cfg, mixer_index, fast)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fast)
        self.feed_forward = MLP(cfg, fast)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm.layer_input(h, residual)
        h = self.self_attn(x, positions, rotary, meta) if self.mamba is None else self.mamba(x, meta.state)
        x, residual = self.pre_ff_layernorm(h, residual)
        return self.feed_forward(x), residual
