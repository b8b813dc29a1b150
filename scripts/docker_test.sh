#!/usr/bin/env bash
# The Docker tier (`make docker-test`): a real engine, the image built from docker/Dockerfile,
# the compose job trained, disturbed by every docker/chaos/*.sh and resumed (tests/docker/).
#
#   1. installs what is missing (Debian: docker.io, docker-compose, debootstrap), as root;
#   2. starts an engine if none answers (and stops it at the end), else uses the running one;
#   3. a Debian bookworm base image made here (debootstrap --variant=minbase + docker import;
#      no registry needed), cached as `docker save` output under ~/.cache/hvd_resilient/docker;
#   4. builds the image with BuildKit, reusing the Horovod wheel that `make install` built (and
#      the torch wheel this machine installs) instead of compiling again; this machine's apt
#      sources, apt network settings, pip configuration and CA bundle go in as build secrets,
#      so nothing of them lands in the image, its history or the repository;
#   5. runs `pytest -m docker tests/docker`;
#   6. removes every container, network, volume and image it made (BuildKit's build cache is
#      kept, trimmed to HVD_DOCKER_TEST_KEEP_CACHE, so that the next build is warm).
#
# Extra arguments go to pytest. Knobs: HVD_DOCKER_TEST_CONTEXT (build context, default the
# repository), HVD_DOCKER_TEST_KEEP_CACHE (default 12GB; 0: prune all build cache),
# HVD_DOCKER_TEST_FRESH_BASE=1 (debootstrap again).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
CACHE="${HVD_RESILIENT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_resilient}"
DCACHE="$CACHE/docker"
CONTEXT="${HVD_DOCKER_TEST_CONTEXT:-$ROOT}"
KEEP_CACHE="${HVD_DOCKER_TEST_KEEP_CACHE:-12GB}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PROJECT="hvd-resilient-test"                 # compose project: never the user's own
IMAGE="hvd-resilient-test:cpu"
BASE="hvd-resilient-test/debian:bookworm-minbase"
SUITE="bookworm"
T0="$SECONDS"
log() { printf '[docker-test %4ss] %s\n' "$((SECONDS - T0))" "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (apt-get, dockerd, debootstrap)"
[ -x "$VENV/bin/python" ] || die "no $VENV: run make install first"
WORK="$(mktemp -d /tmp/hvd-docker-test.XXXXXX)"
STARTED_DOCKERD=""
WHEELS=""

# ---- cleanup: everything this run made, whatever happened -------------------------------------
# shellcheck disable=SC2317  # run by the EXIT trap
cleanup() {
  local rc=$?
  set +e
  if docker info >/dev/null 2>&1; then
    log "cleanup: containers, networks and volumes of project $PROJECT"
    COMPOSE_PROJECT_NAME="$PROJECT" "${COMPOSE_CMD[@]}" -f "$ROOT/docker/compose.yaml" \
      --profile spare down -v --remove-orphans -t 5 >/dev/null 2>&1
    # Anything left with the project's label (a `run` container of a killed test, say).
    docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" | xargs -r docker rm -f >/dev/null
    docker network ls -q --filter "label=com.docker.compose.project=$PROJECT" | xargs -r docker network rm >/dev/null
    docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | xargs -r docker volume rm >/dev/null
    log "cleanup: images $IMAGE $BASE ${WHEELS:-}"
    docker rmi -f "$IMAGE" "$BASE" ${WHEELS:+"$WHEELS"} >/dev/null 2>&1
    docker image prune -f >/dev/null 2>&1  # dangling layers of this run's builds
    if [ "$KEEP_CACHE" = 0 ]; then docker builder prune -af >/dev/null 2>&1
    else docker builder prune -f --keep-storage "$KEEP_CACHE" >/dev/null 2>&1; fi
  fi
  if [ -n "$STARTED_DOCKERD" ]; then
    log "cleanup: stopping the dockerd this run started (pid $STARTED_DOCKERD)"
    kill -TERM "$STARTED_DOCKERD" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$STARTED_DOCKERD" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$STARTED_DOCKERD" 2>/dev/null && kill -KILL "$STARTED_DOCKERD"
  fi
  rm -rf "$WORK"
  log "done (exit $rc) in $((SECONDS - T0)) s"
  exit "$rc"
}
COMPOSE_CMD=(docker-compose)
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---- 1. packages --------------------------------------------------------------------------------
need=()
command -v dockerd >/dev/null 2>&1 || need+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
  need+=(docker-compose)
fi
if [ ${#need[@]} -gt 0 ]; then
  log "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  timeout 300 apt-get update -qq
  timeout 600 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
if docker compose version >/dev/null 2>&1; then COMPOSE_CMD=(docker compose)
else COMPOSE_CMD=(docker-compose); fi

# ---- 2. engine ------------------------------------------------------------------------------------
if docker info >/dev/null 2>&1; then
  log "using the running Docker engine"
else
  # No NAT and no default bridge: the job's containers only talk to each other on compose's
  # own network, and builds that download use the host's network (docker build --network host).
  log "starting dockerd (--iptables=false --bridge=none)"
  setsid dockerd --iptables=false --bridge=none >"$WORK/dockerd.log" 2>&1 &
  STARTED_DOCKERD=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log" >&2; die "dockerd did not start"; }
fi

# BuildKit: buildx where it exists; else the engine package's own CLI, whose `build` has
# BuildKit built in (a newer CLI without the buildx plugin only has the legacy builder, which
# knows no RUN --mount).
if docker buildx version >/dev/null 2>&1; then BUILD=(docker buildx build --load)
elif [ -x /usr/bin/docker ]; then BUILD=(env DOCKER_BUILDKIT=1 /usr/bin/docker build)
else BUILD=(env DOCKER_BUILDKIT=1 docker build); fi

# ---- 3. base image ---------------------------------------------------------------------------------
mirror() {  # the first deb822 URIs: this machine's Debian mirror (read here, written nowhere)
  awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null
}
mkdir -p "$DCACHE"
base_tar="$DCACHE/debian-$SUITE-minbase.image.tar"
if [ "${HVD_DOCKER_TEST_FRESH_BASE:-0}" = 1 ]; then rm -f "$base_tar"; fi
if [ ! -s "$base_tar" ]; then
  url="$(mirror)"; [ -n "$url" ] || die "no URIs: line in /etc/apt/sources.list.d/*.sources"
  log "debootstrap --variant=minbase $SUITE (about a minute)"
  rootfs="$WORK/rootfs"
  timeout 900 debootstrap --variant=minbase "$SUITE" "$rootfs" "$url" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
  # What names the mirror or this machine goes: apt's sources, lists and caches, the log,
  # hostname and resolv.conf (Docker provides both at run time). Builds bring their own sources
  # as a secret.
  rm -rf "$rootfs/var/lib/apt/lists/"* "$rootfs/var/cache/apt/"*.bin \
    "$rootfs/var/cache/apt/archives/"*.deb "$rootfs/var/log/bootstrap.log" \
    "$rootfs/etc/hostname" "$rootfs/etc/resolv.conf"
  : >"$rootfs/etc/apt/sources.list"
  host="$(sed -E 's#^[a-z]+://##; s#[/:].*##' <<<"$url")"
  if grep -rlI -- "$host" "$rootfs/etc" "$rootfs/var" >"$WORK/leak" 2>/dev/null; then
    cat "$WORK/leak" >&2; die "the mirror is still named in the base"
  fi
  tar -C "$rootfs" -c . | docker import - "$BASE" >/dev/null
  rm -rf "$rootfs"
  # Saved, not re-imported next time: an import gets a new id, which would make every layer
  # of the build cache built on it useless.
  docker save "$BASE" >"$base_tar.tmp" && mv "$base_tar.tmp" "$base_tar"
  log "base image made and cached in $base_tar"
else
  docker load -i "$base_tar" >/dev/null
  log "base image loaded from $base_tar"
fi

# ---- prebuilt wheels -------------------------------------------------------------------------------
# scripts/install.sh's wheel cache (the Horovod build of `make install`) and the torch wheel
# this machine's pip installs, as an image for the Dockerfile's wheels stage.
wheels_dir="$WORK/wheels"
mkdir -p "$wheels_dir/wheels" "$wheels_dir/hvd_resilient"
if [ -d "$CACHE/wheels" ]; then cp -a "$CACHE/wheels" "$wheels_dir/hvd_resilient/"; fi
timeout 300 "$VENV/bin/pip" download -q --no-deps --disable-pip-version-check \
  -d "$wheels_dir/wheels" "torch==$TORCH_VERSION" 2>/dev/null \
  || log "no torch wheel to hand over: the build takes torch from its own index"
key="$(cd "$wheels_dir" && find . -type f -printf '%P %s\n' | sort | sha256sum | cut -c1-16)"
WHEELS="hvd-resilient-test/wheels:$key"
wheels_tar="$DCACHE/wheels-$key.image.tar"
if [ -s "$wheels_tar" ]; then
  docker load -i "$wheels_tar" >/dev/null
else
  rm -f "$DCACHE"/wheels-*.image.tar  # older wheel sets
  tar -C "$wheels_dir" -c . | docker import - "$WHEELS" >/dev/null
  docker save "$WHEELS" >"$wheels_tar.tmp" && mv "$wheels_tar.tmp" "$wheels_tar"
fi
rm -rf "$wheels_dir"
log "prebuilt wheels: $WHEELS"

# ---- build secrets: this machine's package network, never written into the image ------------------
sec="$WORK/secrets"; mkdir -p "$sec"
secrets=()
if compgen -G '/etc/apt/sources.list.d/*.sources' >/dev/null; then
  for f in /etc/apt/sources.list.d/*.sources; do cat "$f"; echo; done >"$sec/apt-sources"
  secrets+=(--secret "id=apt-sources,src=$sec/apt-sources")
fi
grep -hE '^[[:space:]]*Acquire::(Check-Valid-Until|Check-Date|https?::)' \
  /etc/apt/apt.conf /etc/apt/apt.conf.d/* 2>/dev/null >"$sec/apt-conf" || true
[ -s "$sec/apt-conf" ] && secrets+=(--secret "id=apt-conf,src=$sec/apt-conf")
ca=""
for f in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt; do
  if [ -n "$f" ] && [ -s "$f" ]; then ca="$f"; break; fi
done
[ -n "$ca" ] && secrets+=(--secret "id=ca-bundle,src=$ca")
"$VENV/bin/python" - "$sec/pip-conf" "${ca:+/run/secrets/ca-bundle}" <<'PY'
"""pip.conf for the build: this machine's index settings that a container can reach (http(s)
indexes, not file:// folders), and the CA bundle handed over as a secret."""
import os, subprocess, sys
out, cert = sys.argv[1], sys.argv[2]
conf = {}
for line in subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                           text=True).stdout.splitlines():
    key, _, value = line.partition("=")
    conf[key.split(".", 1)[-1]] = value.strip().strip("'\"")
for key in ("index-url", "extra-index-url", "trusted-host", "proxy"):
    env = os.environ.get("PIP_" + key.upper().replace("-", "_"))
    if env:
        conf[key] = env
lines = ["[global]"]
for key in ("index-url", "extra-index-url", "trusted-host", "proxy"):
    values = [v for v in conf.get(key, "").split() if not v.startswith("file:")]
    if values:
        lines.append(f"{key} = {' '.join(values)}")
if cert:
    lines.append(f"cert = {cert}")
with open(out, "w") as fh:
    fh.write("\n".join(lines) + "\n")
PY
secrets+=(--secret "id=pip-conf,src=$sec/pip-conf")
proxies=()
for v in HTTP_PROXY HTTPS_PROXY NO_PROXY http_proxy https_proxy no_proxy; do
  # Docker's predefined proxy build args: passed on, never recorded in the image's history.
  if [ -n "${!v:-}" ]; then proxies+=(--build-arg "$v"); fi
done

# ---- 4. build --------------------------------------------------------------------------------------
log "building $IMAGE from $CONTEXT (${BUILD[*]})"
b0="$SECONDS"
timeout 2400 "${BUILD[@]}" --network host -f "$CONTEXT/docker/Dockerfile" -t "$IMAGE" \
  --build-arg "BASE_IMAGE=$BASE" --build-arg "WHEELS_IMAGE=$WHEELS" \
  "${secrets[@]}" "${proxies[@]}" "$CONTEXT" >"$WORK/build.log" 2>&1 \
  || { tail -40 "$WORK/build.log" >&2; die "docker build failed"; }
log "built $IMAGE in $((SECONDS - b0)) s"

# ---- 5. the tests ----------------------------------------------------------------------------------
log "pytest -m docker tests/docker"
set +e
(cd "$ROOT" && env HVD_DOCKER_TEST=1 HVD_IMAGE="$IMAGE" COMPOSE_PROJECT_NAME="$PROJECT" \
  COMPOSE="${COMPOSE_CMD[*]}" HVD_DOCKER_TEST_MIRROR="$(mirror)" \
  "$VENV/bin/python" -m pytest -q -m docker tests/docker -p no:cacheprovider "$@")
rc=$?
set -e
log "pytest exit $rc"
exit "$rc"
