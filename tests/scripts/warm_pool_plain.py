"""A warm pool whose workers run their command at once (no standby protocol, no imports):
the pool's own behaviour, tested without a Horovod driver. `python warm_pool_plain.py SOCKET`."""

from __future__ import annotations

import logging
import signal
import sys

from hvd_resilient.launch.warm import standby
from hvd_resilient.launch.warm.pool_server import Pool

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)  # as the real pool: the workers must not inherit it
    pool = Pool(sys.argv[1], run=standby.run_in_process)
    signal.signal(signal.SIGTERM, pool.stop)
    print("listening", flush=True)
    pool.serve()
