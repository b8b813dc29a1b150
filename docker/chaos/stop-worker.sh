#!/usr/bin/env bash
# A worker stops (`docker compose stop`: SIGTERM, SIGKILL after 10 s) and is started again.
# Expected: the survivors reset to a smaller world; once the worker answers again and its
# blacklist cooldown (10-30 s) is over, a reset back to the full world.
#   docker/chaos/stop-worker.sh [SERVICE]      (default worker-2)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

svc="${1:-worker-2}"
require_running
full="$(full_size)"
n="$(event_count)"
say "docker compose stop $svc"
dc stop "$svc"
wait_event reset "$n" "$(size_is $((full - 1)))"
n="$(event_count)"
say "docker compose start $svc"
dc start "$svc"
wait_event reset "$n" "$(size_is "$full")"
report
