"""Host discovery for ``horovodrun --host-discovery-script``.

Each module parses one source of truth and shares the same contract (see
``docs/discovery.md``): print ``hostname:slots`` lines, sorted, nothing else on stdout;
exit 2 with one stderr line on bad input, 1 when the source cannot be reached (unless a
recent cached answer can be printed instead); answer within about 2 s.

Scripts (top-level ``discovery/<name>`` executables call ``main()`` of):

* ``hostfile``    -- a file operators edit while the job runs
* ``slurm``       -- the current Slurm allocation
* ``kubernetes``  -- Running, Ready pods matching a label selector
* ``aws``         -- InService instances of an EC2 Auto Scaling group (``aws-asg``)
* ``health``      -- a filter dropping hosts whose ssh port does not answer

This package imports only the standard library (boto3 lazily, for ``aws``), so that a
discovery run starts in well under its time budget; keep it that way.
"""

from __future__ import annotations

from .errors import DeadlineExceeded, DiscoveryError, TransientDiscoveryError
from .output import HostSlots, format_hosts
from .validate import parse_slots, validate_hostname

__all__ = [
    "DeadlineExceeded",
    "DiscoveryError",
    "HostSlots",
    "TransientDiscoveryError",
    "format_hosts",
    "parse_slots",
    "validate_hostname",
]
