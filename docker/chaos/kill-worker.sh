#!/usr/bin/env bash
# A worker is killed outright (`docker kill`, SIGKILL: no goodbye on any socket) and restarted.
# Expected: failure_detected, restore of the last commit, reset to a smaller world; later a
# reset back to the full world.
#   docker/chaos/kill-worker.sh [SERVICE]      (default worker-1)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

svc="${1:-worker-1}"
require_running
full="$(full_size)"
n="$(event_count)"
container="$(dc ps -q "$svc")"
[ -n "$container" ] || fail "$svc is not running"
say "docker kill $container ($svc)"
docker kill "$container" >/dev/null
wait_event failure_detected "$n"
wait_event restore "$n"
wait_event reset "$n" "$(size_is $((full - 1)))"
n="$(event_count)"
say "docker compose start $svc"
dc start "$svc"
wait_event reset "$n" "$(size_is "$full")"
report
