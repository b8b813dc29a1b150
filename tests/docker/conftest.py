"""The Docker tier: a real engine, the image, the compose job, the chaos scripts.

Run by scripts/docker_test.sh (`make docker-test`), which installs and starts the engine,
builds the image and passes its name in HVD_IMAGE; `pytest -m docker tests/docker` works the
same against an engine that already runs and an image already built.

`make test` selects `not chaos or ci_chaos`, which a docker test matches too: the hook below
keeps this tier out of every run whose -m expression does not name `docker`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
OVERRIDE = Path(__file__).resolve().parent / "compose.override.yaml"


def pytest_collection_modifyitems(config, items):
    if "docker" in (config.option.markexpr or ""):
        return
    keep = [i for i in items if not i.get_closest_marker("docker")]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep


class Cluster:
    """The compose project of this tier, driven as an operator would (Compose 1.29 here, the
    `docker compose` plugin elsewhere: COMPOSE names the command)."""

    def __init__(self, project: str, image: str, compose: str):
        self.project = project
        self.image = image
        self.compose = shlex.split(compose)
        self.env = {**os.environ, "COMPOSE_PROJECT_NAME": project, "HVD_IMAGE": image,
                    "COMPOSE_FILE": f"{COMPOSE_FILE}:{OVERRIDE}", "COMPOSE": compose}

    def dc(self, *args: str, env: dict | None = None, timeout: float = 300,
           check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([*self.compose, *args], env={**self.env, **(env or {})},
                           capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(self.compose)} {' '.join(args)}: exit "
                                 f"{r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def container(self, service: str) -> str:
        cid = self.dc("ps", "-q", service).stdout.strip()
        assert cid, f"no container for {service}"
        return cid

    def running(self, service: str) -> bool:
        cid = self.dc("ps", "-q", service).stdout.strip()
        if not cid:
            return False
        r = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", cid],
                           capture_output=True, text=True, timeout=30)
        return r.stdout.strip() == "true"

    def wait_exit(self, service: str, timeout: float) -> int:
        """The exit code of the service's container, once it has stopped."""
        cid = self.container(service)
        r = subprocess.run(["docker", "wait", cid], capture_output=True, text=True,
                           timeout=timeout)
        return int(r.stdout.strip())

    def logs(self, service: str, tail: int = 60) -> str:
        return self.dc("logs", "--no-color", "--tail", str(tail), service, check=False).stdout

    def shared(self, *cmd: str, timeout: float = 60) -> str:
        """A command in a throwaway container on the job's shared volume (works whichever of
        the job's containers is down)."""
        r = subprocess.run(["docker", "run", "--rm", "--network", "none", "-v",
                            f"{self.project}_shared:/shared", self.image, *cmd],
                           capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def events(self, run_id: str) -> list[dict]:
        path = f"/shared/runs/{run_id}/events.jsonl"
        text = self.shared("sh", "-c", f"cat {path} 2>/dev/null || true")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def wait_event(self, run_id: str, name: str, timeout: float, after: int = 0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [e for e in self.events(run_id)[after:] if e["event"] == name]
            if hits:
                return hits[0]
            time.sleep(3)
        raise AssertionError(f"no {name!r} event in run {run_id} within {timeout:.0f}s\n"
                             + self.logs("driver"))

    def down(self, volumes: bool) -> None:
        self.dc("--profile", "spare", "down", "--remove-orphans", *(["-v"] if volumes else []),
                timeout=300)


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    required = os.environ.get("HVD_DOCKER_TEST") == "1"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        msg = "no Docker engine answers: run make docker-test (it starts one)"
        if required:
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    image = os.environ.get("HVD_IMAGE", "hvd-resilient:cpu")
    if subprocess.run(["docker", "image", "inspect", image], capture_output=True,
                      timeout=60).returncode != 0:
        pytest.fail(f"no image {image}: build it first (make docker-test does)", pytrace=False)
    compose = os.environ.get("COMPOSE") or (
        "docker compose" if subprocess.run(["docker", "compose", "version"],
                                           capture_output=True).returncode == 0
        else "docker-compose")
    c = Cluster(os.environ.get("COMPOSE_PROJECT_NAME", "hvd-resilient-test"), image, compose)
    c.down(volumes=True)  # whatever an interrupted run left
    yield c
    c.down(volumes=True)
