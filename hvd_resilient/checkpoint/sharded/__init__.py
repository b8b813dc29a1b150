"""Sharded (FSDP) checkpoints through torch.distributed.checkpoint: every rank saves its own
shards, rank 0 the manifest; resumes reshard. Imports torch.distributed, so the checkpoint
package never imports this room itself."""
