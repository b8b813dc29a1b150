"""The image as built: Horovod works in it, and the build network left no trace in it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.docker
COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"


def run_in_image(cluster, script: str, *env: str) -> str:
    args = [a for e in env for a in ("-e", e)]
    r = subprocess.run(["docker", "run", "--rm", "--network", "none", *args, cluster.image,
                        "bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_horovod_in_the_image_has_pytorch_gloo_and_mpi(cluster):
    out = run_in_image(cluster, "horovodrun --check-build")
    for line in (r"\[X\] PyTorch", r"\[X\] Gloo", r"\[X\] MPI"):
        assert re.search(line, out), out


def test_build_network_left_no_trace_in_the_image(cluster):
    """The mirror, pip's configuration and the CA bundle went in as build secrets: none of
    them may be in a layer, the image's history or its configuration."""
    mirror = os.environ.get("HVD_DOCKER_TEST_MIRROR", "")
    host = re.sub(r"^[a-z]+://", "", mirror).split("/")[0].split(":")[0]
    for cmd in (["docker", "history", "--no-trunc", cluster.image],
                ["docker", "image", "inspect", cluster.image]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
        assert out and (not host or host not in out), f"{cmd[1]} names the build's mirror"
    out = run_in_image(cluster, """
        ls -d /etc/pip.conf /etc/apt/sources.list.d/hvd-build.sources \
           /etc/apt/apt.conf.d/99hvd-build 2>/dev/null || true
        find /run/secrets -type f 2>/dev/null || true  # BuildKit leaves the folder, empty
        ls /var/lib/apt/lists | grep -v -e '^lock$' -e '^partial$' || true
        if [ -n "$H" ]; then grep -rlI -- "$H" /etc /var /root /opt/hvd_resilient/.venv/pyvenv.cfg \
            2>/dev/null || true; fi
        """, f"H={host}")
    assert out.strip() == "", f"left in the image:\n{out}"


def test_compose_file_is_accepted_by_this_compose(cluster):
    """The real implementation's own check, beside the schema test in tests/unit."""
    cluster.dc("-f", str(COMPOSE_FILE), "config", "-q")
