"""`horovodrun`, taught what `patches/` lists: `python -m hvd_resilient.launch.horovod.driver ARGS`.

Takes exactly `horovodrun`'s arguments and runs Horovod's own launcher in this process, after
reading the switches once (`options.DriverOptions`: the variables of the switches
`options.DriverSwitches` declares, HVD_RESILIENT_SLOT_HOSTS, HVD_RESILIENT_STANDBY,
HVD_RESILIENT_WARM_POOL, HVD_RESILIENT_DISCOVERY_INTERVAL and _WATCH, each also a flag of
`hvd-resilient run`; the run folder; the ssh settings) and installing the patch families in
their one order (`patches.ORDER`): the discovery interval, the discovery output checked, the
watched hosts file, slot hosts, the fatal stop, standby workers, and the eviction of slots
their peers found silent.

What is left here is the launcher's last word: one line instead of its traceback, and
nothing at all when a worker stopped on a fatal error (that worker recorded it;
`hvd-resilient run` prints it once). An error of ours before the launch (an untested Horovod,
a bad switch) is a `LaunchError`, printed as one line with its exit code.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable

from hvd_resilient.backends.horovod import compat, driver_watch
from hvd_resilient.errors import FATAL_EXIT_CODE, PREEMPTED_EXIT_CODE, LaunchError
from hvd_resilient.fatal_events import EVENTS_FILE, fatal_events
from hvd_resilient.launch.horovod import patches
from hvd_resilient.launch.horovod.options import DriverOptions
from hvd_resilient.launch.horovod.patches.context import PatchContext, masked_line

logger = logging.getLogger("hvd_resilient.launch.horovod.driver")  # not __name__: run as __main__

# Each middleman forked from the forkserver (`patches/fast_middleman.py`, which preloads this
# module) runs this module again as `__mp_main__`, as multiprocessing does for a `-m` parent,
# and runpy warned about it once a worker launch in the job's output ("found in sys.modules
# after import of package"). Harmless (nothing runs under `__mp_main__`); the forks inherit
# this filter from the forkserver, which ran this line when it preloaded the module.
warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy",
                        message=r"'hvd_resilient\.launch\.horovod\.driver' found in sys\.modules")


def prepare(argv: list[str]) -> PatchContext:
    """Checks Horovod, reads the switches and patches the launcher; raises LaunchError."""
    # Before any patch: an untested Horovod stops here, not minutes into the job.
    compat.check_compatible(driver=True)
    ctx = PatchContext(DriverOptions.read(argv=argv))
    patches.install(ctx)
    me = driver_watch.identity()
    if me:  # this machine's workers find this process gone in /proc, not after five probes
        os.environ[driver_watch.DRIVER_ENV] = me
    threading.excepthook = thread_excepthook(ctx)
    return ctx


def thread_excepthook(ctx: PatchContext) -> Callable[[threading.ExceptHookArgs], None]:
    """A launcher thread that ends in an exception: one line instead of a traceback. The
    discovery thread's failure on its first call is only noted: `launch` prints it as the
    cause of Horovod's "Job has been shutdown, see above"."""
    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        line = masked_line(args.exc_value or args.exc_type.__name__)
        ctx.thread_errors.append(line)
        name = getattr(args.thread, "name", "?")
        logger.debug("launcher thread %s ended", name, exc_info=args.exc_value)
        if line != ctx.discovery_error:
            print(f"hvd-resilient: launcher thread {name}: {line}", file=sys.stderr,
                  flush=True)

    return hook


def _fatal_recorded(ctx: PatchContext, since: float) -> bool:
    """A worker recorded a `fatal` event in the run's event log since this launcher started."""
    run_dir = ctx.options.run_dir
    return bool(run_dir) and bool(fatal_events(os.path.join(run_dir, EVENTS_FILE), since))


def launch(argv: list[str], ctx: PatchContext, since: float) -> int:
    """Runs Horovod's launcher on `argv`; returns the exit code, having printed at most one
    line."""
    from horovod.runner.launch import run_commandline

    sys.argv = ["horovodrun", *argv]
    try:
        run_commandline()
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if ctx.stopped_by:
            return _stopped(ctx, masked_line(e))
        if ctx.fatal or _fatal_recorded(ctx, since):
            # The worker said why (in the event log under `hvd-resilient run`, else on its
            # stderr); Horovod's "processes exited with non-zero status" adds nothing.
            return FATAL_EXIT_CODE
        reason = masked_line(e)
        if re.search(rf"Exit code: {FATAL_EXIT_CODE}\b", reason):
            return FATAL_EXIT_CODE  # static horovodrun: a worker stopped on a fatal error
        if reason.startswith("Job has been shutdown") and ctx.thread_errors:
            reason = ctx.thread_errors[0]  # the cause, which Horovod only says "see above" of
        print(f"hvd-resilient: launcher: {reason}", file=sys.stderr, flush=True)
        return 1
    return _stopped(ctx, "") if ctx.stopped_by else 0


def _stopped(ctx: PatchContext, reason: str) -> int:
    """The exit of a job stopped by a signal (`patches/stop_signal.py`): 75 when the workers
    stopped at a final checkpoint, else 128 + the signal's number. A 0 among them counts as
    clean: Horovod's middleman can report 0 for a worker it ended (it reaps its shell twice,
    and `Popen.wait` says 0 when the other reap wins)."""
    # elastic: every exit the driver saw after the signal; static (no driver): the first
    # non-zero exit, all Horovod's error names
    exits = ctx.exits_after_stop or [int(c) for c in re.findall(r"Exit code: (\d+)", reason)]
    if PREEMPTED_EXIT_CODE in exits and all(code in (0, PREEMPTED_EXIT_CODE) for code in exits):
        print(f"hvd-resilient: launcher: stopped by {ctx.stopped_by}; every worker stopped at "
              "a final checkpoint", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    print(f"hvd-resilient: launcher: stopped by {ctx.stopped_by}; the workers were ended "
          f"(exit codes {sorted(set(exits))}) and none restarted", file=sys.stderr, flush=True)
    return 128 + int(signal.Signals[ctx.stopped_by])


def main(argv: list[str] | None = None) -> None:
    from hvd_resilient.masking import install_log_scrubber

    install_log_scrubber()
    since = time.time()
    args = sys.argv[1:] if argv is None else argv
    try:
        ctx = prepare(args)
    except LaunchError as e:
        print(f"hvd-resilient: launcher: {masked_line(e)}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    sys.exit(launch(args, ctx, since))


if __name__ == "__main__":
    main()
