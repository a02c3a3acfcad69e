"""Model implementations, keyed by config.json's model_type."""
from .llama import LlamaForCausalLM

MODELS = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM,
          "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM}

__all__ = ["MODELS", "LlamaForCausalLM"]
