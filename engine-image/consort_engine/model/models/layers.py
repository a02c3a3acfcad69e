"""The decoder's building blocks, shared by every model here and the MTP block: RMSNorm (fused
residual add), Linear (packed CPU GEMM, tensor-parallel split, LoRA), attention with fused q/k/v and
RoPE, the gated MLP, and the pre-norm decoder layer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from consort_engine.model.attention import AttentionMetadata, PagedAttention
from consort_engine.model.quantized_checkpoint import GroupCodes, same_order
from consort_engine.model.lora import LoraContext
from consort_engine.model.loader import ModelConfig
from consort_engine.model.models import ops
from consort_engine.model.models.packed import consort_int8, consort_w8a8, pack_linear
from consort_engine.model.models.quant import LOAD_TIME, quantize_linear
from consort_engine.model.models.rope import RotaryEmbedding
from consort_engine.model.tensor_parallel import SINGLE, TPGroup, all_reduce
from consort_engine.model.hookless import HooklessModule


class RMSNorm(HooklessModule):
    def __init__(self, dim: int, eps: float, fast: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps, self.fast = eps, fast

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(residual + x), residual + x)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, self.fast)
        return ops.add_rms_norm(residual, x, self.weight, self.eps, self.fast)

    def layer_input(self, h: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's input norm: (norm(h), h) in the first layer, where the residual stream starts as h;
        else the previous layer's output added into the stream, fused with the norm."""
        return (self(h), h) if residual is None else self(h, residual)


