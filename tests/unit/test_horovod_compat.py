"""The gate in front of Horovod's internals: it passes on the installed, tested release and
names exactly what is missing otherwise."""

from __future__ import annotations

import ast
import re

import pytest

from hvd_resilient.backends.horovod import compat
from hvd_resilient.errors import LaunchError
from tests.support.paths import ROOT

DECLARED_PRIVATES = 63
"""The Horovod privates compat.py may declare (docs/extending.md, "No new Horovod private
without retiring one"): one more means retiring one, or raising this number and the page's in
the same change, saying why."""


def test_the_installed_horovod_has_every_target():
    assert compat.check_compatible(driver=True) in compat.TESTED_VERSIONS
    assert compat.check_compatible(driver=False) in compat.TESTED_VERSIONS


def test_the_driver_never_imports_torch():
    """The driver's start is in every launch and relaunch: torch alone is 1.5 s of it."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from hvd_resilient.launch.horovod import driver\n"
            "driver.prepare(['-np', '1', 'true'])\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


def test_a_missing_target_is_named_in_one_line(monkeypatch):
    monkeypatch.setattr(compat, "DRIVER_TARGETS", compat.DRIVER_TARGETS + (
        ("horovod.runner.elastic.driver", "ElasticDriver._renamed_in_a_later_release"),))
    monkeypatch.setattr(compat, "DRIVER_FIELDS", compat.DRIVER_FIELDS + (
        ("horovod.runner.elastic.driver", "ElasticDriver", "_gone"),))
    with pytest.raises(LaunchError) as e:
        compat.check_compatible(driver=True)
    msg = str(e.value)
    assert "\n" not in msg and "ElasticDriver._renamed_in_a_later_release" in msg
    assert "(and 1 more)" in msg
    compat.check_compatible(driver=False)  # the worker side does not need the driver's
    monkeypatch.setattr(compat, "WORKER_TARGETS", compat.WORKER_TARGETS + (
        ("horovod.torch.elastic.state", "TorchState._renamed"),))
    with pytest.raises(LaunchError, match="TorchState._renamed"):
        compat.check_compatible(driver=False)


def test_an_untested_release_is_refused(monkeypatch):
    import horovod

    monkeypatch.setattr(horovod, "__version__", "0.29.0")
    with pytest.raises(LaunchError, match=r"Horovod 0\.29\.0 is not a tested release"):
        compat.check_compatible(driver=False)


def test_no_new_horovod_private_without_retiring_one():
    declared = (len(compat.DRIVER_TARGETS) + len(compat.DRIVER_FIELDS)
                + len(compat.WORKER_TARGETS) + len(compat.WORKER_FIELDS))
    assert declared <= DECLARED_PRIVATES, (
        f"compat.py declares {declared} Horovod privates, {DECLARED_PRIVATES} allowed: retire "
        "one for each one added, or raise DECLARED_PRIVATES and the count in "
        "docs/extending.md in this change, saying why")
    assert declared == DECLARED_PRIVATES, (
        f"compat.py declares {declared} Horovod privates: lower DECLARED_PRIVATES and the "
        "count in docs/extending.md to it, so that the next one needs a reason too")
    page = (ROOT / "docs" / "extending.md").read_text()
    stated = re.search(r"compat\.py declares \*\*(\d+)\*\*", page)
    assert stated is not None and int(stated.group(1)) == DECLARED_PRIVATES, \
        "docs/extending.md states another count than DECLARED_PRIVATES"


def test_the_horovod_backend_imports_nothing_above_it():
    """compat and the rest of `backends/horovod/` are imported by the driver side
    (`launch/horovod/`) and the workers alike: they never reach up into the layers above."""
    above = ("hvd_resilient.launch", "hvd_resilient.training")
    found = []
    for path in sorted((ROOT / "hvd_resilient" / "backends" / "horovod").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}: {n}" for n in names
                      if any(n == top or n.startswith(top + ".") for top in above)]
    assert found == []
