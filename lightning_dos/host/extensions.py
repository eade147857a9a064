"""One folder of torch extensions (DeepSpeed's JIT-built ops) per DeepSpeed install.

DeepSpeed builds its ops (the shared-memory collectives of CPU runs, the async I/O and pinned-memory ops of the
NVMe tier) into torch's extensions folder, one subfolder per op name, and rebuilds an op (a minute to several)
whenever its build file names other sources. Two installs (two checkouts, each with its own ``.venv``) sharing
torch's one folder, ``~/.cache/torch_extensions``, therefore rebuild each other's ops on every run. Each install
gets its own folder instead, ``~/.cache/torch_extensions/deepspeed-<install>``, keyed by where DeepSpeed is
installed; a ``TORCH_EXTENSIONS_DIR`` already set is kept. The ``lightning-dos`` command sets it as it starts, and
the test suite before it imports anything.

Only the standard library is imported here: the command's help and its other subcommands stay fast.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

#: The environment variable torch reads for its extensions folder.
ENV = "TORCH_EXTENSIONS_DIR"


def own_extensions_dir() -> str | None:
    """This DeepSpeed install's extensions folder, or None where DeepSpeed is not installed."""
    spec = importlib.util.find_spec("deepspeed")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return None
    install = hashlib.sha256(os.path.dirname(spec.origin).encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions", f"deepspeed-{install}")


def use_own_extensions_dir() -> str | None:
    """Point ``TORCH_EXTENSIONS_DIR`` at :func:`own_extensions_dir` unless it is set; return the folder in effect.

    Call it before the first op is built (torch reads the variable at each build); None where neither is known.
    """
    if ENV not in os.environ:
        folder = own_extensions_dir()
        if folder is not None:
            os.environ[ENV] = folder
    return os.environ.get(ENV)


def main() -> int:
    """``python -m lightning_dos.host.extensions``: print the folder in effect (for shell scripts)."""
    folder = use_own_extensions_dir()
    if folder is None:
        print("DeepSpeed is not installed", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
