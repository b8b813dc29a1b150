"""In-place recovery on plain torch.distributed: survivors keep their processes.

A membership is a *generation*: its own process group over its own store prefix. The agent
(`launch/inplace_agent.py`) starts the workers, hosts the store (never a training rank) and is
the one authority on membership: it sees a worker die (waitpid), ends one its peers found
silent, and publishes the next generation. On a fault the survivors give their collectives up
(the hang-up reaches every peer at once), drop the old group locally, restore their last
in-memory commit, form the next generation's group and go on after a verified sync: nothing
is restarted, nothing reloaded from a store.

What is not the generations' own (the collectives, the state's and the world's base, FSDP2)
is the torch.distributed base's, `backends.torchdist`.
"""
