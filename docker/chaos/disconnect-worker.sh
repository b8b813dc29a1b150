#!/usr/bin/env bash
# A worker loses the network (`docker network disconnect`) while its processes keep running,
# then is connected again. Expected: reset to a smaller world (collectives time out after
# --gloo-timeout-seconds; discovery's ssh probe drops the host), then back to the full world.
#   docker/chaos/disconnect-worker.sh [SERVICE]    (default worker-3)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

svc="${1:-worker-3}"
require_running
full="$(full_size)"
container="$(dc ps -q "$svc")"
[ -n "$container" ] || fail "$svc is not running"
network="$(docker inspect -f '{{range $name, $_ := .NetworkSettings.Networks}}{{$name}}{{"\n"}}{{end}}' "$container" | head -n 1)"
[ -n "$network" ] || fail "$svc is on no network"
n="$(event_count)"
say "docker network disconnect $network $svc"
docker network disconnect "$network" "$container"
wait_event reset "$n" "$(size_is $((full - 1)))"
n="$(event_count)"
# Compose gave the container its service name as a DNS alias; a plain connect would not.
say "docker network connect --alias $svc $network $svc"
docker network connect --alias "$svc" "$network" "$container"
wait_event reset "$n" "$(size_is "$full")"
report
