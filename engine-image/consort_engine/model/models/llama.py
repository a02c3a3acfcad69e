"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat token batch with paged attention.

Differences between the four are config flags: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3),
tied embeddings, RoPE scaling. q/k/v and gate/up projections are fused at load time.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from consort_engine.model.attention import AttentionMetadata
from consort_engine.model.lora import LoraAdapter, LoraContext
from consort_engine.model.loader import ModelConfig
from consort_engine.model.models.fused_layers import FusedLayers
from consort_engine.model.models.packed import pack_linear
from consort_engine.model.models.layers import DecoderLayer, Linear, RMSNorm
from consort_engine.model.models.mtp import MTPBlock, mtp_names
from consort_engine.model.models.rope import RotaryEmbedding
from consort_engine.model.tensor_parallel import SINGLE, TPGroup

# The --quantization values that cover the LM head too. int8: its activations keep 15 bits (the kernel
# rounds each row to int16), the head's share of a decode step's weights is large (the bench model's is
# 40%), and with it quantized the fidelity bounds still hold (docs/engine-speed.md). w8a8 and fp8 carry
# 7-8-bit activations, and their head stays in the checkpoint's dtype, as in vLLM's recipes.
QUANTIZE_LM_HEAD = ("int8",)


class CausalLM(nn.Module):
    """What every decoder-only model here shares: the layer loop, the final norm + LM head, packing,
    and loading checkpoint tensors into fused projections. Subclasses build embed_tokens, layers,
    norm, lm_head (None when tied) and rotary, and name their projections in the class attributes."""
    # checkpoint name fragment -> (fused module fragment, shard index)
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    single_modules: tuple[str, ...] = ("o_proj", "down_proj", "lm_head")   # unfused Linear modules

    adapter_targets: tuple[str, ...] = ()          # the lora.TARGETS modules its layers have (projection)

    fused: FusedLayers | None | bool = False       # the C plan of the layers (False: not planned yet)
    lora_ctx: LoraContext | None = None            # set with the first adapter: the step's adapter rows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> last layer's hidden states [T, hidden] (before the final norm)."""
        h, residual = self.embed_tokens(input_ids), None
        fused = self.fused_layers()
        segments = self.lora_ctx.segments if self.lora_ctx is not None else ()
        if fused is not None and fused.applies(h, meta, segments):
            return fused.run(h, positions, meta, segments)
        for layer in self.layers:
            h, residual = layer(h, residual, positions, self.rotary, meta)
        return h + residual

    def fused_layers(self) -> FusedLayers | None:
        """The layers' C plan (fused_layers.py), made at the first forward over the pools and again when the
        pools change; None where it does not apply to this model."""
        self.fused = FusedLayers.refresh(self.fused, self.layers, self.rotary, self.embed_tokens.weight.dtype)
        return self.fused

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

    def pack_weights(self, quantization: str = "none") -> int:
        """Pre-pack every projection for the CPU GEMM, or quantize it (after load_weights). Returns how
        many packed. The LM head is quantized only where QUANTIZE_LM_HEAD says."""
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        for m in linears:
            m.pack(quantization if m is not self.lm_head or quantization in QUANTIZE_LM_HEAD else "none")
        if self.lm_head is None:
            self.tied_head = pack_linear(self.embed_tokens.weight.data, None)
        self.fused = False              # a plan holds the weights it was made with: made again at the next forward
        if getattr(self, "mtp", None) is not None:
            self.mtp.fused = False
        return sum(m.packed is not None for m in linears) + (self.tied_head is not None)

    def projection(self, layer: int, module: str) -> Linear | None:
        """Layer `layer`'s projection of a lora.TARGETS module name (adapter_targets), None where it has none."""
        raise NotImplementedError

    def shard_shapes(self) -> list[dict[str, list[tuple[int, int]]]]:
        """Per layer, (out, in) of each shard of the projections an adapter may target, for validating adapters."""
        return [{k: [(n, m.weight.shape[1]) for n in m.shard_sizes]
                 for k in self.adapter_targets if (m := self.projection(i, k)) is not None}
                for i in range(len(self.layers))]

    def attach_adapter(self, adapter: LoraAdapter, ctx: LoraContext) -> None:
        """Hang an adapter's A/B pairs on the projections they target (shard offsets of the fused ones)."""
        for (i, module, shard), (a, bt) in adapter.weights.items():
            lin = self.projection(i, module)
            lin.lora_ctx = self.lora_ctx = ctx
            lin.lora.setdefault(adapter.name, []).append((lin.shard_offsets[shard], lin.shard_sizes[shard], a, bt))
        self.fused = False              # the plan's adapter tables: made again with this one

    def detach_adapter(self, name: str) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.lora.pop(name, None)
        self.fused = False

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
        self.mtp = MTPBlock(cfg, DecoderLayer(cfg, backend, fast), fast) if mtp else None

    adapter_targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")    # lora.TARGETS' modules it has

    def projection(self, layer: int, module: str) -> Linear:
        """Layer `layer`'s projection of that name (lora.TARGETS' fused names)."""
        block = self.layers[layer]
        return getattr(block.mlp if module in ("gate_up_proj", "down_proj") else block.self_attn, module)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.load_tensors(self._own_names(weights))

    def _own_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Checkpoint names -> this module's: rotary buffers dropped, MTP tensors under mtp. (or
        skipped when MTP does not draft), the model. prefix removed."""
        for name, tensor in mtp_names(weights, self.cfg.num_hidden_layers, self.mtp is not None):
            if "rotary_emb" not in name:
                yield name.removeprefix("model."), tensor
