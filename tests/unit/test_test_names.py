"""Test files have unique basenames across tests/: pytest imports them by basename (no __init__.py),
so a second file of the same name stops the whole run at collection."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [n for n, c in names.items() if c > 1], sorted(n for n, c in names.items() if c > 1)
