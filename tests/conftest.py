"""Every test gets its own memory tier folder (the default is shared by every job on the
host), removed after it; a test that checks what a job left there looks before teardown."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def memory_tier_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    path = f"/dev/shm/hvd_resilient-test-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("HVD_RESILIENT_MEMORY_TIER_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)
