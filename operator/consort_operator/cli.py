"""The `consort` entry point of installs made before it moved to consort_common.cli (their console
script names this module); `pip install -e .` points `consort` at consort_common.cli."""
from consort_common.cli import main

__all__ = ["main"]
