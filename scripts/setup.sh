#!/usr/bin/env bash
# Create .venv (if missing) and install the project with its dev and tensorboard extras into it.
# torch is installed first and pinned, so that pip never resolves an unpinned torch
# (which would pull several GB of CUDA packages on a machine with no GPU).
# The install is skipped when nothing it depends on changed since the last one: the stamp records
# pyproject.toml's hash, the Python and the torch version (the project is installed editable, so source
# changes need no reinstall). Delete .venv/.lightning-dos-installed to force one.
# Quiet: nothing is printed but pip's errors (and any warning not named below). torch is never imported here
# (before numpy is installed it warns "Failed to initialize NumPy").
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS="dev,tensorboard"
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
stamp_file=.venv/.lightning-dos-installed
torch_version="from importlib.metadata import version; print(version('torch').split('+')[0])"  # no torch import
torch_now=$($py -c "$torch_version" 2>/dev/null || echo none)
stamp="$(sha256sum pyproject.toml | cut -d' ' -f1) $($py -c 'import sys; print(sys.version.split()[0])') torch=$torch_now extras=$EXTRAS"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && [ -x .venv/bin/lightning-dos ]; then
  exit 0  # installed, and nothing it depends on changed
fi
# pip install -q, with two known messages left out; everything else (errors above all) passes, and pip's exit
# status is kept (pipefail). Left out:
# - "WARNING: Location 'file:///...' is ignored: it is neither a file nor a directory.": a pip configuration
#   (`pip config list`) naming a local index or wheel folder that does not exist on this machine, repeated for
#   every package; only that exact line is dropped, so a location that exists but is broken still shows.
# - setuptools' "Editable installation." notice (be careful with folders named like the package in the working
#   directory), printed by every editable install: here the folder *is* the package.
ignored_location="^WARNING: Location 'file://[^']*' is ignored: it is neither a file nor a directory\.$"
pip_install() {
  { PYTHONWARNINGS="ignore:Editable installation" "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 1>&3 3>&- |
    { grep -v -E "$ignored_location" || true; } >&2; } 3>&1
}
pip_install --upgrade pip >/dev/null
if [ "$torch_now" = none ]; then
  pip_install "torch==${TORCH_VERSION}"
fi
# Keep whatever torch is installed: constrain every later resolution to it.
echo "torch==$($py -c "$torch_version")" > .venv/constraints.txt
pip_install -c .venv/constraints.txt -e ".[$EXTRAS]"
torch_now=$($py -c "$torch_version")
echo "$(sha256sum pyproject.toml | cut -d' ' -f1) $($py -c 'import sys; print(sys.version.split()[0])') torch=$torch_now extras=$EXTRAS" > "$stamp_file"
