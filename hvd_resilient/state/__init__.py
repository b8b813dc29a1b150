"""What survives a failure, whatever the backend: the shared core of a training state (the
checkpoint dict, hooks, the parameter digest), the exact-once sampler, every rank's random
streams. The backend-specific states live with their backend (backends/horovod/state.py,
backends/torchrun/state.py, backends/inplace/state.py); `hvd_resilient.ElasticState` is
Horovod's, imported when used.
"""
