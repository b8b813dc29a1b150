"""The driver tells rank 0 of a discovery change at once, also while newcomers warm up.

Horovod's own elastic test worker waits at most 3 s for that notice ("Timed out waiting for
notifications from driver."); the standby patch used to hold it back until the newcomers had
imported torch and Horovod (5-20 s). Here Horovod's real `ElasticDriver` methods, patched by
`patches/standby_slots.py`, run on a driver object with stand-ins only for what reaches the network
(the worker client, the process start, the rendezvous store), in a child process so that the
patches never touch this test session's Horovod classes. The newcomer never gets ready (its
start is a no-op), which is the slowest warm-up there is.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.paths import ROOT

CHILD = r"""
import json, threading, time
from collections import defaultdict

from horovod.runner.elastic.discovery import DiscoveredHosts
from horovod.runner.elastic.driver import ElasticDriver
from horovod.runner.elastic.worker import HostUpdateResult

from hvd_resilient.launch.horovod.patches import standby_slots
from hvd_resilient.launch.horovod.patches.context import PatchContext

patch = standby_slots.install(PatchContext())

class Client:
    def __init__(self):
        self.notices = []
    def notify_hosts_updated(self, timestamp, update_res):
        self.notices.append((time.monotonic(), int(update_res)))

class Httpd:
    cache_lock = threading.Lock()
    cache = {}

class Rendezvous:
    _httpd = Httpd()

d = ElasticDriver.__new__(ElasticDriver)
d._rendezvous = Rendezvous()
d._min_num_proc, d._max_num_proc = 1, 4
started = []
d._start_worker_process = lambda slot: started.append(f"{slot.hostname}:{slot.local_rank}")
old = DiscoveredHosts({"localhost+0": 1}, ["localhost+0"])
d._host_assignments, _ = d._get_host_assignments(old)
d._rank_assignments = {0: d._host_assignments["localhost+0"][0]}
client = Client()
d._worker_clients = {("localhost+0", 0): client}

d._shutdown = threading.Event()
grown = DiscoveredHosts({"localhost+0": 1, "127.0.0.1+0": 1}, ["localhost+0", "127.0.0.1+0"])
t0 = time.monotonic()
d._notify_workers_host_changes(grown, HostUpdateResult.added)
out = {
    "started": list(started),
    "notices": [(t - t0, res) for t, res in client.notices],
    "added": int(HostUpdateResult.added),
    "standby": sorted(patch.table(d)),
}

# The reset: the driver forms the new world and releases the newcomer (Horovod calls this in
# its rendezvous barrier's action, while the old workers wait for their new ranks).
def go():
    with Httpd.cache_lock:
        return Httpd.cache.get("hvd_resilient_standby_go", {}).get("127.0.0.1+0:0")
nxt, _ = d._get_host_assignments(grown)
release = threading.Thread(target=d._start_worker_processes, args=(nxt["127.0.0.1+0"],))
release.start()
release.join(0.5)
out["held_while_warming"] = release.is_alive() and go() is None
with Httpd.cache_lock:
    Httpd.cache.setdefault("hvd_resilient_standby_ready", {})["127.0.0.1+0:0"] = b"1"
release.join(10)
out["released"] = (not release.is_alive()) and go() is not None
out["started_after"] = list(started)
print(json.dumps(out))
"""


def test_rank_0_is_told_at_once_and_the_new_world_waits_for_the_warm_newcomer():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # The newcomer was started ahead of the reset, as a standby awaiting its release...
    assert out["started"] == ["127.0.0.1+0:0"]
    assert out["standby"] == ["127.0.0.1+0:0"]
    # ...and rank 0 heard of the change during the same call, not once the newcomer is warm.
    assert len(out["notices"]) == 1, out
    seconds, res = out["notices"][0]
    assert res == out["added"]
    assert seconds < 1.0, f"rank 0 told {seconds:.2f} s after the change"
    # The reset waits for the newcomer's warm-up in the barrier, and releases that same
    # process (no second start of its slot) once it says it is ready.
    assert out["held_while_warming"], "released before the standby was ready"
    assert out["released"], "not released once the standby was ready"
    assert out["started_after"] == ["127.0.0.1+0:0"]
