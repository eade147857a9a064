#!/usr/bin/env bash
# On this (CPU) machine, fetch the Python wheels a bare GPU machine lacks into .whl/ (git-ignored), so that
# they travel with the working tree: DeepSpeed (built with no ops: a pure-Python wheel), its pure-Python
# dependencies, and what the tests and the CLI need. The GPU machine runs Python 3.12 on x86-64 with torch,
# lightning, torchmetrics and rich, and reaches no package registry. scripts/gpu-check.sh installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=.whl
mkdir -p "$dir"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip wheel -q --no-deps -w "$dir" deepspeed==0.19.8
python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir" \
  hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types typing-inspection "typing-extensions>=4.16" \
  pytest pluggy iniconfig hypothesis sortedcontainers "jsonargparse[signatures]" docstring-parser typeshed-client \
  pyyaml
# libaio for the NVMe tier's CUDA test (best effort: apt-get here; gpu-check.sh unpacks them there as root).
if command -v apt-get >/dev/null; then
  (cd "$dir" && apt-get download -qq libaio1 libaio-dev 2>/dev/null || apt-get download -qq libaio1t64 libaio-dev \
    2>/dev/null) || echo "gpu-wheels: could not fetch libaio's .deb files: the NVMe tier's CUDA test will skip" >&2
fi
ls -1 "$dir"
