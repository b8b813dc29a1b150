"""`hvd-resilient report`: reads a run folder's event log and tells what the run went through.

Layers, each usable alone: `timeline` (launches, recovery episodes, restarts), `checkpoints`
(checkpoint costs, work at risk, Young/Daly), `data` (exactly-once data use, from the
`epoch_end` events), `analysis` (goodput, failures and MTTR, the whole `Report`; like those
before it, pure functions of the events), `text` and `plot` (render a `Report`), `cli` (the
command). Only `plot` needs matplotlib, and imports it lazily.
"""

from hvd_resilient.report.analysis import Report, analyze
from hvd_resilient.report.checkpoints import daly_interval, young_interval

__all__ = ["Report", "analyze", "daly_interval", "young_interval"]
