"""Warm starts: workers that begin with their imports done, whichever launcher starts them.

A worker's cold start is mostly imports (torch, torch._dynamo, Horovod, the script's own
libraries), and every launcher pays it where it hurts: a slot that joins a Horovod job, every
rank of a relaunched mpirun job, every worker of a restarted torchrun round. One room for what
hides it:

- `imports`: what a training script will import, read from its syntax tree and imported ahead
  by a process that forks workers;
- `pool` (the launch side, standard library only) and `pool_server` (the pool itself, and the
  one `hvd-resilient run` holds across launches): a process per machine that did those imports
  once and forks a worker for each launch that asks;
- `standby`: a Horovod worker started ahead of the reset, forked from the pool where one serves
  the machine;
- `mpirun`: the stand-in through which mpirun starts each rank, forked from the same pool;
- `torchrun`: torchrun whose workers are forked from its agent with the imports done.

Nothing is imported here: `pool` is on the launch path of every standby and rank, where each
import costs the time this room exists to save.
"""
