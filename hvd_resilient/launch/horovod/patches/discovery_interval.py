"""How often Horovod runs the discovery script.

Horovod polls it every second, and that poll is most of what a scale change waits for;
HVD_RESILIENT_DISCOVERY_INTERVAL=0.25 polls faster, at the cost of running the script that
much more often. The value is checked where it is read (`options.py`) and applied here.
"""

from __future__ import annotations

from hvd_resilient.backends.horovod import compat
from hvd_resilient.launch.horovod.patches.context import PatchContext


def install(ctx: PatchContext) -> None:
    from horovod.runner.elastic import driver

    compat.replace(driver, "DISCOVER_HOSTS_FREQUENCY_SECS", ctx.options.discovery_interval_s)
