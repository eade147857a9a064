#!/usr/bin/env bash
# Set up .venv, then lint and run the whole test suite: the CPU pass everywhere, and the CUDA pass
# (tests/test_gpu.py) where CUDA is present. DeepSpeed chooses its accelerator once per process, so the
# two passes are separate pytest processes (tests/conftest.py sets DS_ACCELERATOR for each).
# Arguments go to the CPU pass, e.g. `bash scripts/test.sh tests/test_equivalence.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The cross compiler and qemu for the aarch64 builds of the host kernel (best effort, never fails the run).
if [ "${LIGHTNING_DOS_CROSS_TOOLS:-}" = install ] || [ "${CI:-}" = true ]; then
  bash scripts/cross-tools.sh
fi
# libaio-dev for DeepSpeed's async I/O op (the NVMe tier), when root with apt-get; else one line says how.
bash scripts/nvme-tools.sh
py=.venv/bin/python
$py -m ruff check .
$py -m pytest "$@"
if $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  $py -m pytest --accelerator cuda tests/test_gpu.py
fi
