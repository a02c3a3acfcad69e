"""GPU tests: collected everywhere, skipped (and counted as skipped) without CUDA."""
from __future__ import annotations

import sys
from pathlib import Path

FIDELITY = Path(__file__).resolve().parents[1] / "fidelity"
sys.path.insert(0, str(FIDELITY))             # fidelity_helpers
sys.path.insert(0, str(FIDELITY / "engine"))  # test_engine_model_runner's schedules
