"""Horovod's own elastic test worker, ported with only its state line and decorator swapped.

The original is `test/integration/data/elastic_torch_main.py` in the horovod repository
(github.com/horovod/horovod, Apache-2.0, read at commit 2626dc87); this is the team's own
rewrite of it, line for line in behaviour: the same arguments, model, exit schedule, log line
per epoch and the same wait for the driver's notification, with exactly two lines changed the
way a Horovod user switching to hvd_resilient changes them:

    state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0, ...)  ->
    state = hvd_resilient.ElasticState(model, optimizer, batch=0, epoch=0, ...)
    @hvd.elastic.run  ->  @hvd_resilient.run

Rank 0 appends one JSON line per finished epoch to --logfile; the scenarios'
discovery script reads that file's line count as "the epoch" to decide which hosts to print,
which is how a schedule of host changes is tied to training progress
(tests/integration/test_horovod_scenarios.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import horovod.torch as hvd
import psutil
import torch
import torch.nn.functional as F

import hvd_resilient

log = logging.getLogger("horovod_elastic_main")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Horovod's PyTorch elastic test worker, ported")
    p.add_argument("--batches-per-epoch", type=int, default=10)
    p.add_argument("--batches-per-commit", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--epoch-wait", type=float, default=0.0, help="seconds each epoch sleeps")
    p.add_argument("--logfile", default="/tmp/logfile.txt", help="one JSON line per epoch")
    p.add_argument("--discovery-schedule", default="[]",
                   help="JSON list of [epoch or null, [host:slots, ...]]")
    p.add_argument("--discovery-wait", type=int, default=3,
                   help="seconds rank 0 waits for the driver's notice of an expected host "
                        "change (<= 0: no wait)")
    p.add_argument("--exit-schedule", default="{}",
                   help='JSON map "(epoch, batch)" -> start ranks that exit there')
    p.add_argument("--exit-mode", default="exception", help="exception | kill")
    return p.parse_args()


args = parse_args()
logging.basicConfig(level=logging.INFO, format="%(message)s")

hvd.init()

batch_size = 32
data = torch.randn(batch_size, 2)
target = torch.LongTensor(batch_size).random_() % 2

lr = 0.001
model = torch.nn.Sequential(torch.nn.Linear(2, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

# Who this process was when it started: the scenarios' assertions are about these.
hostname = os.environ.get("HOROVOD_HOSTNAME")
start_rank = int(os.environ.get("HOROVOD_RANK", 0))

discovery_schedule = json.loads(args.discovery_schedule)
epoch_to_hosts = {epoch: hosts for epoch, hosts in discovery_schedule if epoch is not None}
default_hosts = discovery_schedule[-1][1] if discovery_schedule else []
exit_schedule = json.loads(args.exit_schedule) if args.exit_schedule else {}


def check_exit(epoch: int, batch: int) -> None:
    """Ends this process where the exit schedule says, by an exception or by SIGKILL."""
    if start_rank not in exit_schedule.get(str((epoch, batch)), []):
        return
    if args.exit_mode == "exception":
        raise RuntimeError(f"check_rank and exit epoch={epoch} batch={batch} "
                           f"start_rank={start_rank} rank={hvd.rank()}")
    psutil.Process(os.getpid()).kill()


def log_state(state: hvd_resilient.ElasticState) -> None:
    line = {"epoch": state.epoch, "batch": state.batch, "commits": state.commits,
            "hostname": hostname, "start_rank": start_rank, "rank": hvd.rank(),
            "size": hvd.size(), "rendezvous": state.rendezvous}
    with open(args.logfile, "a") as f:
        f.write(json.dumps(line) + os.linesep)


def wait_for_host_notice(state: hvd_resilient.ElasticState) -> None:
    """Rank 0, when the schedule changes the hosts after this epoch: the driver's notice must
    reach it within --discovery-wait s (Horovod's check, on Horovod's private queue)."""
    current_hosts = epoch_to_hosts.get(state.epoch, default_hosts)
    next_hosts = epoch_to_hosts.get(state.epoch + 1, default_hosts)
    if args.discovery_wait <= 0 or current_hosts == next_hosts:
        return
    log.info("host changes: %s -> %s", current_hosts, next_hosts)
    start = int(time.time())
    # Any notice raises HostsUpdatedInterrupt at the next commit, even one whose timestamp is
    # not newer than the last (the driver's clock may have gone back).
    state._last_updated_timestamp = 0
    while state._host_messages.empty():
        if int(time.time()) - start > args.discovery_wait:
            raise TimeoutError("Timed out waiting for notifications from driver.")
        time.sleep(0.1)


@hvd_resilient.run
def train(state: hvd_resilient.ElasticState) -> None:
    state.rendezvous += 1
    while state.epoch < args.epochs:
        log.info("epoch %d batch %d", state.epoch, state.batch)
        while state.batch < args.batches_per_epoch:
            check_exit(state.epoch, state.batch)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            state.batch += 1
            if state.batch % args.batches_per_commit == 0:
                state.commits += 1
                state.commit()
        if hvd.rank() == 0:
            log_state(state)
            wait_for_host_notice(state)
        if args.epoch_wait > 0:
            time.sleep(args.epoch_wait)
        state.epoch += 1
        state.batch = 0
        state.commits += 1
        state.commit()


def on_state_reset() -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * hvd.size()


state = hvd_resilient.ElasticState(model, optimizer, batch=0, epoch=0, commits=0, rendezvous=0)
state.register_reset_callbacks([on_state_reset])
train(state)