class Linear(HooklessModule):
    """y = x W^T + b, with W assembled from one or more checkpoint shards (fused projections).

    Tensor parallel (`tp.size` > 1): `parallel="column"` holds this rank's rows of every shard
    (`shard_sizes` are per rank), `parallel="row"` this rank's columns (`in_features` per rank) and
    all-reduces the partial products, the bias added once after the sum."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool, parallel: str | None = None,
                 tp: TPGroup = SINGLE):
        super().__init__()
        self.parallel = parallel if tp.size > 1 else None
        self.tp = tp
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.shard_sizes = shard_sizes
        out = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        self.packed = None
        self.codes: dict[int, GroupCodes] = {}     # shard -> a pre-quantized checkpoint's integers (on CPU), until pack
        self.runs_codes = False                    # packed: the checkpoint's codes on the int8 kernel
        self.lora_ctx: LoraContext | None = None
        self.lora: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}  # adapter -> (offset, n, A, Bt)

    def pack(self, quantization: str = "none") -> None:
        """Switch to a pre-packed CPU GEMM weight (see packed.py), to a quantized one (quant.py), or to a
        pre-quantized checkpoint's codes on the int8 kernel; the plain weight is released."""
        bias = None if self.bias is None or self.parallel == "row" else self.bias.data
        self.packed = self._pack_codes(bias) if self.codes else None
        if self.packed is None and quantization in LOAD_TIME:
            self.packed = quantize_linear(self.weight.data, bias, quantization)
        elif self.packed is None:
            self.packed = pack_linear(self.weight.data, bias)
        if self.packed is not None:
            self.weight.data = torch.zeros(1, dtype=self.weight.dtype).expand(self.weight.shape)

    def _pack_codes(self, bias: torch.Tensor | None):
        """Every shard's codes, with one group size and one column order, on the int8 kernel
        (packed.consort_int8; a W8A8 checkpoint's on the int8 x int8 one, consort_w8a8, where it builds);
        where that does not apply, the shards are dequantized into the weight (None)."""
        shards = [self.codes.get(i) for i in range(len(self.shard_sizes))]
        self.codes = {}
        if all(shards) and len({c.group_size for c in shards}) == 1 and same_order(shards):
            codes, scales = torch.cat([c.codes for c in shards]), torch.cat([c.scales for c in shards])
            first = shards[0]
            packed = consort_w8a8(codes, scales, bias, first.group_size) if first.int8_rows else None
            packed = packed or consort_int8(codes, scales, bias, first.group_size, first.order)
            if packed is not None:
                self.runs_codes = True
                return packed
        for i, c in enumerate(shards):
            if c is not None:
                self._copy_shard(self.weight, i, c.dequantize())
        return None

    def load_shard(self, name: str, shard: int, tensor: torch.Tensor | GroupCodes) -> None:
        target = self.weight if name == "weight" else self.bias
        n = self.shard_sizes[shard]
        if self.parallel == "column":
            tensor = tensor.rows(self.tp.rows(n)) if isinstance(tensor, GroupCodes) else tensor[self.tp.rows(n)]
        elif self.parallel == "row" and name == "weight":
            cut = self.tp.rows(self.weight.shape[1])
            if isinstance(tensor, GroupCodes):      # a cut inside a group: dequantized
                tensor = tensor.columns(cut) or tensor.dequantize()[:, cut]
            else:
                tensor = tensor[:, cut]
        if tensor.shape[0] != n:
            raise ValueError(f"shard {shard}: expected {n} rows, checkpoint has {tuple(tensor.shape)}")
        if isinstance(tensor, GroupCodes):
            self.codes[shard] = tensor
        else:
            self._copy_shard(target, shard, tensor)

    def _copy_shard(self, target: nn.Parameter, shard: int, tensor: torch.Tensor) -> None:
        o, n = self.shard_offsets[shard], self.shard_sizes[shard]
        target.data[o:o + n].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "row":
            y = self.packed(x) if self.packed is not None else F.linear(x, self.weight)
            all_reduce(y, self.tp)
            return y if self.bias is None else y.add_(self.bias)
        y = self.packed(x) if self.packed is not None else F.linear(x, self.weight, self.bias)
        if self.lora and self.lora_ctx is not None and self.lora_ctx.segments:
            self._add_lora(x, y)
        return y

    def _add_lora(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y[rows of an adapter, its shard] += (x A^T) (scaling B)^T, per adapter segment of the step."""
        for start, end, name in self.lora_ctx.segments:
            ops.add_lora_(y, x, start, end, self.lora.get(name, ()))


class Attention(HooklessModule):
    def __init__(self, cfg: ModelConfig, backend: str, fast: bool, tp: TPGroup = SINGLE):
        super().__init__()
        # This rank's heads: attention is independent per head, so heads split without communication.
        self.h = tp.split(cfg.num_attention_heads, "num_attention_heads")
        self.kvh = tp.split(cfg.num_key_value_heads, "num_key_value_heads")
        self.d, self.fast = cfg.head_dim, fast
        self.qkv_proj = Linear(cfg.hidden_size, [self.h * self.d, self.kvh * self.d, self.kvh * self.d],
                               cfg.attention_bias, "column", tp)
        self.o_proj = Linear(self.h * self.d, [cfg.hidden_size],
                             cfg.attention_bias and cfg.model_type != "qwen2", "row", tp)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, fast) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, fast) if cfg.qk_norm else None
        self.attn = PagedAttention(self.h, self.kvh, self.d, self.d ** -0.5, backend)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor,
            rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KVH, D]: projected, normed (Qwen3) and rotated."""
        t, h, kvh = x.shape[0], self.h, self.kvh
        qkv = self.qkv_proj(x).view(t, h + 2 * kvh, self.d)
        qk, v = qkv[:, : h + kvh], qkv[:, h + kvh:]
        if self.q_norm is not None:
            eps = self.q_norm.eps
            q = ops.rms_norm_heads_(qk[:, :h], self.q_norm.weight, eps, self.fast)
            k = ops.rms_norm_heads_(qk[:, h:], self.k_norm.weight, eps, self.fast)
            if not self.fast:
                qk = torch.cat((q, k), dim=1)
        qk = ops.rope_(qk, positions, rotary.cos, rotary.sin, self.fast)
        return qk[:, :h], qk[:, h:], v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attn(*self.qkv(x, positions, rotary), meta))

    def store_kv(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                 slots: torch.Tensor) -> None:
        """Only the K/V of rows x into the pool at slots: rows whose attention output nobody reads."""
        _, k, v = self.qkv(x, positions, rotary)
        self.attn.store(k, v, slots)


class MLP(HooklessModule):
    def __init__(self, cfg: ModelConfig, fast: bool, tp: TPGroup = SINGLE):
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        self.fast = fast
        inter = tp.split(cfg.intermediate_size, "intermediate_size")
        self.gate_up_proj = Linear(cfg.hidden_size, [inter] * 2, cfg.mlp_bias, "column", tp)
        self.down_proj = Linear(inter, [cfg.hidden_size], cfg.mlp_bias, "row", tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x), self.fast))


class DecoderLayer(HooklessModule):
    def __init__(self, cfg: ModelConfig, backend: str, fast: bool, tp: TPGroup = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fast)
        self.self_attn = Attention(cfg, backend, fast, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fast)
        self.mlp = MLP(cfg, fast, tp)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer output, residual stream before it): the residual add is fused into the next norm."""
        x, residual = self.input_layernorm.layer_input(h, residual)
        h = self.self_attn(x, positions, rotary, meta)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual
