"""Every benchmark script and job still imports against the package.

The benchmarks run by hand, not in CI, so a renamed module breaks them silently: after the
progress watchdog moved (hvd_resilient.watchdog -> hvd_resilient.detect.progress) the recovery
and partition benchmarks failed at their first job for a session before anyone ran them.
Importing each script as a module (its `__main__` block does not run) catches that in seconds.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def test_there_are_benchmarks_to_check():
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_script_imports(path: Path):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)  # raises ImportError/AttributeError on a stale name
    finally:
        del sys.modules[spec.name]
