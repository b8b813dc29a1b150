"""The torch.distributed base under the torchrun and in-place backends: what a backend over
plain torch.distributed does the same way whoever launched its processes.

- `backend`: `TorchDistBackend`, the base class (the gather, the any-rank flag and the release
  of the process groups, written once; FSDP declared supported);
- `world`: `TorchDistWorld`, the half of a `recovery.World` both answer the same way (rank,
  size, machine, the allgather);
- `state`: `TorchDistState`, the components and counters of a state on torch.distributed;
- `collectives`: the collectives a verified sync needs (`state.agreement.Collectives`);
- `fsdp`: FSDP2 sharding, its state dicts, and `ShardedHolder`, the interface of a model that
  holds its sharded module instead of being it.

`backends.torchrun` adds what is specific to a torchrun-launched process (its rendezvous
store, DDP, a world formed once), `backends.inplace` the generations under the in-place agent.
Nothing here imports either of them.
"""
