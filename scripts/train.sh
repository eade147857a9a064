#!/usr/bin/env bash
# Set up .venv, then train the default recipe (recipes/gpt-tiny.yaml) on whatever hardware is here.
# Extra arguments go to `lightning-dos fit`, e.g. `--trainer.max_steps 50`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# libaio-dev for the NVMe tier, when root with apt-get; else one line says how. The default recipe keeps its state in
# host memory: the tier's ops are built by `bash scripts/nvme-tools.sh` alone, or by the first NVMe run.
LIGHTNING_DOS_BUILD_NVME_OPS=0 bash scripts/nvme-tools.sh
export DS_ACCELERATOR=${DS_ACCELERATOR:-$(.venv/bin/python -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")}
.venv/bin/lightning-dos fit --config recipes/gpt-tiny.yaml "$@"
