"""Every slot its own host, so that one dead worker costs one slot, not the whole host.

Horovod Elastic blacklists the HOST of a failed worker. On one machine with N workers (the common
8-GPU box) that is every slot, and the job ends. Splitting `host:N` into N one-slot hosts named
`host+0` ... `host+N-1` makes the blacklist, its cooldown and the refill work per slot: the
survivors go on at N-1 at once, and the slot comes back after the cooldown. `+` cannot occur in
a real host name, so the split is unambiguous; wherever a name reaches the network (address
lookup, ssh) the real host is used.

What changes for the workers: each one sees `hvd.local_size() == 1` and `hvd.local_rank() == 0`;
the slot index on its machine is `local_rank()` here (used for GPU pinning).
"""

from __future__ import annotations

import os

SEP = "+"


def split(host_slots: dict[str, int]) -> dict[str, int]:
    return {f"{h}{SEP}{i}": 1 for h, n in host_slots.items() for i in range(n)}


def real_host(name: str) -> str:
    return name.split(SEP, 1)[0]


def local_rank(env: dict[str, str] | os._Environ[str] = os.environ) -> int | None:
    """This worker's slot on its machine when launched with slot hosts, else None."""
    name = env.get("HOROVOD_HOSTNAME", "")
    if SEP not in name:
        return None
    try:
        return int(name.rsplit(SEP, 1)[1])
    except ValueError:
        return None


def machine(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The real host this worker runs on (its slot host's machine; the local name outside a
    launcher), for counting the workers that share its cores."""
    import socket

    return real_host(env.get("HOROVOD_HOSTNAME") or socket.gethostname())
