# shellcheck shell=bash
# Sourced by the chaos scenarios in this folder. They need a Docker engine with the compose
# plugin and the compose job running long enough to be disturbed, e.g.
#   EPOCHS=10000 docker compose -f docker/compose.yaml up -d --build
# Each scenario prints what it does, waits for the events the job must log in response
# (events.jsonl on the shared volume), and ends with a report of the run.

CHAOS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
COMPOSE_FILE="${COMPOSE_FILE:-$CHAOS_DIR/../compose.yaml}"
RUN_ID="${RUN_ID:-digits}"                        # the same default as compose.yaml
RUN_DIR="/shared/runs/$RUN_ID"
EVENTS="$RUN_DIR/events.jsonl"
HOSTFILE=/shared/hosts
CHAOS_TIMEOUT="${CHAOS_TIMEOUT:-240}"             # seconds to wait for each expected event

say() { printf '[chaos %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { say "FAIL: $*"; exit 1; }
dc() { docker compose -f "$COMPOSE_FILE" "$@"; }

# Runs a command in a throwaway container on the shared volume, so it works whichever of the
# job's containers is down at the moment.
in_cluster() { dc run --rm --no-deps -T setup "$@"; }

require_running() {
  local running
  running="$(dc ps --status running --services)"
  grep -qx driver <<<"$running" \
    || fail "the driver is not running; start the job first: EPOCHS=10000 docker compose -f docker/compose.yaml up -d --build"
}

events_after() {  # the event lines after line $1 (none yet: nothing)
  { in_cluster cat "$EVENTS" 2>/dev/null || true; } | tail -n +"$(($1 + 1))"
}

event_count() { events_after 0 | wc -l; }

# wait_event NAME AFTER [REGEX]: waits for an event NAME after line AFTER, whose line also
# matches REGEX when given (e.g. "$(size_is 3)").
wait_event() {
  local name="$1" after="$2" extra="${3:-}" start="$SECONDS" lines
  say "waiting for event '$name'${extra:+ matching $extra} (up to ${CHAOS_TIMEOUT}s)"
  while ((SECONDS - start < CHAOS_TIMEOUT)); do
    lines="$(events_after "$after" | grep -E "\"event\": *\"$name\"" || true)"
    if [ -n "$lines" ] && { [ -z "$extra" ] || grep -qE "$extra" <<<"$lines"; }; then
      say "ok: '$name' after $((SECONDS - start))s: $(tail -n 1 <<<"$lines")"
      return 0
    fi
    sleep 3
  done
  fail "no '$name' event${extra:+ matching $extra} within ${CHAOS_TIMEOUT}s (see: docker compose -f docker/compose.yaml logs driver)"
}

size_is() { printf '"new_size": *%s[,}]' "$1"; }  # a reset to a world of $1 ranks

# The size of the world when all hosts of the hostfile take part (one slot each).
full_size() { in_cluster grep -c '^[^#[:space:]]' "$HOSTFILE"; }

report() {
  if in_cluster hvd-resilient report --help >/dev/null 2>&1; then
    in_cluster hvd-resilient report "$RUN_DIR" --no-plot
  else
    say "no 'hvd-resilient report' in this image; events so far:"
    events_after 0 | sed -nE 's/.*"event": *"([a-z_]+)".*/\1/p' | sort | uniq -c
  fi
}
