"""Fidelity fixtures; the helpers themselves live in fidelity_helpers.py (import them by that name)."""
from __future__ import annotations

import pytest

from fidelity_helpers import Reference, check_logprobs_close, hf_greedy, make_checkpoint  # noqa: F401


@pytest.fixture
def checkpoint(tmp_path):
    """checkpoint(arch, **config_overrides) -> Path of a transformers-written tiny checkpoint."""
    return lambda arch, **kw: make_checkpoint(arch, tmp_path, **kw)
