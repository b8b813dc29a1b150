"""The training command's `python` is this environment's; another interpreter is checked before
the launch (launch/interpreter.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hvd_resilient.errors import LaunchError
from hvd_resilient.launch.interpreter import check_interpreter, is_python, workers_command


@pytest.mark.parametrize("name", ["python", "python3", "python3.11", "/opt/x/bin/python3"])
def test_python_names(name):
    assert is_python(name)


@pytest.mark.parametrize("name", ["bash", "./train.sh", "pythonista", "torchrun"])
def test_not_python(name):
    assert not is_python(name)


def test_bare_python_becomes_this_environments():
    assert workers_command(["python", "t.py", "--x"], this="/env/bin/python") == \
        ["/env/bin/python", "t.py", "--x"]
    assert workers_command(["python3.11", "t.py"], this="/env/bin/python")[0] == "/env/bin/python"
    # a path is the user's choice; a non-Python command is left alone
    assert workers_command(["/usr/bin/python3", "t.py"])[0] == "/usr/bin/python3"
    assert workers_command(["bash", "run.sh"]) == ["bash", "run.sh"]


def test_this_environments_interpreter_is_not_probed():
    check_interpreter([sys.executable, "t.py"])  # no subprocess: it is ours


def test_an_interpreter_without_the_project_is_refused_in_one_line(tmp_path):
    # a real interpreter that cannot import the project: Python with site-packages ignored
    bare = tmp_path / "python3"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S -I \"$@\"\n")
    bare.chmod(0o755)
    assert subprocess.run([str(bare), "-c", "pass"], timeout=30).returncode == 0
    with pytest.raises(LaunchError) as e:
        check_interpreter([str(bare), "t.py"])
    msg = str(e.value)
    assert "\n" not in msg and str(bare) in msg and "No module named" in msg
    assert "write `python`" in msg


def test_a_missing_interpreter_is_refused(tmp_path):
    with pytest.raises(LaunchError, match="does not exist"):
        check_interpreter([str(tmp_path / "python3"), "t.py"])
