#!/usr/bin/env bash
# A worker loses the network (`docker network disconnect`) while its processes keep running,
# then is connected again. Expected: reset to a smaller world (the survivors' collectives time
# out after --gloo-timeout-seconds; the image's ssh keepalives end horovodrun's session to the
# lost worker; discovery's ssh probe drops the host), then back to the full world.
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

# The container's interface on $network, found by its MAC address (kept across reconnects).
iface_of() {
  local mac
  mac="$(docker inspect -f "{{with index .NetworkSettings.Networks \"$network\"}}{{.MacAddress}}{{end}}" "$container")"
  [ -n "$mac" ] || return 0
  docker exec "$container" sh -c 'for d in /sys/class/net/*; do
      [ "$(cat "$d/address")" = "$1" ] && basename "$d"; done; true' sh "$mac"
}

iface="$(iface_of)"
n="$(event_count)"
say "docker network disconnect $network $svc${iface:+ (interface $iface)}"
docker network disconnect "$network" "$container"
wait_event reset "$n" "$(size_is $((full - 1)))"
n="$(event_count)"
# Compose gave the container its service name as a DNS alias; a plain connect would not.
say "docker network connect --alias $svc $network $svc"
docker network connect --alias "$svc" "$network" "$container"
# Docker names the re-connected interface after the next free index (eth1 where it was eth0),
# but horovodrun hands Gloo one --network-interface name for every host, so the worker could
# never rejoin. A real host whose link comes back keeps its interface name: so does this one,
# renamed by a throwaway container in the worker's network namespace that alone holds
# NET_ADMIN (the worker keeps Docker's default capabilities).
now="$(iface_of)"
if [ -n "$iface" ] && [ -n "$now" ] && [ "$now" != "$iface" ]; then
  gateway="$(docker inspect -f "{{with index .NetworkSettings.Networks \"$network\"}}{{.Gateway}}{{end}}" "$container")"
  image="$(docker inspect -f '{{.Config.Image}}' "$container")"
  say "rename $svc's interface $now back to $iface"
  docker run --rm --network "container:$container" --cap-add NET_ADMIN "$image" sh -c 'set -e
    ip link set dev "$1" down; ip link set dev "$1" name "$2"; ip link set dev "$2" up
    if [ -n "$3" ]; then ip route replace default via "$3" dev "$2"; fi' sh "$now" "$iface" "$gateway"
fi
wait_event reset "$n" "$(size_is "$full")"
report
