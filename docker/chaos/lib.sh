# shellcheck shell=bash
# Sourced by the chaos scenarios in this folder. They need a Docker engine, Compose (the
# `docker compose` plugin, or Compose 1.29's `docker-compose`) and the compose job running long
# enough to be disturbed, e.g.
#   EPOCHS=10000 docker compose -p hvd-resilient -f docker/compose.yaml up -d --build
# Each scenario prints what it does, waits for the events the job must log in response
# (events.jsonl on the shared volume), and ends with a report of the run.

CHAOS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Compose reads COMPOSE_FILE itself, so it may list overrides too (a.yaml:b.yaml).
export COMPOSE_FILE="${COMPOSE_FILE:-$CHAOS_DIR/../compose.yaml}"
# compose.yaml has no `name:` (Compose 1.x refuses it): the project name comes from here.
export COMPOSE_PROJECT_NAME="${COMPOSE_PROJECT_NAME:-hvd-resilient}"
RUN_ID="${RUN_ID:-digits}"                        # the same default as compose.yaml
RUN_DIR="/shared/runs/$RUN_ID"
EVENTS="$RUN_DIR/events.jsonl"
HOSTFILE=/shared/hosts
CHAOS_TIMEOUT="${CHAOS_TIMEOUT:-240}"             # seconds to wait for each expected event

say() { printf '[chaos %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
fail() { say "FAIL: $*"; exit 1; }

# The Compose command: COMPOSE if set (e.g. "docker-compose"), else the plugin when it
# answers, else Compose 1.x.
if [ -z "${COMPOSE:-}" ]; then
  if docker compose version >/dev/null 2>&1; then COMPOSE="docker compose"
  elif command -v docker-compose >/dev/null 2>&1; then COMPOSE="docker-compose"
  else COMPOSE="docker compose"
  fi
fi
dc() {
  local -a cmd
  read -r -a cmd <<<"$COMPOSE"
  "${cmd[@]}" "$@"
}

# up_wait [--profile P] SERVICE...: start services and wait until they are healthy. The
# plugin's `up --wait` does that; Compose 1.x has no --wait, so the health is polled.
up_wait() {
  local -a profile=()
  if [ "${1:-}" = --profile ]; then profile=(--profile "$2"); shift 2; fi
  if [ "$COMPOSE" = "docker compose" ]; then
    dc "${profile[@]}" up -d --wait "$@"
    return
  fi
  dc "${profile[@]}" up -d "$@"
  local svc id health start="$SECONDS"
  for svc in "$@"; do
    id="$(dc "${profile[@]}" ps -q "$svc")"
    while :; do
      health="$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$id")"
      case "$health" in healthy|running) break ;; esac
      ((SECONDS - start < CHAOS_TIMEOUT)) || fail "$svc not healthy within ${CHAOS_TIMEOUT}s ($health)"
      sleep 2
    done
  done
}

# Runs a command in a throwaway container on the shared volume, so it works whichever of the
# job's containers is down at the moment.
in_cluster() { dc run --rm --no-deps -T setup "$@"; }

# The driver runs and the job trains (a commit is logged): a fault during start-up tests
# something else (every rank fails at once, and the run gives up as it should).
require_running() {
  local running start="$SECONDS"
  running="$(dc ps --services --filter status=running)"
  grep -qx driver <<<"$running" \
    || fail "the driver is not running; start the job first: EPOCHS=10000 docker compose -p $COMPOSE_PROJECT_NAME -f docker/compose.yaml up -d --build"
  # grep -c reads to the end: grep -q would stop early and pipefail report cat's SIGPIPE.
  until [ "$(events_after 0 | grep -cE '"event": *"commit"')" -gt 0 ]; do
    ((SECONDS - start < CHAOS_TIMEOUT)) || fail "the job logged no commit within ${CHAOS_TIMEOUT}s"
    sleep 3
  done
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
  fail "no '$name' event${extra:+ matching $extra} within ${CHAOS_TIMEOUT}s (see: $COMPOSE -p $COMPOSE_PROJECT_NAME -f docker/compose.yaml logs driver)"
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
