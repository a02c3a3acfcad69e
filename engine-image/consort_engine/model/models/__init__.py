"""Model implementations, keyed by config.json's model_type."""
from consort_engine.model.models.bamba import BambaForCausalLM
from consort_engine.model.models.llama import LlamaForCausalLM

MODELS = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM,
          "qwen2": LlamaForCausalLM, "qwen3": LlamaForCausalLM,
          "bamba": BambaForCausalLM}

__all__ = ["MODELS", "BambaForCausalLM", "LlamaForCausalLM"]
