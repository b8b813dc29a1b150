#!/usr/bin/env bash
# Entrypoint of the hvd-resilient image: one image, one role per container.
#
#   setup             compose only, once: the cluster's ssh key, the hostfile and discover.sh
#                     on the shared volume (kept if they exist, so operators' edits survive)
#   sshd              worker: sshd in the foreground; horovodrun starts the ranks over ssh
#   driver ARGS...    hvd-resilient run ARGS, in the repository folder; the checkpoint URL,
#                     run id and run folder come from HVD_RESILIENT_CHECKPOINT_URL, _RUN_ID and
#                     _RUN_DIR (flags in ARGS win), so the environment is their one source
#   seaweedfs         S3 server (weed mini) whose only identity is AWS_ACCESS_KEY_ID/_SECRET_
#   health sshd|s3    healthcheck probes (compose and Kubernetes)
#   anything else     run as given: bash, hvd-resilient report ..., torchrun ...
set -euo pipefail

APP_DIR="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
VENV="${VENV:-$APP_DIR/.venv}"
SSH_PORT="${SSH_PORT:-2222}"
S3_PORT="${S3_PORT:-8333}"
S3_BUCKET="${S3_BUCKET:-ckpt}"
SHARED="${HVD_SHARED_DIR:-/shared}"

log() { printf '[entrypoint] %s\n' "$*" >&2; }
die() { log "$*"; exit 2; }

# The cluster key pair lives in HVD_SSH_DIR (compose: made by `setup` on the shared volume;
# Kubernetes: a Secret). ssh ignores keys that others can read and volume/Secret modes vary,
# so the files are copied with strict modes into ~/.ssh.
install_key() {  # private | public
  local dir="${HVD_SSH_DIR:-}" dot="$HOME/.ssh"
  [ -n "$dir" ] || { log "HVD_SSH_DIR not set: using ~/.ssh as it is"; return 0; }
  mkdir -p "$dot" && chmod 700 "$dot"
  case "$1" in
    private)
      [ -f "$dir/id_ed25519" ] || die "no $dir/id_ed25519 (the cluster's private key)"
      install -m 600 "$dir/id_ed25519" "$dot/id_ed25519" ;;
    public)
      [ -f "$dir/id_ed25519.pub" ] || die "no $dir/id_ed25519.pub (the cluster's public key)"
      install -m 600 "$dir/id_ed25519.pub" "$dot/authorized_keys" ;;
  esac
}

setup() {
  local key_dir="${HVD_SSH_DIR:-$SHARED/ssh}" hosts="${HVD_RESILIENT_HOSTFILE:-$SHARED/hosts}"
  local tmp host
  mkdir -p "$SHARED/runs" "$(dirname "$key_dir")" "$(dirname "$hosts")"
  if [ ! -f "$key_dir/id_ed25519" ]; then
    # Made aside and renamed into place, so that a second `setup` never sees half a key pair.
    tmp="$(mktemp -d "$(dirname "$key_dir")/.ssh.XXXXXX")"
    ssh-keygen -q -t ed25519 -N '' -C hvd-resilient-cluster -f "$tmp/id_ed25519"
    chmod 700 "$tmp"
    if mv -T "$tmp" "$key_dir" 2>/dev/null; then log "made the cluster ssh key in $key_dir"
    else rm -rf "$tmp"; fi
  fi
  if [ ! -f "$hosts" ]; then
    [ -n "${HVD_WORKERS:-}" ] || die "HVD_WORKERS is empty: name the worker hosts"
    tmp="$(mktemp "$hosts.XXXXXX")"
    for host in $HVD_WORKERS; do printf '%s:%s\n' "$host" "${HVD_WORKER_SLOTS:-1}"; done > "$tmp"
    chmod 644 "$tmp" && mv "$tmp" "$hosts"
    log "wrote $hosts: $HVD_WORKERS"
  fi
  if [ ! -f "$SHARED/discover.sh" ]; then
    install -m 755 "$APP_DIR/docker/discover.sh" "$SHARED/discover.sh"
    log "installed $SHARED/discover.sh"
  fi
}

