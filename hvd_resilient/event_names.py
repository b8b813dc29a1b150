"""The catalogue of event names: every `event` a line of `events.jsonl` can carry, declared once.

The event log is a contract with many readers (the report, the supervisor, the planner's
calibration, the Prometheus metrics, the benchmarks) and many writers (ranks, the Horovod
driver, the supervisor, background threads). A name spelled as a literal in each of them drifts
silently: a typo in a writer is an event no reader ever sees, a rename in one reader is a
section of the report that goes empty. So writers and readers import the names from here, and
`tests/unit/test_event_catalogue.py` fails when code emits a name that is not a constant of this
module, or when a name here is emitted nowhere.

Each constant's docstring says who writes the event and the fields it writes besides the fixed
keys every event has (`ts`, `event`, `rank`, `size`, `step`: `events.RESERVED`; and
`lease_epoch` under `hvd-resilient run`). The values are the on-disk strings: changing one breaks
every log already written, so a rename is a new name plus a reader that accepts both.

This module is the bottom layer: it imports nothing of the project, so that anything (the
checkpoint package, the launcher, the report) can import it without pulling the rest in.
"""

from __future__ import annotations

# -- a job's life -------------------------------------------------------------------------------

START = "start"
"""Each rank as its job starts (trainer, ported Horovod loop, in-place adapter): `pid`, `host`,
`backend`, `run_id`; the trainer also `config`, `warm`; a ported loop `loop` ("custom"),
`config` (None), `warm`; the in-place adapter `adapter`, `reconfigure`."""

FIRST_STEP = "first_step"
"""A torchrun worker's first optimizer step (`restart`, `round`, `pid`), or an in-place DDP
rank's first step of a generation (`generation`, `pid`): the supervisor's evidence that ranks
trained when no `start` came."""

PROGRESS = "progress"
"""Rank 0 every log interval: `epoch`, `loss`, `samples_per_s` and the memory sample
(`rss_bytes`, and `cuda_allocated_bytes`, `cuda_reserved_bytes` on a GPU)."""

MEMORY = "memory"
"""Every rank at each progress interval and after each reset (`at`: "reset"): `rss_bytes`, and
the CUDA byte counts on a GPU."""

MEMORY_GROWTH = "memory_growth"
"""A rank whose memory kept growing across resets: `warning`."""

EPOCH_END = "epoch_end"
"""Rank 0 at each epoch's end: `epoch`, `samples`, `ids_digest`, `expected_samples`,
`expected_ids_digest`, `digest` (the method); the report's exactly-once check."""

DONE = "done"
"""Rank 0 when training finished: `params_sha256`, `digests`; the trainer and a ported loop
also `epoch`, `loss` (a ported loop `step_unit`); the in-place DDP adapter `seconds`."""

PREEMPTED = "preempted"
"""A rank that stopped on a preemption notice after its last checkpoint: `seconds`,
`exit_code`."""

FATAL = "fatal"
"""A process that gives up: `error`, `restartable`; through `fatal_events.record_fatal` also
`pid`, `rank_source`. The supervisor and the driver read it to decide on a restart."""

# -- commits, rollbacks and resumes -------------------------------------------------------------

COMMIT = "commit"
"""Rank 0 at each in-memory commit: `seconds`; a ported loop whose steps are commits also
`step_unit` ("commit")."""

RESTORE = "restore"
"""Rank 0 after rolling back to the last commit: `from_step`, `to_step`, `lost_steps`."""

RESUME = "resume"
"""Rank 0 after loading a checkpoint at start: `from_step`, `epoch`, `saved_world_size`,
`layout`, `source` ("durable" or the memory tier's), `durable_step`, `seconds`; optionally
`fetched_by`, `digests`."""

SYNC = "sync"
"""Rank 0 after the new world synchronized its state following a reset: `seconds`."""

SYNC_CHECK = "sync_check"
"""Rank 0 after checking that every rank holds the same state: `sent`, `differing_ranks`,
`repaired`, `seconds`, `digest_seconds`."""

SYNC_MISMATCH = "sync_mismatch"
"""Rank 0 when ranks held different state after a sync: `components`."""

# -- failures and recoveries --------------------------------------------------------------------

FAILURE_DETECTED = "failure_detected"
"""A rank that caught a failed collective: `error`, `peer_hangup`, `generation`,
`detect_seconds`."""

RESET = "reset"
"""Rank 0 of the new world after an in-memory recovery: `old_size`, `new_size`, `generation`,
`seconds`, `shutdown_s`, `init_s`, `state_s`, `joined`, `threads`, `fds`, `rss_bytes`."""

WATCH = "watch"
"""Rank 0 when the detectors are armed for a world: `connections`, `heartbeats`, `threads`,
`generation`."""

HOSTS_CHANGED = "hosts_changed"
"""Rank 0 when Horovod reported new or removed hosts: `removed_only`."""

LEFT_JOB = "left_job"
"""A rank that leaves the job (its slot was removed): `slot`."""

JOINED = "joined"
"""A new member admitted by the in-place backend: `member`, `generation`, `ready_at`,
`waited_s`."""

HANG_DETECTED = "hang_detected"
"""The progress watchdog of a rank that made no progress within its budget: `section`,
`idle_seconds`, `budget_seconds`, `stacks`, `exit_code`, `waiting_on`, `cause`."""

PEER_SILENT = "peer_silent"
"""A rank whose peers' heartbeats stopped: `ranks`, `slots`, `silent_seconds`."""

PEER_EXITED = "peer_exited"
"""A rank that saw peers' processes exit: `ranks`, `pids`."""

DRIVER_LOST = "driver_lost"
"""A rank that lost the Horovod driver: `driver`, `found_by`."""

