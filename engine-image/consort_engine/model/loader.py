"""Checkpoint loading: config.json -> ModelConfig, *.safetensors -> tensors, dtype and EOS resolution.

No transformers import: the engine reads the Hugging Face files directly so start-up stays fast.
The tokenizer itself lives in tokenizer.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

SUPPORTED = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "BambaForCausalLM": "bamba",
}
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "bamba")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


@dataclass
class ModelConfig:
    """The fields of a Llama-family config.json the engine uses (Hugging Face names)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None      # rope_type + its parameters; None = default RoPE
    tie_word_embeddings: bool = False
    attention_bias: bool = False                    # q/k/v biases (Qwen2: always)
    qk_norm: bool = False                           # per-head RMSNorm on q and k (Qwen3)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    # Hybrid attention + Mamba2 (bamba): the layers that are attention (None: every layer); the others are mixers.
    attn_layer_indices: list[int] | None = None
    partial_rotary_factor: float = 1.0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the attention layers: the ones that hold paged KV."""
        if self.attn_layer_indices is None:
            return list(range(self.num_hidden_layers))
        return sorted(self.attn_layer_indices)

    @property
    def is_hybrid(self) -> bool:
        return len(self.attention_layers) < self.num_hidden_layers


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the legacy (rope_theta, rope_scaling) or the v5 rope_parameters form."""
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = dict(raw.get("rope_scaling") or params or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    scaling.pop("rope_theta", None)
    if rope_type in (None, "default"):
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling


def _as_list(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(v) for v in x] if isinstance(x, (list, tuple)) else [int(x)]


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    archs = raw.get("architectures") or []
    model_type = raw.get("model_type") or (SUPPORTED.get(archs[0]) if archs else None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} (architectures {archs}); "
                         f"supported: {', '.join(MODEL_TYPES)}")
    heads = int(raw["num_attention_heads"])
    theta, scaling = _rope(raw)
    sliding = raw.get("sliding_window")
    hybrid = model_type == "bamba"
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        sliding = None
    return ModelConfig(
        model_type=model_type,
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=raw.get("hidden_act", "silu"),
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=_as_list(raw.get("eos_token_id")),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        attn_layer_indices=[int(i) for i in raw.get("attn_layer_indices") or []] if hybrid else None,
        # transformers hardcodes Bamba's partial rotary factor (0.5) whatever the config says
        partial_rotary_factor=0.5 if hybrid else 1.0,
        raw=raw,
    )


def eos_token_ids(model_dir: str | Path, cfg: ModelConfig) -> set[int]:
    """EOS ids from config.json, generation_config.json and tokenizer_config.json's eos_token."""
    model_dir = Path(model_dir)
    ids = set(cfg.eos_token_id)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        ids.update(_as_list(json.loads(gen.read_text()).get("eos_token_id")))
    tok_cfg, tok = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if tok_cfg.exists() and tok.exists():
        eos = json.loads(tok_cfg.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            from tokenizers import Tokenizer
            tid = Tokenizer.from_file(str(tok)).token_to_id(eos)
            if tid is not None:
                ids.add(int(tid))
    return ids


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: str | None, bf16_dot: bool) -> torch.dtype:
    """The named dtype, or for `auto`: bfloat16 on CUDA; on a CPU the checkpoint's own bfloat16 where
    the CPU has a bf16 dot product (`bf16_dot`: AMX or AVX-512 BF16), else float32. Both CPU answers
    keep every weight as stored (bf16 and float16 fit float32 exactly); without a bf16 dot product a
    bf16 model computes in float32 anyway (model_runner.compute_dtype), so float32 costs nothing there
    but memory."""
    if dtype in ("auto", None):
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if checkpoint_dtype == "bfloat16" and bf16_dot else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in the directory (sharded checkpoints included)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def checkpoint_names(model_dir: str | Path) -> list[str]:
    """Every tensor name of the checkpoint (headers only, no tensor is read)."""
    names: list[str] = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            names += list(fh.keys())
    return names
