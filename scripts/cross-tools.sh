#!/usr/bin/env bash
# Best effort: install Debian's aarch64 cross compiler and qemu-user, with which tests/test_native_builds.py
# builds host_adam.c for Arm and runs it (without them those tests are skipped, by name). Only what is missing,
# only as root with apt-get; it never fails the caller. scripts/test.sh runs it in CI
# (LIGHTNING_DOS_CROSS_TOOLS=install, set by .ci/run); run it yourself to get the Arm checks locally.
set -u
need=()
command -v aarch64-linux-gnu-gcc >/dev/null || need+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross)
command -v qemu-aarch64-static >/dev/null || command -v qemu-aarch64 >/dev/null || need+=(qemu-user-static)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "scripts/cross-tools.sh: not root with apt-get: the aarch64 build tests will be skipped (they need ${need[*]})" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if timeout 300 apt-get update -qq >/dev/null 2>&1 \
  && timeout 600 apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
  echo "scripts/cross-tools.sh: installed ${need[*]}"
else
  echo "scripts/cross-tools.sh: could not install ${need[*]}: the aarch64 build tests will be skipped" >&2
fi
exit 0
