"""Fixtures of the integration tests: jobs that are always cleaned up, SeaweedFS, and a
checkpoint location on each kind of storage."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.jobs import JobRunner
from tests.support.s3_server import s3_server, s3_url  # noqa: F401  (fixtures)


@pytest.fixture
def jobs(tmp_path: Path):
    """Starts launcher processes; on teardown kills every process the test started."""
    runner = JobRunner(tmp_path)
    try:
        yield runner
    finally:
        runner.cleanup()


@pytest.fixture(params=["file", "s3"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A checkpoint location, once on the filesystem and once on SeaweedFS."""
    if request.param == "file":
        return f"file://{tmp_path}/ckpt"
    return request.getfixturevalue("s3_url")
