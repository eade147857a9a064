#!/usr/bin/env bash
# Set up .venv, then run the side-by-side benchmark (bench/run.py; arguments go to it) and print its table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-$(.venv/bin/python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}
# DeepSpeed's ops built once for this install, not rebuilt by another install sharing torch's extensions folder.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$(.venv/bin/python -m lightning_dos.host.extensions)}
.venv/bin/python bench/run.py "$@"
