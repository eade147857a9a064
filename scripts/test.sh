#!/usr/bin/env bash
# Set up .venv, then lint and run the whole test suite (CPU; GPU tests run where CUDA is present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-$(.venv/bin/python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}
.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
