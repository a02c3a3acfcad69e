"""Model implementations, keyed by config.json's model_type."""
from .bamba import BambaForCausalLM
from .llama import LlamaForCausalLM

MODELS = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM,
          "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM,
          "bamba": BambaForCausalLM}

__all__ = ["MODELS", "BambaForCausalLM", "LlamaForCausalLM"]
