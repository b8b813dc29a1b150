"""Horovod is optional: `pip install .` into a fresh venv that has no Horovod (and no mpi4py),
then `hvd-resilient run --launcher torchrun -- python examples/digits.py` (and `--launcher
inplace`) trains, checkpoints, and survives a worker killed mid-run; the Horovod-only name says
in one line what to install.

The venv is real (torch from this machine's wheel, everything else resolved by pip from the
project's metadata), so a dependency that sneaks Horovod back in fails here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.jobs import events, free_port
from tests.support.paths import ROOT
from tests.support.runs import assert_faults_fired

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TORCH = "torch==2.13.0"  # the version scripts/install.sh pins: a file on this machine


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    venv = tmp_path_factory.mktemp("no-horovod") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin/python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH], check=True, timeout=600)
    subprocess.run([*pip, str(ROOT), "scikit-learn"], check=True, timeout=600)
    return venv


def test_the_package_installs_and_imports_without_horovod(bare_venv: Path) -> None:
    py = str(bare_venv / "bin/python")
    r = subprocess.run([py, "-c", "import horovod"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, "the bare venv has Horovod: the test proves nothing"
    r = subprocess.run([py, "-c", (
        "import sys, hvd_resilient\n"
        "from hvd_resilient import Trainer, TrainConfig\n"
        "from hvd_resilient.backends import get\n"
        "assert 'horovod' not in sys.modules\n"
        "try:\n"
        "    hvd_resilient.ElasticState\n"
        "except ImportError as e:\n"
        "    print(e)\n")], capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()
    assert "needs Horovod" in line and "hvd_resilient[horovod]" in line, line
    for tool in (["ckpt", "--help"], ["report", "--help"], ["plan", "--help"]):
        r = subprocess.run([str(bare_venv / "bin/hvd-resilient"), *tool], capture_output=True,
                           text=True, timeout=120, cwd="/")
        assert r.returncode == 0, (tool, r.stderr[-2000:])


def test_digits_trains_under_torchrun_survives_a_kill_and_checkpoints(
        bare_venv: Path, tmp_path: Path, jobs) -> None:
    run = tmp_path / "run"
    env = jobs.env(HVD_RESILIENT_FAULT="kill:rank=1:step=30")
    env["PATH"] = f"{bare_venv / 'bin'}:{env['PATH']}"
    env.pop("PYTHONPATH", None)  # the installed package, not the checkout
    job = jobs.start([str(bare_venv / "bin/hvd-resilient"), "run", "--launcher", "torchrun",
                      "--np", "2", "--run-id", "bare", "--run-dir", str(run),
                      "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                      "--torchrun-restarts", "2", "--", str(bare_venv / "bin/python"),
                      str(ROOT / "examples/digits.py"), "--run-id", "bare", "--run-dir",
                      str(run), "--epochs", "3", "--commit-every", "5"], env=env, name="bare")
    assert job.wait(600) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    assert any(e["event"] == "resume" for e in evs), "the restarted workers did not resume"
    done = [e for e in evs if e["event"] == "done"]
    assert len(done) == 2 and len({e["params_sha256"] for e in done}) == 1, done
    assert list((run / "checkpoints").glob("step-*/manifest.json"))


def test_digits_recovers_in_place_from_a_kill_without_horovod(
        bare_venv: Path, tmp_path: Path, jobs) -> None:
    """The in-place backend needs nothing but torch: a worker of three killed mid-run, the two
    others go on in their processes (no new `start`) and end identical."""
    run = tmp_path / "run"
    env = jobs.env(HVD_RESILIENT_FAULT="kill:rank=2:step=30")
    env["PATH"] = f"{bare_venv / 'bin'}:{env['PATH']}"
    env.pop("PYTHONPATH", None)
    job = jobs.start([str(bare_venv / "bin/hvd-resilient"), "run", "--launcher", "inplace",
                      "--np", "3", "--run-id", "bare-ip", "--run-dir", str(run), "--",
                      str(bare_venv / "bin/python"), str(ROOT / "examples/digits.py"),
                      "--run-id", "bare-ip", "--run-dir", str(run), "--epochs", "3",
                      "--commit-every", "5"], env=env, name="bare-inplace")
    assert job.wait(600) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    assert len([e for e in evs if e["event"] == "start"]) == 3, "a worker was restarted"
    assert [e["new_size"] for e in evs if e["event"] == "reset" and e["rank"] == 0] == [2]
    done = [e for e in evs if e["event"] == "done"]
    assert len(done) == 2 and len({e["params_sha256"] for e in done}) == 1, done
    assert list((run / "checkpoints").glob("step-*/manifest.json"))
