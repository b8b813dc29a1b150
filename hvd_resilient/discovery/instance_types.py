"""GPUs per EC2 instance type, the default slot count of ``discovery/aws-asg``.

Only types that people train on; anything else falls back to ``--slots`` (default 1) so a
CPU fleet gets one worker per instance unless told otherwise.  A per-instance tag
(``--slots-tag``) or ``--slots`` always wins over this table.
"""

from __future__ import annotations

_ONE_GPU_SIZES = ("xlarge", "2xlarge", "4xlarge", "8xlarge", "16xlarge")

GPUS_PER_INSTANCE_TYPE: dict[str, int] = {
    "p3.2xlarge": 1, "p3.8xlarge": 4, "p3.16xlarge": 8, "p3dn.24xlarge": 8,
    "p4d.24xlarge": 8, "p4de.24xlarge": 8,
    "p5.48xlarge": 8, "p5e.48xlarge": 8, "p5en.48xlarge": 8,
    "g4dn.12xlarge": 4, "g4dn.metal": 8,
    "g5.12xlarge": 4, "g5.24xlarge": 4, "g5.48xlarge": 8,
    "g6.12xlarge": 4, "g6.24xlarge": 4, "g6.48xlarge": 8,
    "g6e.12xlarge": 4, "g6e.24xlarge": 4, "g6e.48xlarge": 8,
    **{f"{family}.{size}": 1 for family in ("g4dn", "g5", "g6", "g6e")
       for size in _ONE_GPU_SIZES},
}


def gpus_for(instance_type: str) -> int | None:
    """GPUs of ``instance_type``, or ``None`` if the table does not know it."""
    return GPUS_PER_INSTANCE_TYPE.get(instance_type)
