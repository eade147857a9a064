#!/usr/bin/env bash
# Best effort: install libaio-dev, which DeepSpeed's async I/O op (the NVMe tier's reads and writes, and
# `lightning-dos calibrate --nvme-path`) is built against. Only when missing, only as root with apt-get; otherwise
# one line says how. Then, where .venv exists (scripts/setup.sh), build the tier's ops ahead (minutes, once per
# install, announced), so the first NVMe run starts at once (LIGHTNING_DOS_BUILD_NVME_OPS=0: not now; scripts/train.sh,
# whose recipe needs none of them). It never fails the caller: without libaio the NVMe checks say what is missing.
set -u
cd "$(dirname "$0")/.."
build_ops() {
  if [ "${LIGHTNING_DOS_BUILD_NVME_OPS:-1}" != 0 ] && [ -x .venv/bin/python ] && [ -f /usr/include/libaio.h ]; then
    .venv/bin/python -m lightning_dos.host.disk || true
  fi
  exit 0
}
[ -f /usr/include/libaio.h ] && build_ops
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "scripts/nvme-tools.sh: libaio-dev is missing and this is not root with apt-get: for the NVMe tier run" \
    "'sudo apt-get install libaio-dev' (or 'sudo dnf install libaio-devel')" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if timeout 300 apt-get install -y -qq --no-install-recommends libaio-dev >/dev/null 2>&1 \
  || { timeout 300 apt-get update -qq >/dev/null 2>&1 \
       && timeout 300 apt-get install -y -qq --no-install-recommends libaio-dev >/dev/null 2>&1; }; then
  echo "scripts/nvme-tools.sh: installed libaio-dev"
  build_ops
else
  echo "scripts/nvme-tools.sh: could not install libaio-dev: the NVMe tier's checks will say so" >&2
fi
exit 0
