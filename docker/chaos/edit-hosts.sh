#!/usr/bin/env bash
# Operators change the host set while the job runs, by editing /shared/hosts (atomically: the
# hostfile discovery script reads it every second). Removes a worker, adds it back, then
# brings up the spare worker-4 and adds it. Expected: a reset to each new world size, with no
# work lost (hosts_changed, not failure_detected).
#   docker/chaos/edit-hosts.sh [SERVICE]       (default worker-3)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

svc="${1:-worker-3}"
require_running
full="$(full_size)"

n="$(event_count)"
say "remove $svc from $HOSTFILE"
in_cluster sed -i "/^${svc}[:[:space:]]/d" "$HOSTFILE"   # sed -i renames: an atomic edit
wait_event hosts_changed "$n"
wait_event reset "$n" "$(size_is $((full - 1)))"

n="$(event_count)"
say "add $svc:1 back to $HOSTFILE"
in_cluster sed -i "\$a $svc:1" "$HOSTFILE"
wait_event reset "$n" "$(size_is "$full")"

n="$(event_count)"
say "start the spare worker-4 and add worker-4:1 to $HOSTFILE"
up_wait --profile spare worker-4
in_cluster sed -i "\$a worker-4:1" "$HOSTFILE"
wait_event reset "$n" "$(size_is $((full + 1)))"

if [ "$(events_after 0 | grep -cE '"event": *"failure_detected"')" -gt 0 ]; then
  say "note: failure_detected events in this run (from other scenarios or a real failure)"
fi
report
