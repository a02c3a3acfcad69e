"""The engine's layers call straight into forward (model/hookless.py): nn.Module.__call__'s hook
machinery never runs inside a model's forward, and each layer's call is its own forward."""
from __future__ import annotations

import torch
from torch import nn

from consort_engine.model.attention import PagedAttention
from consort_engine.model.hookless import HooklessModule
from consort_engine.model.models.mamba2 import BambaLayer, Conv1d, GatedRMSNorm, Mamba2Mixer
from consort_engine.model.models.layers import MLP, Attention, DecoderLayer, Linear, RMSNorm
from consort_engine.model.models.mtp import MTPBlock

LAYERS = (RMSNorm, Linear, Attention, MLP, DecoderLayer, PagedAttention, Conv1d, GatedRMSNorm, Mamba2Mixer,
          BambaLayer, MTPBlock)


def test_every_layer_calls_its_own_forward():
    for cls in LAYERS:
        assert issubclass(cls, HooklessModule)
        assert cls.__call__ is cls.forward, cls.__name__


def test_a_layer_call_skips_nn_module_call(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError(f"nn.Module.__call__ ran for {type(self).__name__}")
    norm, linear = RMSNorm(16, 1e-6, fast=False), Linear(16, [8, 4], bias=True)
    gen = torch.Generator().manual_seed(0)
    linear.weight.data.copy_(torch.randn(12, 16, generator=gen))   # torch.empty: NaNs in it would never be equal
    x = torch.randn(3, 16, generator=gen)
    want = (norm.forward(x), linear.forward(x))
    monkeypatch.setattr(nn.Module, "_call_impl", refuse)
    got = (norm(x), linear(x))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[1].shape == (3, 12)
