"""Where things are, named once: a test that moves to another folder keeps its paths."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: tests/support/paths.py
TESTS = ROOT / "tests"
SCRIPTS = TESTS / "scripts"  # the jobs the tests launch
DATA = TESTS / "data"  # recorded logs the tests read
