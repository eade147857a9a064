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
# The CPU pass on two workers (pytest-xdist) where there are two cores: most tests keep one core busy (Python and
# Lightning's loop), so two files at a time nearly halve the time. A file's tests stay on one worker, in order
# (--dist loadfile), so module fixtures are built once. DOS_TEST_WORKERS=0 runs it in this process, one at a time.
workers=${DOS_TEST_WORKERS:-$([ "$(nproc)" -ge 2 ] && echo 2 || echo 0)}
$py -m pytest -n "$workers" --dist loadfile "$@"
if $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  $py -m pytest --accelerator cuda tests/test_gpu.py
fi
