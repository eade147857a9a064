#!/usr/bin/env bash
# Create .venv (if missing) and install the project with its dev extra into it.
# torch is installed first and pinned, so that pip never resolves an unpinned torch
# (which would pull several GB of CUDA packages on a machine with no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
$py -m pip install -q --upgrade pip >/dev/null
if ! $py -c "import torch" 2>/dev/null; then
  $py -m pip install -q "torch==${TORCH_VERSION}"
fi
# Keep whatever torch is installed: constrain every later resolution to it.
$py -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > .venv/constraints.txt
$py -m pip install -q -c .venv/constraints.txt -e ".[dev,plot]"
