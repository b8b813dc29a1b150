"""The two ways a discovery script can fail, and why they must stay apart.

horovodrun calls a discovery script every second and treats a non-zero exit after the first
success as a warning (it keeps the hosts it has).  So the only question a failure has to
answer is whether a cached answer may stand in for a fresh one:

* ``DiscoveryError``: the input or configuration is wrong (a bad line in a hostfile, a
  hostname with a ``;`` in it, a 403 from the Kubernetes API).  Re-running will not help
  and a cached answer would hide the mistake from the operator: exit 2, never use the cache.
* ``TransientDiscoveryError``: the source of truth could not be reached in time (API down,
  throttled, timed out).  The last good answer may be printed instead, with a note.

``DeadlineExceeded`` derives from ``BaseException`` on purpose: it is raised from a signal
handler in the middle of library code (urllib, botocore) whose ``except Exception`` retry
loops would otherwise swallow it and keep the script running past Horovod's patience.
"""

from __future__ import annotations

#: Exit status for bad input or configuration (argparse uses the same number).
EXIT_INVALID = 2
#: Exit status when the source of truth could not be reached and no cached answer was usable.
EXIT_TRANSIENT = 1


class DiscoveryError(Exception):
    """Bad input or configuration; the message says what is wrong and what to do."""


class TransientDiscoveryError(Exception):
    """The source could not be reached or did not answer in time; a retry may succeed."""


class DeadlineExceeded(BaseException):
    """The script ran out of its time budget (see ``watchdog.Deadline``)."""
