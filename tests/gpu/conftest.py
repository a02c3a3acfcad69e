"""GPU tests: collected everywhere, skipped (and counted as skipped) without CUDA."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fidelity"))   # fidelity_helpers
