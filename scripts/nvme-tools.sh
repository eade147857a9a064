#!/usr/bin/env bash
# Best effort: install libaio-dev, which DeepSpeed's async I/O op (the NVMe tier's reads and writes, and
# `lightning-dos calibrate --nvme-path`) is built against. Only when missing, only as root with apt-get; otherwise
# one line says how. It never fails the caller: without it the NVMe checks say what is missing, by name.
set -u
[ -f /usr/include/libaio.h ] && exit 0
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
else
  echo "scripts/nvme-tools.sh: could not install libaio-dev: the NVMe tier's checks will say so" >&2
fi
exit 0
