"""The data path: which samples a rank trains on at each step, and how they are loaded ahead of
it. `loader` drives a torch DataLoader (worker processes, prefetch, pinning) with the order of
the elastic samplers in `hvd_resilient.state.sampler`, and throws away what it prefetched when a
reset or a resize changes that order; `shards` writes and streams webdataset tar shards from a
file:// or s3:// location, fetched ahead in the background. What survives a failure is the
sampler's position, never the loader's: the loader is rebuilt from it.

Below the trainer, above the state and the stores; docs/data.md tells the design and its limits.
"""
