"""An elastic job in which one rank gives up a collective and stays alive (test_hangup.py).

At --abandon-step the process that is rank --abandon-rank makes its own Gloo operations fail
without telling anyone: `shutdown(SHUT_RD)` on each of its Gloo connections ends its receives at
once, here only (nothing is sent to the peer), and it keeps a duplicate of every one of those
sockets for the rest of its life, as a Horovod whose background loop is stuck keeps its group
(field notes: the survivor waited in a recv from a live peer until the Gloo timeout). Its own
collective fails, it goes through the elastic run loop's failure path like any rank whose
collective failed, and its peers are left waiting in a receive from it: unless it hangs up on
them, they wait out the Gloo timeout. The fault fires once per run (a marker file in the run
folder, as `hvd_resilient.training.faults` writes them: `.fault-0-abandon-rR-sS`).

Same events as bench/recovery_job.py (`start`, `enter`, commits, resets) and a `done` per rank
with its pid and parameter digest. Stops at --steps.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch import nn

import hvd_resilient
from hvd_resilient import log
from hvd_resilient.backends.horovod.state import ElasticState
from hvd_resilient.detect import gloo_watch
from hvd_resilient.events import EventLog
from hvd_resilient.state.sampler import ElasticDataSampler

logger = logging.getLogger("hvd_resilient.hangup_job")

HELD: list[int] = []
"""Duplicates of the abandoned sockets: open until this process exits."""


def abandon(conns: list[gloo_watch.tcp_sockets.TcpSocket], marker: Path) -> bool:
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False  # fired already in this run
    os.write(fd, f"{time.time():.6f}\n".encode())
    os.close(fd)
    # Every descriptor held before the first shutdown: that one fails Horovod's background
    # loop, which may close all its pairs before this loop reaches the next (EBADF, in CI).
    dups = [os.dup(c.fd) for c in conns]
    HELD.extend(dups)
    for held in dups:
        s = socket.socket(fileno=os.dup(held))
        s.shutdown(socket.SHUT_RD)
        s.close()
    logger.warning("abandoned %d Gloo connections", len(conns))
    return True


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--abandon-rank", type=int, default=1)
    p.add_argument("--abandon-step", type=int, default=35)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--heartbeat-timeout", type=float, default=1.5,
                   help="seconds; longer on a machine so loaded that a live worker starves")
    a = p.parse_args()

    hvd.init()
    log.setup(rank_fn=hvd.rank)
    torch.manual_seed(0)
    x = torch.randn(2048, 32)
    y = (x.sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    events = EventLog(os.path.join(a.run_dir, "events.jsonl"), rank=hvd.rank, size=hvd.size)
    events.emit("start", pid=os.getpid())
    state = ElasticState(model, opt, sampler=ElasticDataSampler(len(x), seed=0), events=events)
    marker = Path(a.run_dir) / f".fault-0-abandon-r{a.abandon_rank}-s{a.abandon_step}"

    @hvd_resilient.run(heartbeat_timeout_s=a.heartbeat_timeout)
    def train(state: ElasticState) -> None:
        events.emit("enter", at_step=state.step)
        conns: list[gloo_watch.tcp_sockets.TcpSocket] = []
        while state.step < a.steps:
            if state.step == a.abandon_step - 1:  # every rank: which connections are Gloo's
                everyone = hvd.allgather_object(gloo_watch.local_connections())
                conns = gloo_watch.peer_connections(everyone, hvd.rank())
            if (state.step == a.abandon_step and hvd.rank() == a.abandon_rank and conns
                    and not marker.exists()):
                # Given up inside a collective, as a rank whose Gloo failed: the sockets are shut
                # while this thread waits in synchronize, the GIL released. Shut between two
                # enqueues instead, the rank now and then hung in Horovod's next enqueue (bound
                # without releasing the GIL) while its background loop shut down; what the
                # enqueue waits for there is not pinned down.
                handle = hvd.allreduce_async(torch.zeros(1), name="hangup_job.abandoned")
                threading.Thread(target=abandon, args=(conns, marker)).start()
                hvd.synchronize(handle)  # fails: HorovodInternalError
            g = torch.Generator().manual_seed(state.step)
            idx = torch.randint(0, len(x), (32,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            time.sleep(a.step_time)
            state.step += 1
            if state.step % a.commit_every == 0 or state.host_change_pending():
                state.commit()

    train(state)
    events.emit("done", pid=os.getpid(), params_sha256=state.params_sha256())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
