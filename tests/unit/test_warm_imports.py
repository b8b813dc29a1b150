"""The warm start's heap: what a standby or a warm process imported is settled once, while it
waits, so that no full collection of it lands later in a reset the whole world waits in."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.paths import ROOT

PROBE = textwrap.dedent("""
    import gc, torch
    from hvd_resilient.launch.warm.imports import settle_heap
    before = gc.get_freeze_count()
    settle_heap()
    frozen = gc.get_freeze_count()
    junk = [[] for _ in range(1000)]  # new objects stay in the collector's sight
    print(before, frozen, len(gc.get_objects()) < frozen)
""")


def test_settle_heap_puts_the_imports_out_of_the_collectors_sight():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    before, frozen, fewer = int(out[0]), int(out[1]), out[2]
    assert before == 0
    assert frozen > 50_000, "torch's import alone leaves far more objects than this"
    assert fewer == "True", "a full collection now scans only what came after"
