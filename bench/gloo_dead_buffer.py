"""Gloo's wedged pair, shown on torch's own copy of Gloo (the upstream code our Horovod build
patches: `scripts/patch_horovod.py`).

Two processes, one Gloo process group (timeout `--timeout` s). Rank 0 posts a receive from
rank 1 and drops it (its work, and with it the unbound buffer, is freed: what a failed
collective's unwinding does to its other receives). Rank 1 then either sends the message that
receive asked for ("message for a freed buffer") or not ("control"), and exits. Rank 0 then
receives from rank 1 again and reports how long that takes to fail. A pair that can still read
sees rank 1's close at once; the wedged one never reads again and waits out the timeout.

Prints a table and writes `--out` (JSON). Nothing here is hvd_resilient's code: it is the
evidence for the patch, and a reproducer to hand upstream.

Usage: ``.venv/bin/python bench/gloo_dead_buffer.py --repeats 3`` (about 30 s per wedged run).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time


def _rank(rank: int, port: int, send: bool, timeout: float) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=timeout + 30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout))
    if rank == 0:
        work = dist.irecv(torch.zeros(1024), src=1)
        del work  # the receive stays posted at the pair; its buffer is freed
        gc.collect()
        store.set("posted", "1")
        store.wait(["gone"])
        t0 = time.monotonic()
        try:
            dist.recv(torch.zeros(1024), src=1)
            outcome = "returned"
        except RuntimeError as e:
            outcome = str(e).splitlines()[0].split("] ", 1)[-1][:100]
        print(json.dumps({"fail_s": time.monotonic() - t0, "error": outcome}), flush=True)
    else:
        store.wait(["posted"])
        if send:
            dist.send(torch.ones(1024), dst=0)  # lands on the freed buffer
        # Closing the store client and the process group's sockets is the exit below; "gone"
        # is set first so rank 0 starts timing before the close can reach it.
        store.set("gone", "1")
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(send: bool, timeout: float) -> dict:
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port),
                               "--timeout", str(timeout)] + (["--send"] if send else []),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for r in (0, 1)]
    try:
        out = procs[0].communicate(timeout=timeout + 60)[0]
        procs[1].wait(timeout=10)
    finally:
        for p in procs:
            p.kill()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=10.0, help="the process group's timeout (s)")
    p.add_argument("--out", default="bench/results/gloo-dead-buffer.json")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--send", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank is not None:
        _rank(a.rank, a.port, a.send, a.timeout)
        return
    import torch

    rows = {"message for a freed buffer": [_run(True, a.timeout) for _ in range(a.repeats)],
            "control (no such message)": [_run(False, a.timeout) for _ in range(a.repeats)]}
    print(f"torch {torch.__version__}, Gloo timeout {a.timeout:g} s, {a.repeats} runs each\n")
    print("| case | next recv fails after (median / max) | error |\n| --- | --- | --- |")
    for case, runs in rows.items():
        t = [r["fail_s"] for r in runs]
        print(f"| {case} | {statistics.median(t):.2f} / {max(t):.2f} s | {runs[-1]['error']} |")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"torch": torch.__version__, "timeout_s": a.timeout, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
