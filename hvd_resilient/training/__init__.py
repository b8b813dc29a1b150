"""The training loop and the policies around it: the trainer, when and how durable checkpoints
are written and resumed (one base, replicated and sharded fill in the hooks), fault injection
for tests and benchmarks, memory watching. Above the backends and the state; below launch."""
