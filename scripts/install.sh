#!/usr/bin/env bash
# Installs everything hvd_resilient and its tests need, on a fresh Debian 12 machine:
# Open MPI + sshd + iproute2 (apt), a .venv with torch 2.13.0, Horovod 0.28.1 built from its
# sdist with our patches (scripts/patch_horovod.py; cached as a wheel outside the work tree),
# mpi4py, boto3, SeaweedFS, etcd (apt) with its client etcd3gw, and the test tools. Idempotent:
# a second run takes well under a minute.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
HOROVOD_VERSION="0.28.1"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
CACHE="${HVD_RESILIENT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_resilient}"
log() { printf '[install] %s\n' "$*" >&2; }

# ---- system packages -------------------------------------------------------------------
need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || need_apt+=(openssh-server openssh-client)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v tc >/dev/null 2>&1 || need_apt+=(iproute2)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v make >/dev/null 2>&1 || need_apt+=(make)                # slim images lack it
command -v shellcheck >/dev/null 2>&1 || need_apt+=(shellcheck)   # tests lint the shell scripts
command -v ssh-keygen >/dev/null 2>&1 || need_apt+=(openssh-client)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)   # the in-place agreement's store
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing system packages: ${need_apt[*]}; run: sudo apt-get install -y ${need_apt[*]}"; exit 1
  fi
  log "apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

# Debian's etcd-server enables a service of its own on 127.0.0.1:2379 (started where the image
# allows services). Nothing here uses it: the agreement is given its endpoints and the tests
# start their own clusters on free ports. Stopped and disabled, by init system or by its user.
if [ "$(id -u)" = 0 ] && command -v etcd >/dev/null 2>&1; then
  if [ -d /run/systemd/system ]; then
    systemctl disable --now etcd >/dev/null 2>&1 || true
  else
    service etcd stop >/dev/null 2>&1 || true
    update-rc.d etcd disable >/dev/null 2>&1 || true
  fi
  if command -v pgrep >/dev/null 2>&1 && getent passwd etcd >/dev/null 2>&1; then
    for pid in $(pgrep -u etcd -x etcd || true); do kill "$pid" 2>/dev/null || true; done
  fi
fi

# ---- virtual environment -------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
pip_q() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }

have_torch="$("$VPY" -c 'import torch,sys; sys.stdout.write(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [ "$have_torch" != "$TORCH_VERSION" ]; then
  log "installing torch==$TORCH_VERSION"
  # On this project's CPU machines a CPU wheel lies in pip's find-links; on a CUDA machine
  # the index's default Linux build is the CUDA one.
  pip_q "torch==$TORCH_VERSION"
fi
pip_q numpy cloudpickle psutil pyyaml packaging cffi wheel setuptools

# ---- Horovod (built once, cached as a wheel keyed by versions) -----------------------
TV="$("$VPY" -c 'import torch; print(torch.__version__.replace("+","_"))')"
PV="$("$VPY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
CUDA_TAG="cpu"; command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1 && CUDA_TAG="cuda"
# The patch level (scripts/patch_horovod.py) is part of the key: a venv or cached wheel built
# before a patch is rebuilt, not reused.
KEY="horovod-$HOROVOD_VERSION-torch$TV-$PV-$CUDA_TAG-p3"
WHEEL_DIR="$CACHE/wheels/$KEY"
patched() {  # the installed Horovod carries the Gloo patches' messages
  "$VPY" - <<'PYEOF' >/dev/null 2>&1
import glob, os, sys
import horovod.torch
sys.path.insert(0, os.environ["HVD_PATCH_DIR"])
from patch_horovod import MESSAGES
libs = glob.glob(os.path.join(os.path.dirname(horovod.torch.__file__), "mpi_lib_v2*.so"))
lib = open(libs[0], "rb").read() if libs else b""
sys.exit(0 if all(m.encode() in lib for m in MESSAGES) else 1)
PYEOF
}
if ! HVD_PATCH_DIR="$ROOT/scripts" patched; then
  if [ -z "$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null)" ]; then
    log "building Horovod $HOROVOD_VERSION for torch $TV (about 8 minutes on 2 cores; cached in $WHEEL_DIR)"
    build="$(mktemp -d)"
    trap 'rm -rf "$build"' EXIT
    "$VPY" -m pip download -q --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
    tar -xzf "$build"/horovod-*.tar.gz -C "$build"
    src="$(find "$build" -mindepth 1 -maxdepth 1 -type d -name "horovod-*" | head -1)"
    # C++17 for torch's headers, and Gloo's wedged pair (a message for a failed op's buffer).
    "$VPY" "$ROOT/scripts/patch_horovod.py" "$src" || { log "the Horovod patches did not apply"; exit 1; }
    gpu_env=()
    [ "$CUDA_TAG" = cuda ] && gpu_env=(HOROVOD_GPU_OPERATIONS=NCCL)
    (cd "$src" && env HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS="-j$(nproc)" \
        "${gpu_env[@]}" "$VPY" -m pip wheel -q --no-build-isolation --no-deps --no-cache-dir -w "$build/out" .)
    mkdir -p "$WHEEL_DIR.tmp"
    cp "$build"/out/horovod-*.whl "$WHEEL_DIR.tmp/"
    rm -rf "$WHEEL_DIR"; mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
  fi
  log "installing Horovod from $WHEEL_DIR"
  pip_q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
fi

# ---- the project and the rest ----------------------------------------------------------
pip_q -e "${ROOT}[test,horovod,etcd]"

# ---- checks ----------------------------------------------------------------------------
check="$("$VENV/bin/horovodrun" --check-build)"
echo "$check" | grep -q '\[X\] PyTorch' || { log "Horovod was built without PyTorch:"; echo "$check" >&2; exit 1; }
echo "$check" | grep -q '\[X\] Gloo' || { log "Horovod was built without Gloo:"; echo "$check" >&2; exit 1; }
"$VPY" -c 'import mpi4py, boto3, etcd3gw, horovod.torch' || { log "imports failed"; exit 1; }
log "ok: $("$VPY" -c 'import torch,horovod; print("torch", torch.__version__, "horovod", horovod.__version__)')"
