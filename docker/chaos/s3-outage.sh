#!/usr/bin/env bash
# The checkpoint store goes away (`docker compose stop seaweedfs`) and comes back.
# Expected: training goes on (commits continue), checkpoint writes fail and are logged
# (checkpoint_failed), and once the store is back a checkpoint is saved again.
# Needs a checkpoint attempt during the outage: CHECKPOINT_EVERY small enough (default 100).
#   docker/chaos/s3-outage.sh [SECONDS]        (outage length, default 60)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

outage="${1:-60}"
require_running
n="$(event_count)"
say "docker compose stop seaweedfs (for ${outage}s)"
dc stop seaweedfs
wait_event checkpoint_failed "$n"
wait_event commit "$n"
sleep "$outage"
n="$(event_count)"
say "docker compose start seaweedfs"
dc start seaweedfs
wait_event checkpoint_saved "$n"
report
