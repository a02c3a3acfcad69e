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
from ..loader import ModelConfig
from .packed import pack_linear
from .rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Linear(nn.Module):
    """y = x W^T + b, with W assembled from one or more checkpoint shards (fused projections)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool):
        super().__init__()
        self.shard_offsets = [sum(shard_sizes[:i]) for i in range(len(shard_sizes))]
        self.shard_sizes = shard_sizes
        out = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out), requires_grad=False) if bias else None
        self.packed = None

    def pack(self) -> None:
        """Switch to a pre-packed CPU GEMM weight (see packed.py); the plain weight is released."""
        self.packed = pack_linear(self.weight.data, None if self.bias is None else self.bias.data)
        if self.packed is not None:
            self.weight.data = torch.zeros(1, dtype=self.weight.dtype).expand(self.weight.shape)

    def load_shard(self, name: str, shard: int, tensor: torch.Tensor) -> None:
        target = self.weight if name == "weight" else self.bias
        o, n = self.shard_offsets[shard], self.shard_sizes[shard]
        if tensor.shape[0] != n:
            raise ValueError(f"shard {shard}: expected {n} rows, checkpoint has {tuple(tensor.shape)}")
        target.data[o:o + n].copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str):
        super().__init__()
        self.h, self.kvh, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [self.h * self.d, self.kvh * self.d, self.kvh * self.d],
                               cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, [cfg.hidden_size],
                             cfg.attention_bias and cfg.model_type != "qwen2")
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = PagedAttention(self.h, self.kvh, self.d, self.d ** -0.5, backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.h + 2 * self.kvh, self.d)
        qk, v = qkv[:, : self.h + self.kvh], qkv[:, self.h + self.kvh:]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.h]), self.k_norm(qk[:, self.h:])), dim=1)
        qk = RotaryEmbedding.apply(qk, cos, sin)
        o = self.attn(qk[:, : self.h], qk[:, self.h:], v, meta)
        return self.o_proj(o)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r}")
        self.ffn = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [self.ffn, self.ffn], cfg.mlp_bias)
        self.down_proj = Linear(self.ffn, [cfg.hidden_size], cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        return self.down_proj(F.silu(gu[:, : self.ffn]) * gu[:, self.ffn:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused module fragment, shard index)
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, max_len: int, backend: str, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, [cfg.vocab_size], False)
        self.tied_head = None
        self.rotary = RotaryEmbedding(cfg.head_dim, max_len, cfg.rope_theta, cfg.rope_scaling, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> last layer's hidden states [T, hidden] (before the final norm)."""
        cos, sin = self.rotary.cos_sin(positions)
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, meta)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, for the sampled rows only."""
        if self.lm_head is not None:
            return self.lm_head(self.norm(h))
        if self.tied_head is not None:
            return self.tied_head(self.norm(h))
        return F.linear(self.norm(h), self.embed_tokens.weight)

    def pack_weights(self) -> int:
        """Pre-pack every projection for the CPU GEMM (after load_weights). Returns how many packed."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.pack()
        if self.lm_head is None:
            self.tied_head = pack_linear(self.embed_tokens.weight.data, None)
        return sum(m.packed is not None for m in linears) + (self.tied_head is not None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        seen: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue                                        # tied: the embedding is the head
            module_path, _, leaf = name.rpartition(".")
            frag = module_path.rpartition(".")[2]
            if frag in self.packed_modules:
                fused, shard = self.packed_modules[frag]
                fused_path = module_path[: -len(frag)] + fused
                modules[fused_path].load_shard(leaf, shard, tensor)
                seen.add(f"{fused_path}.{leaf}#{shard}")
            elif frag in ("o_proj", "down_proj", "lm_head"):
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
