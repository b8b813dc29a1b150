"""What a running job says about itself while it runs, beyond its event log.

`stragglers`: every rank times its steps (compute, and the wait inside the collectives); one
small exchange per window of steps finds a rank that is persistently slower than the others,
reports it (a `straggler` event, a warning on rank 0) and, only when asked to, evicts it.
`metrics`: a Prometheus endpoint on rank 0 (step, throughput, world size, failures by class,
recovery times, checkpoint ages, goodput, stragglers). `observer`: the one object the trainer
holds and calls (`waited`, `step_end`, `close`).

Above the backends (it calls the one it is handed, never imports one); below the trainer.
prometheus_client is imported only when the endpoint is switched on.
"""

from hvd_resilient.observability.observer import Observer

__all__ = ["Observer"]