STALE_SAMPLER = "stale_sampler"
"""A ported loop's rank still holding a sampler built for an older world: `cause`."""

DDP_REBOUND = "ddp_rebound"
"""The in-place adapter after rebinding DDP to a new generation: `generation`, `models`,
`samplers`."""

STANDBY_WAIT = "standby_wait"
"""A Horovod rank that waited for standby slots: `seconds`."""

# -- stragglers ---------------------------------------------------------------------------------

STEP_TIMES = "step_times"
"""Rank 0 once per straggler window: `window_steps`, `judged`, `steps`, `compute_seconds`,
`wait_seconds`, `ratios`, `stragglers`."""

STRAGGLER = "straggler"
"""The slow rank itself when reported: `host`, `pid`, `ratio`, `compute_seconds`,
`others_seconds`, `wait_seconds`, `windows`, `window_steps`, `threshold`."""

STRAGGLER_CLEARED = "straggler_cleared"
"""A reported rank that kept pace again: `host`, `pid`, `ratio`."""

STRAGGLER_EVICTED = "straggler_evicted"
"""The straggler right before it exits (eviction on): `host`, `pid`, `ratio`, `exit_code`."""

# -- durable checkpoints ------------------------------------------------------------------------

CHECKPOINT_SAVED = "checkpoint_saved"
"""The checkpoint writer (rank 0) once a checkpoint is published: `ckpt_step`, `epoch`,
`seconds`, `stall_seconds`, `bytes`, `url`; whole-state also `serialize_seconds`,
`upload_seconds`; sharded also `layout`, `shards`."""

CHECKPOINT_FAILED = "checkpoint_failed"
"""The checkpoint writer when a save failed: `ckpt_step`, `error`."""

CHECKPOINT_SKIPPED = "checkpoint_skipped"
"""A reader that passed over a corrupt checkpoint: `ckpt_step`, `reason`, `url`; the memory
tier a commit it could not use: `tier`, `ckpt_step`, `reason`."""

CHECKPOINT_SUPERSEDED = "checkpoint_superseded"
"""The writer when a newer save replaced one not yet uploaded: `ckpt_step`, `by_step`."""

CHECKPOINT_FENCED = "checkpoint_fenced"
"""The writer when the store refused a publish from an older lease: `ckpt_step`, `epoch`,
`fence`."""

CHECKPOINT_ALREADY_PUBLISHED = "checkpoint_already_published"
"""The writer when the step was published already (by an earlier job): `ckpt_step`, `url`."""

# -- the memory tier ----------------------------------------------------------------------------

MEMORY_TIER = "memory_tier"
"""Rank 0 when the in-memory checkpoint tier is turned on or off: `enabled`, `reason`."""

MEMORY_TIER_FULL = "memory_tier_full"
"""The memory tier when a copy does not fit: `reason`."""

MEMORY_COMMIT = "memory_commit"
"""The memory tier after copying a commit to a peer: `ckpt_step`, `bytes`, `stall_seconds`,
`seconds`."""

MEMORY_COMMIT_FAILED = "memory_commit_failed"
"""The memory tier when a copy failed: `ckpt_step`, `error`."""

MEMORY_PUSH_FAILED = "memory_push_failed"
"""The sharded memory tier when pushing a shard to its peer failed: `ckpt_step`, `error`."""

# -- data ---------------------------------------------------------------------------------------

BAD_SAMPLE = "bad_sample"
"""The loader after skipping unreadable samples: `count`, `action`, `skipped_total`,
`samples`."""

BAD_SHARD = "bad_shard"
"""The shard reader after giving up on a shard: `shard`, `error`."""

LOADER_WORKER_LOST = "loader_worker_lost"
"""The loader when one of its worker processes died: `error`, `losses`, `redo_batches`."""

# -- the supervisor (`hvd-resilient run`) and its lease -----------------------------------------

LAUNCH = "launch"
"""The supervisor as it starts the launcher: `attempt`, `command`."""

LAUNCHER_EXIT = "launcher_exit"
"""The supervisor when the launcher exited: `attempt`, `exit_code`."""

RESTART = "restart"
"""The supervisor before a full restart: `attempt`, `delay`, `exit_code`, `preempted`,
`evidence`."""

LEASE_TAKEN = "lease_taken"
"""The supervisor after taking the run's lease: `holder`."""

LEASE_LOST = "lease_lost"
"""The supervisor or a rank that lost the run's lease: `error`."""

JOB_ENDED_WITH_SUPERVISOR = "job_ended_with_supervisor"
"""The job guard after ending the job's processes with their supervisor: `processes`,
`seconds`."""

# -- the Horovod driver's patches ---------------------------------------------------------------

STOP_SIGNAL = "stop_signal"
"""The driver when it received a stop signal: `signal`."""

DISCOVERY_INVALID = "discovery_invalid"
"""The driver when the host discovery script's output was refused: `script`, `error`,
`kept`."""

SLOT_EVICTED = "slot_evicted"
"""The driver after evicting a slot's worker: `slot`, `pid`, `how`."""

ORPHAN_SLOTS_STARTED = "orphan_slots_started"
"""The driver after starting workers on slots left without one: `slots`."""

STANDBY_STARTED = "standby_started"
"""The driver after starting standby workers: `slots`."""

STANDBY_RELEASED = "standby_released"
"""The driver after releasing standby workers into the job: `slots`, `waited_s`,
`replaced`."""

WARM_POOL_READY = "warm_pool_ready"
"""The driver when its warm pool is ready: `seconds`; `held_by` when it was held."""


ALL: frozenset[str] = frozenset(
    v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str)
)
"""Every event name above (the unit test holds the list to the emitters)."""
