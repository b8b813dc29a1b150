"""The shell scripts users and CI run are shellcheck-clean and parse."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support.paths import ROOT

SCRIPTS = ["scripts/install.sh", ".ci/run", "examples/slurm/train.sbatch"]


@pytest.mark.parametrize("path", SCRIPTS)
def test_shellcheck_clean(path):
    exe = shutil.which("shellcheck")
    assert exe, "install shellcheck (make install)"
    r = subprocess.run([exe, "-x", str(ROOT / path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sbatch_asks_for_requeue_and_a_warning_signal():
    text = (ROOT / "examples/slurm/train.sbatch").read_text()
    assert "#SBATCH --requeue" in text
    assert "#SBATCH --signal=B:USR1@" in text
