"""Which recovery path each strategy takes for each failure class, and what it costs.

A path is one of:

* ``elastic``: survivors notice (after ``detect``), reset and sync from the last in-memory
  commit (``recover``), redo the work since that commit, and go on without the lost host
  until it, or a spare, joins again (a short stall for everybody when it does);
* ``restart``: the whole job is relaunched and resumes from the newest durable checkpoint
  whose upload had finished: everything since it is redone;
* ``graceful``: the host leaves on notice at a commit: nothing is redone;
* ``graceful_restart``: on notice the job writes a blocking checkpoint and restarts without the
  host: nothing is redone, but the whole job stops for the save and the restart.

The strategies: vanilla Horovod Elastic (`hvd.elastic.run` + `TorchState`: no hang-up watch, so
every failure waits out the Gloo timeout; a blocking rank-0 `torch.save` for durable
checkpoints; a recovery that fails ends the job, which is then resubmitted), plain torchrun
(every failure restarts all workers cold and resumes from the durable checkpoint, saved
blocking; silent peers and hangs wait for the NCCL timeout), this project's Horovod stack
(hang-up watch, peer heartbeats for frozen or cut-off peers, the progress watchdog for hangs,
standby workers, async durable checkpoints, the supervisor's restart when an in-process
recovery fails) and this project's torchrun path (restart-all with warm forked workers, the
progress watchdog, async checkpoints; no heartbeats, so a silent peer waits for the
process-group timeout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hvd_resilient.report.plan.model import CLASSES, Inputs

ELASTIC, RESTART, GRACEFUL, GRACEFUL_RESTART = 1, 2, 3, 4
KIND_NAMES = {ELASTIC: "elastic", RESTART: "restart", GRACEFUL: "graceful",
              GRACEFUL_RESTART: "graceful_restart"}

STRATEGIES = ("vanilla-horovod", "torchrun", "ours", "ours-torchrun")
TITLES = {
    "vanilla-horovod": "vanilla Horovod Elastic",
    "torchrun": "torchrun restart-all + blocking checkpoints",
    "ours": "hvd_resilient (Horovod elastic + async durable)",
    "ours-torchrun": "hvd_resilient under torchrun (warm restart-all)",
}


@dataclass(frozen=True)
class Path:
    kind: int
    detect: tuple[float, ...]
    """Seconds from the fault to the moment the job acts (samples: one drawn per failure)."""
    recover: tuple[float, ...]
    """Seconds from then until training goes on (samples)."""
    rejoin_s: float = math.inf
    """Elastic/graceful: when the host (or its replacement) is back; inf: never."""
    how: str = ""


@dataclass(frozen=True)
class Strategy:
    name: str
    title: str
    paths: dict[str, Path]
    restart: tuple[float, ...]
    """Restart path after detection: relaunch + restore (+ overhead), samples."""
    giveup: float
    """Probability that an elastic recovery fails and the restart path follows."""
    escalate_overlap: bool
    """A failure during an in-process recovery ends the job (vanilla Horovod)."""
    join_stall: tuple[float, ...]
    commits: bool
    """In-memory commits between durable checkpoints (elastic stacks)."""
    commit_s: float
    ckpt_stall_s: float
    ckpt_upload_s: float
    """0: the checkpoint is durable when its stall ends (a blocking save)."""
    restartable: bool = True
    """False: nothing restarts a job that ended (a benchmark without a supervisor)."""

    @property
    def elastic(self) -> bool:
        return any(p.kind == ELASTIC for p in self.paths.values())


def _s(x: float) -> tuple[float, ...]:
    return (float(x),)


def build(name: str, inp: Inputs) -> Strategy:
    """The strategy `name` with the costs in `inp` (samples where measured ones exist)."""
    restore = inp["restore_s"]
    over = inp["restart_overhead_s"]
    gloo, nccl = inp["gloo_timeout_s"], inp["nccl_timeout_s"]
    replace = inp["replace_s"]
    if name == "ours":
        det = inp.samples("ours_detect_s")
        rec = inp.samples("ours_recover_s")
        paths = {
            "crash": Path(ELASTIC, det, rec, inp["ours_rejoin_s"],
                          "memory tier: survivors restore the commit; the worker is back "
                          "after the cooldown (peer tier: it syncs from a survivor)"),
            "host_loss": Path(ELASTIC, det, rec, replace, "memory tier; a spare joins later"),
            "silent_host_loss": Path(ELASTIC, inp.samples("ours_silent_detect_s"), rec, replace,
                                     "no hang-up: found by the peer heartbeats; memory tier"),
            "hang": Path(ELASTIC, inp.samples("ours_hang_detect_s"), rec, inp["ours_rejoin_s"],
                         "the progress watchdog ends the hung rank; memory tier"),
            "preempt_notice": Path(GRACEFUL, _s(0.0), inp.samples("ours_leave_stall_s"),
                                   replace, "removed at the next step via discovery"),
            "preempt_no_notice": Path(ELASTIC, det, rec, replace, "like a host loss"),
        }
        return Strategy(
            name, TITLES[name], paths,
            restart=tuple(inp["supervisor_delay_s"] + c + restore + over
                          for c in inp.samples("cold_start_s")),
            giveup=inp["ours_giveup"], escalate_overlap=False,
            join_stall=inp.samples("ours_join_stall_s"), commits=True,
            commit_s=inp["commit_s"], ckpt_stall_s=inp["ckpt_async_stall_s"],
            ckpt_upload_s=inp["ckpt_upload_s"])
    if name == "vanilla-horovod":
        rec = inp.samples("vanilla_recover_s")
        hard = Path(ELASTIC, _s(gloo), rec, replace,
                    "every failure waits out the Gloo timeout; memory tier; the blacklisted "
                    "host is replaced by a spare")
        paths = {c: hard for c in CLASSES}
        for c in ("crash", "hang"):  # the host is healthy: back when Horovod takes it again
            paths[c] = Path(ELASTIC, _s(gloo), rec, inp["vanilla_rejoin_s"],
                            "waits out the Gloo timeout; memory tier; the host is back when "
                            "Horovod's blacklist lets it")
        paths["preempt_notice"] = Path(GRACEFUL, _s(0.0), inp.samples("vanilla_leave_stall_s"),
                                       replace, "removed at the next commit via discovery")
        return Strategy(
            name, TITLES[name], paths,
            restart=tuple(c + restore + over for c in inp.samples("cold_start_s")),
            giveup=inp["vanilla_giveup"], escalate_overlap=True,
            join_stall=inp.samples("vanilla_join_stall_s"), commits=True,
            commit_s=inp["commit_s"], ckpt_stall_s=inp["ckpt_sync_s"], ckpt_upload_s=0.0)
    if name in ("torchrun", "ours-torchrun"):
        warm = name == "ours-torchrun"
        relaunch = inp["ours_torchrun_restart_s"] if warm else inp["torchrun_restart_s"]
        down = _s(relaunch + restore + over)
        quick = Path(RESTART, _s(0.0), down, how="all workers restarted; durable tier")
        silent = inp["ours_pg_timeout_s"] if warm else nccl
        slow = Path(RESTART, _s(silent), down,
                    how=f"noticed at the {'process-group' if warm else 'NCCL'} timeout; "
                        "durable tier")
        hang = Path(RESTART, inp.samples("ours_hang_detect_s"), down,
                    how="the progress watchdog ends the hung rank; durable tier") if warm \
            else slow
        sync = inp["ckpt_sync_s"]
        if sync <= inp["preempt_notice_s"]:
            notice = Path(GRACEFUL_RESTART, _s(0.0), _s(sync + relaunch + restore + over),
                          how="blocking checkpoint in the notice window, then restart")
        else:
            notice = Path(RESTART, _s(inp["preempt_notice_s"]), down,
                          how="the checkpoint does not fit the notice: like a crash")
        paths = {"crash": quick, "host_loss": quick, "silent_host_loss": slow, "hang": hang,
                 "preempt_notice": notice, "preempt_no_notice": quick}
        return Strategy(
            name, TITLES[name], paths, restart=down, giveup=0.0, escalate_overlap=False,
            join_stall=_s(0.0), commits=False, commit_s=0.0,
            ckpt_stall_s=inp["ckpt_async_stall_s"] if warm else sync,
            ckpt_upload_s=inp["ckpt_upload_s"] if warm else 0.0)
    raise ValueError(f"unknown strategy {name!r}")


def restart_rate(strategy: Strategy, rates: dict[str, float]) -> tuple[float, float]:
    """(rate of failures that take the restart path, rate of those that take the elastic
    path), per second for the given per-class rates (for Young/Daly)."""
    restart = elastic = 0.0
    for c, lam in rates.items():
        kind = strategy.paths[c].kind
        if kind == RESTART:
            restart += lam
        elif kind == ELASTIC:
            restart += lam * strategy.giveup
            elastic += lam * (1.0 - strategy.giveup)
    return restart, elastic
