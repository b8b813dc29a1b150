"""`python -m hvd_resilient.report RUN_FOLDER`: the same as `hvd-resilient report`."""

import sys

from hvd_resilient.report.cli import main

sys.exit(main(sys.argv[1:]))
