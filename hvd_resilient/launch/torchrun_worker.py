"""What each worker of our torchrun launcher gets before the user's script runs, whatever the
script: it may be one that knows nothing of this library (PyTorch's DDP tutorial).

- Its process group forms in every restarted round (`torchrun_round_store`).
- It ends on SIGTERM (`restore_default_signals`): a worker forked from the agent
  (`warm/torchrun.py`) inherits the agent's Python SIGTERM handler, torch's
  `_terminate_process_handler`, installed by `PContext.start()` before the fork
  (elastic/multiprocessing/api.py). A Python handler runs only when the main thread is back
  between bytecodes; a survivor blocked in a Gloo collective (waiting for the dead peer) never
  is, so the agent's `_shutdown(SIGTERM, timeout=30)` waited 30 s for it before its SIGKILL
  (measured: 30 s per failed round; plain torchrun's `python script.py` workers, with the
  default disposition, end at once).
- A rank's first optimizer step is written to the run's event log (`first_step`, rank >= 0):
  evidence for the supervisor that a launch trained although the script writes no events of
  its own (`supervisor.py`). One event per worker process; after it the hook returns at once.

Forked workers get it from `prepare_forked_child`, an `os.register_at_fork` hook of the agent;
workers started as new interpreters (`HVD_RESILIENT_TORCHRUN_FORK=0`, CUDA initialized in the
agent, `-m module`) from `python -m hvd_resilient.launch.torchrun_worker SCRIPT ARGS...` (or
`-m MODULE ARGS...`), which runs the script as `python SCRIPT ARGS...` would.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.launch.torchrun_round_store import apply_round_store, round_of
from hvd_resilient.launcher_env import RUN_DIR_ENV

_TERMINATION = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's own default list


def restore_default_signals() -> list[str]:
    """Gives back the default disposition of every signal whose handler is the torchrun
    agent's own (see the module doc); returns their names. A handler the script or this
    library installs later is its own business."""
    from torch.distributed.elastic.multiprocessing import api

    agents = getattr(api, "_terminate_process_handler", None)
    restored = []
    for name in _TERMINATION:
        sig = getattr(signal, name)
        if agents is not None and signal.getsignal(sig) is agents:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                          else signal.SIG_DFL)
            restored.append(name)
    return restored


def watch_first_step(env: os._Environ[str] | dict[str, str]) -> None:
    """Writes `first_step` to the run's event log at this process' first optimizer step
    (`torch.optim`'s global post-step hook: every optimizer, no change to the script). Nothing
    when the job is not supervised (no run folder)."""
    run_dir = env.get(RUN_DIR_ENV)
    if not run_dir:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from hvd_resilient.events import EventLog

    done: list[bool] = []  # the hook stays registered: removing it while torch iterates its hooks
    # (inside the step that calls it) raises "OrderedDict mutated during iteration"

    def first_step(*_args: Any) -> None:
        if done:
            return
        done.append(True)
        try:
            rank, size = int(os.environ.get("RANK", "-1")), int(os.environ.get("WORLD_SIZE", "0"))
            EventLog(os.path.join(run_dir, "events.jsonl"), rank=rank, size=size).emit(
                ev.FIRST_STEP, restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                round=round_of(os.environ), pid=os.getpid())
        except OSError as e:  # evidence, not training: never fail the step for it
            print(f"hvd-resilient: could not record the first step: {e}", file=sys.stderr)

    register_optimizer_step_post_hook(first_step)


def prepare_worker() -> None:
    """Everything above, in the worker, before the script."""
    restore_default_signals()
    apply_round_store()
    watch_first_step(os.environ)


def prepare_forked_child(script_dir: str, agent: int) -> None:
    """`os.register_at_fork(after_in_child=...)` of the agent: each forked worker, before
    torch's `_wrap` sets its environment and runs the script. ``script_dir`` goes first on
    sys.path, as `python script.py` puts it (torchrun's `run_script_path` does not). A fork
    inherits the hook: processes the worker forks in turn (DataLoader workers) are no
    children of ``agent`` and are left alone."""
    if os.getppid() != agent:
        return
    prepare_worker()
    if script_dir and (not sys.path or sys.path[0] != script_dir):
        sys.path.insert(0, script_dir)


def main(argv: list[str] | None = None) -> None:
    """`python -m hvd_resilient.launch.torchrun_worker SCRIPT ARGS...` or `... -m MODULE
    ARGS...`: prepares this worker, then runs the script as `python` would (sys.argv,
    sys.path[0], `__main__`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m hvd_resilient.launch.torchrun_worker "
                         "SCRIPT [ARGS...] | -m MODULE [ARGS...]")
    prepare_worker()
    if args[0] == "-m" and len(args) > 1:
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(args[0])
    sys.argv = [args[0], *args[1:]]
    sys.path[0] = os.path.dirname(script)  # `-m` put the working folder there
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
