"""HooklessModule: the base of the engine's layers, an nn.Module whose call goes straight to its forward.

nn.Module.__call__ checks the global and per-module hooks on every call (~0.45 us against ~0.06 for the
forward itself); a decode step makes ~10 such calls per decoder layer, and at one sequence on CPU, where a
step is a few milliseconds of GEMMs, the checks were a few percent of it. Nothing registers hooks on the
engine's layers, so they skip the checks; the model at the top (CausalLM) stays a plain nn.Module.
"""
from __future__ import annotations

from torch import nn


class HooklessModule(nn.Module):
    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward      # each subclass calls its own forward, with no frame in between
