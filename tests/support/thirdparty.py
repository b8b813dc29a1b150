"""Third-party training scripts, as a user would run them: the unchanged upstream copy under
tests/thirdparty/<name>/, with the patches our docs tell a user to apply (and what this CPU
machine forces) applied into a fresh folder by `patch -p1`.

A patch that no longer applies fails the test at once, naming the patch: the tier then says
that the docs' instructions and the script have drifted apart.

`probe_env()` adds tests/support/probe to PYTHONPATH: its `sitecustomize` records, in every
worker, a digest of each `DistributedDataParallel` model's parameters when the script calls
`destroy_process_group()` (the tutorial scripts' last line), so a test compares the ranks'
final models without a line of the script changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from tests.support.paths import TESTS

THIRDPARTY = TESTS / "thirdparty"
PROBE = Path(__file__).resolve().parent / "probe"
PROBE_ENV = "HVDR_TEST_PROBE_DIR"


def prepare(name: str, dest: Path, patches: tuple[str, ...] = ()) -> Path:
    """Copies tests/thirdparty/<name> to ``dest`` and applies ``patches`` (file names in that
    folder), in order. Returns ``dest``."""
    src = THIRDPARTY / name
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.patch", "LICENSE*", "*.md"),
                    dirs_exist_ok=True)
    for p in patches:
        r = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(src / p)],
                           cwd=dest, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise AssertionError(f"{name}/{p} does not apply:\n{r.stdout}{r.stderr}")
    return dest


def probe_env(env: dict[str, str], out: Path) -> dict[str, str]:
    """``env`` with the digest probe on (see the module doc); digests land in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(p for p in (str(PROBE), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, PROBE_ENV: str(out)}


def probed_digests(out: Path) -> dict[int, str]:
    """rank -> parameter digest, from every worker that reached destroy_process_group()."""
    found: dict[int, str] = {}
    for f in sorted(out.glob("rank*.json")):
        rec = json.loads(f.read_text())
        found[int(rec["rank"])] = rec["digest"]
    return found
