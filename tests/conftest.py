"""Shared fixtures: a run folder per test and jobs that are always cleaned up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from jobs import JobRunner  # noqa: E402
from s3_server import s3_server, s3_url  # noqa: E402,F401


@pytest.fixture
def jobs(tmp_path: Path):
    """Starts launcher processes; on teardown kills every process the test started."""
    runner = JobRunner(tmp_path)
    try:
        yield runner
    finally:
        runner.cleanup()
