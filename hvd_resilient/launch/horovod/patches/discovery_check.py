"""The discovery script's output, checked: a line Horovod would misread is refused.

Horovod would make a host named `hello world`, or die with a traceback on `localhost:lots`.
Its parsing is replaced by `parse_discovery_output`: a bad first answer stops the job with one
line naming the line (there is nothing to fall back on); a bad answer during the run keeps the
last good host list in force, with a warning and a `discovery_invalid` event, once per
distinct answer (the script runs every second). The script's non-zero exits stay Horovod's: a
warning, hosts kept.

The script is run here as a plain child process. Horovod runs it through `safe_shell_exec`,
which first spawns a fresh Python interpreter as a middleman (and that re-imports the driver's
main module): measured 1.2-2.2 s a poll with four workers training on two cores, for a script
that takes 0.12 s, so the driver looked every 2.2-3.2 s instead of every second, and a removed
host was acted on 3.1 s after the file changed (1.0 s when measured first). It also cost the
machine an interpreter start every second.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.backends.horovod import compat
from hvd_resilient.launch.horovod.patches.context import PatchContext, PerObject, masked_line

logger = logging.getLogger(__name__)


@dataclass
class Answers:
    """What the check remembers of one discovery object's answers."""

    good: dict[str, int] | None = None
    """The last usable host list (None: none yet, so a bad answer stops the job)."""
    bad: str | None = None
    """The error of the bad answer last warned about (each distinct one is warned once)."""


def checked_find(ctx: PatchContext) -> Callable[[Any], dict[str, int]]:
    """`HostDiscoveryScript.find_available_hosts_and_slots`, checked; `self` is the discovery
    object (it runs the script); the last good answer of each is kept here (`Answers`)."""
    from hvd_resilient.discovery.validate import DiscoveryOutputError, parse_discovery_output

    answers: PerObject[Answers] = PerObject(Answers)

    def find_available_hosts_and_slots(self: Any) -> dict[str, int]:
        text = self._execute_discovery_script()
        seen = answers.of(self)
        script = self._discovery_script
        try:
            hosts = parse_discovery_output(text, default_slots=self._default_slots or 1)
        except DiscoveryOutputError as e:
            if seen.good is None:  # the first answer: nothing to fall back on
                ctx.discovery_error = masked_line(f"discovery script {script} printed {e}")
                raise RuntimeError(ctx.discovery_error) from None
            if seen.bad != str(e):  # once per distinct bad answer, not every second
                seen.bad = str(e)
                logger.warning("discovery script %s printed %s; keeping the last good host "
                               "list %s", script, e, hosts_arg(seen.good))
                ctx.emit(ev.DISCOVERY_INVALID, script=script, error=str(e),
                         kept=hosts_arg(seen.good))
            return dict(seen.good)
        seen.good, seen.bad = hosts, None
        return hosts

    return find_available_hosts_and_slots


SCRIPT_TIMEOUT_S = 60.0
"""A script that has not answered by then is ended (its whole process group) and counts as
failed: Horovod's own run of it would block the discovery thread for good."""


def run_script(self: Any) -> str:
    """`HostDiscoveryScript._execute_discovery_script`: the script's stdout; its stderr goes
    to the driver's, as Horovod's does; raises RuntimeError as Horovod's does."""
    script = self._discovery_script
    proc = subprocess.Popen(script, shell=True, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may just have ended
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"Failed to execute discovery script: {script}. No answer within "
                           f"{SCRIPT_TIMEOUT_S:.0f}s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"Failed to execute discovery script: {script}. Exit code: "
                           f"{proc.returncode}")
    return out


def hosts_arg(hosts: dict[str, int]) -> str:
    return ",".join(f"{h}:{n}" for h, n in sorted(hosts.items())) or "(none)"


def install(ctx: PatchContext) -> None:
    from horovod.runner.elastic import discovery

    compat.replace(discovery.HostDiscoveryScript, "find_available_hosts_and_slots",
                   checked_find(ctx))
    compat.replace(discovery.HostDiscoveryScript, "_execute_discovery_script", run_script)