run_sshd() {
  install_key public
  # Elastic Horovod only ssh-es from the driver; mpirun's tree spawn also from worker to worker.
  if [ -f "${HVD_SSH_DIR:-/nonexistent}/id_ed25519" ]; then install_key private; fi
  ssh-keygen -A  # this container's own host keys (the image holds none)
  mkdir -p /run/sshd && chmod 755 /run/sshd
  exec /usr/sbin/sshd -D -e
}

driver() {
  local pre=()
  install_key private
  if [ -n "${HVD_RESILIENT_CHECKPOINT_URL:-}" ]; then
    pre+=(--checkpoint "$HVD_RESILIENT_CHECKPOINT_URL")
  fi
  if [ -n "${HVD_RESILIENT_RUN_ID:-}" ]; then pre+=(--run-id "$HVD_RESILIENT_RUN_ID"); fi
  if [ -n "${HVD_RESILIENT_RUN_DIR:-}" ]; then pre+=(--run-dir "$HVD_RESILIENT_RUN_DIR"); fi
  # horovodrun starts every rank in the driver's working directory, on every host.
  cd "$APP_DIR"
  exec "$VENV/bin/hvd-resilient" run "${pre[@]}" "$@"
}

seaweedfs() {
  local data="${S3_DATA_DIR:-/data}"
  : "${AWS_ACCESS_KEY_ID:?set AWS_ACCESS_KEY_ID for the S3 identity}"
  : "${AWS_SECRET_ACCESS_KEY:?set AWS_SECRET_ACCESS_KEY for the S3 identity}"
  mkdir -p "$data"
  # Written by Python so that any character in the secret stays valid JSON; mode 600.
  (umask 077 && "$VENV/bin/python" -c '
import json, os, sys
ident = {"name": "hvd-resilient", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
         "credentials": [{"accessKey": os.environ["AWS_ACCESS_KEY_ID"],
                          "secretKey": os.environ["AWS_SECRET_ACCESS_KEY"]}]}
with open(sys.argv[1], "w") as fh:
    json.dump({"identities": [ident]}, fh)
' "$data/s3-identities.json")
  # -ip is the address the components give each other inside this one process; clients only
  # ever talk to the S3 port, which listens on every interface.
  exec "$VENV/bin/weed" mini -dir="$data" -ip=127.0.0.1 -ip.bind=0.0.0.0 \
    -s3.port="$S3_PORT" -s3.config="$data/s3-identities.json" -bucket="$S3_BUCKET" \
    -webdav=false -admin.ui=false -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false
}

health() {
  case "${1:-}" in
    sshd)  # the port answers with an SSH banner
      local banner=""
      exec 3<>"/dev/tcp/127.0.0.1/$SSH_PORT"
      IFS= read -r -t 5 banner <&3 || true
      [[ "$banner" == SSH-* ]] || die "no SSH banner on port $SSH_PORT" ;;
    s3)  # the bucket answers an authenticated request
      "$VENV/bin/python" -c '
import os, boto3
from botocore.config import Config
boto3.client("s3", endpoint_url="http://127.0.0.1:" + os.environ.get("S3_PORT", "8333"),
             region_name="us-east-1",
             config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
             ).head_bucket(Bucket=os.environ.get("S3_BUCKET", "ckpt"))
' ;;
    *) die "usage: health sshd|s3" ;;
  esac
}

mode="${1:-sshd}"
[ $# -eq 0 ] || shift
case "$mode" in
  setup) setup ;;
  sshd) run_sshd ;;
  driver) driver "$@" ;;
  seaweedfs) seaweedfs ;;
  health) health "$@" ;;
  *) exec "$mode" "$@" ;;
esac
