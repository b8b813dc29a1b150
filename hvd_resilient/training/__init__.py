"""The training loop and the policies around it: the trainer, when and how durable checkpoints
and memory-tier commits are written and resumed (one base each, whose public methods own the
guards, bounds, events and logging; the sharded forms fill in the hooks), fault injection for
tests and benchmarks (faults, and fault_hooks where a fault fires outside a step), memory
watching. Above the backends and the state; below launch."""
