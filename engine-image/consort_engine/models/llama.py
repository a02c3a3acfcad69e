"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat token batch with paged attention.

Differences between the four are config flags: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3),
tied embeddings, RoPE scaling. q/k/v and gate/up projections are fused at load time.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionMetadata, PagedAttention
from ..lora import LoraAdapter, LoraContext
from ..loader import ModelConfig
from . import ops
from .packed import pack_linear
from .mtp import MTPBlock, mtp_param_name
from .rope import RotaryEmbedding
from ..tensor_parallel import SINGLE, TPGroup, all_reduce


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fast: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps, self.fast = eps, fast

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(residual + x), residual + x)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, self.fast)
        return ops.add_rms_norm(residual, x, self.weight, self.eps, self.fast)


class Linear(nn.Module):
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
        self.lora_ctx: LoraContext | None = None
        self.lora: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}  # adapter -> (offset, n, A, B)

    def pack(self) -> None:
        """Switch to a pre-packed CPU GEMM weight (see packed.py); the plain weight is released."""
        bias = None if self.bias is None or self.parallel == "row" else self.bias.data
        self.packed = pack_linear(self.weight.data, bias)
        if self.packed is not None:
            self.weight.data = torch.zeros(1, dtype=self.weight.dtype).expand(self.weight.shape)

    def load_shard(self, name: str, shard: int, tensor: torch.Tensor) -> None:
        target = self.weight if name == "weight" else self.bias
        o, n = self.shard_offsets[shard], self.shard_sizes[shard]
        if self.parallel == "column":
            tensor = tensor[self.tp.rows(n)]
        elif self.parallel == "row" and name == "weight":
            tensor = tensor[:, self.tp.rows(self.weight.shape[1])]
        if tensor.shape[0] != n:
            raise ValueError(f"shard {shard}: expected {n} rows, checkpoint has {tuple(tensor.shape)}")
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
            xs = None
            for offset, n, a, b in self.lora.get(name, ()):
                if xs is None:
                    xs = x[start:end].float()
                y[start:end, offset:offset + n] += ((xs @ a.t()) @ b.t()).to(y.dtype)


class Attention(nn.Module):
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                meta: AttentionMetadata) -> torch.Tensor:
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
        return self.o_proj(self.attn(qk[:, :h], qk[:, h:], v, meta))


class MLP(nn.Module):
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


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str, fast: bool, tp: TPGroup = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fast)
        self.self_attn = Attention(cfg, backend, fast, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fast)
        self.mlp = MLP(cfg, fast, tp)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer output, residual stream before it): the residual add is fused into the next norm."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm(h, residual)
        h = self.self_attn(x, positions, rotary, meta)
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class CausalLM(nn.Module):
    """What every decoder-only model here shares: the layer loop, the final norm + LM head, packing,
    and loading checkpoint tensors into fused projections. Subclasses build embed_tokens, layers,
    norm, lm_head (None when tied) and rotary, and name their projections in the class attributes."""
    # checkpoint name fragment -> (fused module fragment, shard index)
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    single_modules: tuple[str, ...] = ("o_proj", "down_proj", "lm_head")   # unfused Linear modules

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> last layer's hidden states [T, hidden] (before the final norm)."""
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, positions, self.rotary, meta)
        return h + residual

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, for the sampled rows only."""
        return self.head(self.norm(h))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """LM head of normed hidden states (the target's and the MTP block's)."""
        if self.lm_head is not None:
            return self.lm_head(x)
        if self.tied_head is not None:
            return self.tied_head(x)
        return F.linear(x, self.embed_tokens.weight)

    def pack_weights(self) -> int:
        """Pre-pack every projection for the CPU GEMM (after load_weights). Returns how many packed."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.pack()
        if self.lm_head is None:
            self.tied_head = pack_linear(self.embed_tokens.weight.data, None)
        return sum(m.packed is not None for m in linears) + (self.tied_head is not None)

    def load_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (module name, tensor) pairs, already in this model's names, into the parameters (shards
        of the fused projections included); every parameter must be covered."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        seen: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue                                        # tied: the embedding is the head
            module_path, _, leaf = name.rpartition(".")
            frag = module_path.rpartition(".")[2]
            if frag in self.packed_modules:
                fused, shard = self.packed_modules[frag]
                fused_path = module_path[: -len(frag)] + fused
                modules[fused_path].load_shard(leaf, shard, tensor)
                seen.add(f"{fused_path}.{leaf}#{shard}")
            elif frag in self.single_modules:
                modules[module_path].load_shard(leaf, 0, tensor)
                seen.add(f"{module_path}.{leaf}#0")
            elif name in params:
                if params[name].shape != tensor.shape:
                    raise ValueError(f"{name}: expected {tuple(params[name].shape)}, got {tuple(tensor.shape)}")
                params[name].data.copy_(tensor)
                seen.add(name)
            else:
                raise ValueError(f"unexpected tensor in checkpoint: {name}")
        missing = []
        for pname in params:
            mpath, _, leaf = pname.rpartition(".")
            mod = modules[mpath]
            shards = range(len(mod.shard_sizes)) if isinstance(mod, Linear) else None
            if (shards is not None and not all(f"{pname}#{i}" in seen for i in shards)) or \
                    (shards is None and pname not in seen):
                missing.append(pname)
        if missing:
            raise ValueError(f"checkpoint lacks {missing[:8]}{' ...' if len(missing) > 8 else ''}")


class LlamaForCausalLM(CausalLM):
    single_modules = ("o_proj", "down_proj", "lm_head", "fc")     # fc: the MTP block's input projection

    def __init__(self, cfg: ModelConfig, max_len: int, backend: str, dtype: torch.dtype,
                 device: torch.device, tp: TPGroup = SINGLE, mtp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        fast = backend == "cpu_kernel"      # the C kernels are compiled and apply (CPU, fp32/bf16)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, fast, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fast)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, [cfg.vocab_size], False)
        self.tied_head = None
        self.rotary = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling, dtype, device)
        # The checkpoint's MTP block (models/mtp.py), loaded only when it drafts; otherwise its tensors are skipped.
        self.mtp = MTPBlock(cfg, backend, fast) if mtp else None

    def shard_shapes(self) -> dict[str, list[tuple[int, int]]]:
        """(out, in) of each shard of the fused projections, for validating adapters."""
        layer = self.layers[0]
        mods = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
                "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
        return {k: [(n, m.weight.shape[1]) for n in m.shard_sizes] for k, m in mods.items()}

    def attach_adapter(self, adapter: LoraAdapter, ctx: LoraContext) -> None:
        """Hang an adapter's A/B pairs on the projections they target (shard offsets of the fused ones)."""
        for (i, module, shard), (a, b) in adapter.weights.items():
            layer = self.layers[i]
            lin = getattr(layer.mlp if module in ("gate_up_proj", "down_proj") else layer.self_attn, module)
            lin.lora_ctx = ctx
            lin.lora.setdefault(adapter.name, []).append((lin.shard_offsets[shard], lin.shard_sizes[shard], a, b))

    def detach_adapter(self, name: str) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.lora.pop(name, None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.load_tensors(self._own_names(weights))

    def _own_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Checkpoint names -> this module's: rotary buffers dropped, MTP tensors under mtp. (or
        skipped when MTP does not draft), the model. prefix removed."""
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            mtp_name = mtp_param_name(name, self.cfg.num_hidden_layers)
            if mtp_name is not None:
                if not mtp_name or self.mtp is None:
                    continue                                    # a shared copy, or MTP not drafting
                name = "mtp." + mtp_name
            yield name.removeprefix("model."), tensor
