#!/usr/bin/env bash
# Create .venv (if missing) and install the project with its dev, plot and tensorboard extras into it.
# torch is installed first and pinned, so that pip never resolves an unpinned torch
# (which would pull several GB of CUDA packages on a machine with no GPU).
# The install is skipped when nothing it depends on changed since the last one: the stamp records
# pyproject.toml's hash, the Python and the torch version (the project is installed editable, so source
# changes need no reinstall). Delete .venv/.lightning-dos-installed to force one.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS="dev,plot,tensorboard"
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
stamp_file=.venv/.lightning-dos-installed
torch_version="from importlib.metadata import version; print(version('torch').split('+')[0])"  # no torch import
torch_now=$($py -c "$torch_version" 2>/dev/null || echo none)
stamp="$(sha256sum pyproject.toml | cut -d' ' -f1) $($py -c 'import sys; print(sys.version.split()[0])') torch=$torch_now extras=$EXTRAS"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && [ -x .venv/bin/lightning-dos ]; then
  exit 0  # installed, and nothing it depends on changed
fi
$py -m pip install -q --upgrade pip >/dev/null
if [ "$torch_now" = none ]; then
  $py -m pip install -q "torch==${TORCH_VERSION}"
fi
# Keep whatever torch is installed: constrain every later resolution to it.
$py -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > .venv/constraints.txt
$py -m pip install -q -c .venv/constraints.txt -e ".[$EXTRAS]"
torch_now=$($py -c "$torch_version")
echo "$(sha256sum pyproject.toml | cut -d' ' -f1) $($py -c 'import sys; print(sys.version.split()[0])') torch=$torch_now extras=$EXTRAS" > "$stamp_file"
