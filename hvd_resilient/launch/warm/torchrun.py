"""torchrun whose restarted workers skip the cold start.

    python -m hvd_resilient.launch.warm.torchrun TORCHRUN_ARGS... script.py ARGS...

Takes exactly torchrun's arguments. After a worker dies, torchrun stops the round and starts
every worker again as a new interpreter: measured here, ~4 s of a ~4.5 s restart went to
each new worker importing torch, torch._dynamo (which the first optimizer pulls in) and the
training code. This module imports those once, in the agent, and then runs torchrun itself
with its own `--run-path --start-method fork`: each worker of each round is forked from the
agent with the imports done and runs the script in-process (`runpy`), as `python script.py`
would.

Forking is safe for CUDA only while the agent has not initialized it; nothing here does
(checked before the first fork: otherwise, for `-m` commands or with
`HVD_RESILIENT_TORCHRUN_FORK=0`, each worker is a new interpreter).

Either way every worker is prepared before the script runs (`torchrun_worker`): its process
group forms in a restarted round, it ends on SIGTERM, its first optimizer step is on record.
Forked workers through an at-fork hook of this process; new interpreters by running
`python -m hvd_resilient.launch.torchrun_worker SCRIPT ARGS...` in place of the script. Only
`--no-python` and `--run-path` commands run exactly as given.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from hvd_resilient.launch.torchrun_round_store import ROUND_ENV
from hvd_resilient.launch.warm.imports import import_script_modules, settle_heap

ENV = "HVD_RESILIENT_TORCHRUN_FORK"


def _script_index(args: list[str]) -> int | None:
    """Where the training script is in torchrun's arguments (torchrun's own parser decides),
    or None when it is not a plain script (`-m`, `--no-python`, `--run-path` given)."""
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    if parsed.module or parsed.no_python or parsed.run_path:
        return None
    i = len(args) - 1 - len(parsed.training_script_args)
    return i if args[i] == parsed.training_script else None


def warm_args(args: list[str]) -> list[str] | None:
    """torchrun arguments that fork each worker from this process, or None to run as given."""
    if os.environ.get(ENV, "1") == "0":
        return None
    i = _script_index(args)
    if i is None:
        return None
    script = os.path.abspath(args[i])
    return ["--run-path", "--start-method", "fork", *args[:i], script, *args[i + 1:]]


WORKER = "hvd_resilient.launch.torchrun_worker"


def worker_args(args: list[str]) -> list[str] | None:
    """torchrun arguments that start each worker as a new interpreter through `WORKER`, which
    prepares it and then runs the script (or `-m` module) as given; None for `--no-python`
    and `--run-path` commands, which run as given."""
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)
    if parsed.no_python or parsed.run_path:
        return None
    i = len(args) - 1 - len(parsed.training_script_args)
    if args[i] != parsed.training_script:
        return None
    if parsed.module:  # torchrun runs `python -m WORKER -m MODULE ARGS...`
        return [*args[:i], WORKER, "-m", args[i], *args[i + 1:]]
    return [*args[:i], "-m", WORKER, *args[i:]]


def prepare_forked_workers(script: str) -> None:
    """Every worker forked from this process from now on is prepared in the child
    (`torchrun_worker.prepare_forked_child`), before torch's `_wrap` runs the script. The
    round-store patch is applied here, where a torch it does not fit fails the launch (an
    at-fork hook's exception is only printed), and the children inherit it; the agent itself
    never calls what it wraps."""
    from functools import partial

    from hvd_resilient.launch.torchrun_round_store import apply_round_store
    from hvd_resilient.launch.torchrun_worker import prepare_forked_child

    apply_round_store()
    os.register_at_fork(after_in_child=partial(prepare_forked_child, os.path.dirname(script),
                                               agent=os.getpid()))


def _warm_up(script: str) -> bool:
    """Imports what every worker imports anyway, the script's own modules included (measured:
    a restarted worker of examples/digits.py spent 2-17 s importing sklearn under load; with
    it imported in the agent, kill to first step was 1.4 s); False if CUDA got initialized
    (no fork)."""
    import torch
    import torch._dynamo  # noqa: F401 - see the module docstring

    import hvd_resilient.backends.torchrun.backend  # noqa: F401
    import hvd_resilient.training.trainer  # noqa: F401

    import_script_modules(script)
    settle_heap()  # before the first fork
    return not torch.cuda.is_initialized()


def stop_restarts_on_fatal() -> None:
    """A worker that exits with FATAL_EXIT_CODE stopped on an error every restart would meet
    again (a checkpoint that does not fit, a bad config): the agent gives up its remaining
    restarts instead of restarting every worker into the same error."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from hvd_resilient.errors import FATAL_EXIT_CODE

    monitor = LocalElasticAgent._monitor_workers

    def monitor_and_stop(self: Any, worker_group: Any) -> Any:
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED and any(
                getattr(f, "exitcode", None) == FATAL_EXIT_CODE
                for f in (result.failures or {}).values()):
            self._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor_and_stop  # type: ignore[method-assign]


def kill_stopped_workers_first() -> None:
    """When the agent stops its workers (another node's worker failed, or a peer found one
    of ours frozen and left), a stopped worker is SIGKILLed at once instead of being sent
    SIGTERM, which it cannot act on, and waited for: torchrun waits 30 s before its SIGKILL
    (measured: a frozen worker on one node held the restart of a two-node job 35 s).
    SIGKILL works on a stopped process, and it can never wake up inside a round that moved
    on. Running workers get torchrun's SIGTERM and grace as before."""
    import signal

    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from hvd_resilient.detect.heartbeat import STOPPED, process_state

    shutdown = LocalElasticAgent._shutdown

    def kill_stopped_then_shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        pcontext = getattr(self, "_pcontext", None)
        try:
            pids = list(pcontext.pids().values()) if pcontext is not None else []
        except Exception:  # noqa: BLE001 - no workers (yet): nothing to check
            pids = []
        for pid in pids:
            if process_state(pid) in STOPPED:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return shutdown(self, *args, **kwargs)

    LocalElasticAgent._shutdown = kill_stopped_then_shutdown  # type: ignore[method-assign]




def export_round() -> None:
    """Workers learn the rendezvous round they belong to (`HVD_RESILIENT_RDZV_ROUND`).

    The torchrun backend keys each round's process-group store by round, so a round never
    reads a dead round's addresses. Each agent's TORCHELASTIC_RESTART_COUNT is its own count:
    a node that joins later (a replaced host) starts at 0 while the others are at 2, and its
    workers would wait under another prefix until the process-group timeout. The round is the
    rendezvous' own, the same on every node. Read from a private attribute; where it is
    missing the backend falls back to the restart count (fixed membership works either way)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    joined = dr.DynamicRendezvousHandler.next_rendezvous

    def next_rendezvous(self: Any) -> Any:
        info = joined(self)
        state = getattr(getattr(self, "_state_holder", None), "state", None)
        round_ = getattr(state, "round", None)
        if isinstance(round_, int):
            os.environ[ROUND_ENV] = str(round_)  # inherited by this round's workers
        return info

    dr.DynamicRendezvousHandler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    from torch.distributed.run import main as torchrun_main

    stop_restarts_on_fatal()
    kill_stopped_workers_first()
    export_round()

    warm = warm_args(args)
    script = os.path.abspath(args[_script_index(args) or 0]) if warm is not None else ""
    if warm is not None and _warm_up(script):
        prepare_forked_workers(script)
        args = warm
    else:
        args = worker_args(args) or args
    sys.argv = ["torchrun", *args]
    torchrun_main(args)


if __name__ == "__main__":
    main()
