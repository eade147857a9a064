"""One folder of torch extensions (DeepSpeed's JIT-built ops) per DeepSpeed install.

DeepSpeed builds its ops (the shared-memory collectives of CPU runs, the async I/O and pinned-memory ops of the
NVMe tier) into torch's extensions folder, one subfolder per op name, and rebuilds an op (a minute to several)
whenever its build file names other sources. Two installs (two checkouts, each with its own ``.venv``) sharing
torch's one folder, ``~/.cache/torch_extensions``, therefore rebuild each other's ops on every run. Each install
gets its own folder instead, ``~/.cache/torch_extensions/deepspeed-<install>``, keyed by where DeepSpeed is
installed; a ``TORCH_EXTENSIONS_DIR`` already set is kept. The ``lightning-dos`` command sets it as it starts, and
the test suite before it imports anything.

An op build that will really happen (torch's JIT finds no library built from these sources in the op's folder)
announces itself first, in one notice (:mod:`lightning_dos.engine.announce`): :func:`announce_op_builds`, which
also has each load find out first whether the op's build lock was left by a killed build or load, and remove it or
say what it waits for (:mod:`lightning_dos.host.build_locks`).

Only the standard library is imported here: the command's help and its other subcommands stay fast.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_dos.engine.announce import about, announce_build
from lightning_dos.host import build_locks

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


#: DeepSpeed's ops this project's runs build: name -> (what, why, CPU seconds of its compiler jobs, low and high).
#: The figures are from the builds' ninja logs on a busy 2-core machine (async I/O: 12 jobs; shared memory: 2;
#: pinned memory: 3), and from the first NVMe run, which took about ten minutes for async I/O and pinned memory;
#: CPU Adagrad's and Lion's from their ninja logs on the same machine (Adagrad: 43 s, one job; Lion: 155-390 s).
OPS: dict[str, tuple[str, str, tuple[float, float]]] = {
    "async_io": ("DeepSpeed's async I/O op", "for the NVMe tier", (300.0, 900.0)),
    "pin_memory": ("DeepSpeed's pinned-memory op", "for the NVMe tier", (30.0, 100.0)),
    "deepspeed_shm_comm": ("DeepSpeed's shared-memory op", "for CPU collectives", (80.0, 220.0)),
    "cpu_adam": ("DeepSpeed's CPU Adam op", "for DeepSpeedCPUAdam", (60.0, 240.0)),
    "cpu_adagrad": ("DeepSpeed's CPU Adagrad op", "for DeepSpeedCPUAdagrad", (30.0, 120.0)),
    "cpu_lion": ("DeepSpeed's CPU Lion op", "for DeepSpeedCPULion", (120.0, 400.0)),
}
_UNKNOWN_OP_SECONDS = (60.0, 600.0)
_ANNOUNCES = "_lightning_dos_announces_builds"


def pending_build(name: str, sources: Sequence[str], build_directory: str | os.PathLike[str]) -> str | None:
    """Why torch's JIT will compile op ``name`` from ``sources`` in ``build_directory``, or None when its build there
    is current (torch then only loads it).

    torch writes the op's ``build.ninja`` naming its sources and runs ninja, which recompiles when a command changed
    (other sources: another install's build) or a source is newer than its output.
    """
    folder = Path(build_directory)
    library, ninja = folder / f"{name}.so", folder / "build.ninja"
    if not library.is_file() or not ninja.is_file():
        return "once per install"
    # ninja escapes spaces and colons in paths with "$".
    text = ninja.read_text(errors="replace").replace("$ ", " ").replace("$:", ":")
    paths = [os.path.abspath(source) for source in sources]
    if any(path not in text for path in paths):
        return "again: another install's build was there"
    built = library.stat().st_mtime
    if any(os.path.exists(path) and os.path.getmtime(path) > built for path in paths):
        return "again: its sources changed"
    return None


def _build_directory(name: str) -> str | None:
    try:
        from torch.utils.cpp_extension import _get_build_directory  # torch's own choice, TORCH_EXTENSIONS_DIR first

        return _get_build_directory(name, verbose=False)
    except (ImportError, TypeError, OSError):  # another torch: no notice rather than a wrong one
        return None


def lock_files_block(load: Any) -> bool:
    """Whether the JIT ``load`` comes from waits on the mere existence of a ``lock`` file (torch's ``FileBaton``,
    up to torch 2.13), which a killed build leaves behind. From torch 2.14 it holds an OS-level lock on the file
    instead (``FileLock``: the kernel releases it when the holder dies, and the file stays): nothing to clear, and
    a lock file left there is no sign of a killed build."""
    module = sys.modules.get(getattr(load, "__module__", ""))
    return module is not None and hasattr(module, "FileBaton") and not hasattr(module, "FileLock")


def _announcing(load: Any) -> Any:
    """torch's ``cpp_extension.load``, first clearing or waiting for the op's build lock where a lock file blocks
    (:func:`lock_files_block`; :func:`build_locks.clear_or_wait`: torch would wait for a lock a killed build left for
    ever, without a word), then announcing a build that :func:`pending_build` says will happen."""
    clears_locks = lock_files_block(load)

    @functools.wraps(load)
    def announcing_load(*args: Any, **kwargs: Any) -> Any:
        name = kwargs.get("name", args[0] if args else None)
        sources = kwargs.get("sources", args[1] if len(args) > 1 else None)
        if isinstance(name, str) and isinstance(sources, (list, tuple)):
            folder = kwargs.get("build_directory") or _build_directory(name)
            what, why, seconds = OPS.get(name, (f"DeepSpeed's {name} op", "for this run", _UNKNOWN_OP_SECONDS))
            if folder and clears_locks:
                build_locks.clear_or_wait(os.path.join(folder, build_locks.LOCK_NAME), what)
            when = pending_build(name, sources, folder) if folder else None
            if when is not None:
                announce_build(what, why, when, about(seconds, jobs=len(sources)))
        return load(*args, **kwargs)

    return announcing_load


def announce_op_builds() -> None:
    """Have DeepSpeed's JIT op builds announce themselves (:func:`pending_build`), and each of its JIT op loads
    first clear or wait for a build lock a killed build or load left (:mod:`~lightning_dos.host.build_locks`);
    installs once per process.

    DeepSpeed's ``OpBuilder.jit_load`` (every op it builds, for its own modules and ours) calls torch's
    ``cpp_extension.load`` once it has checked the op can be built here: that call is wrapped, for its duration.
    Imports DeepSpeed: call it where a run is about to use it. The known noise of an op's load (:mod:`quiet`: torch's
    "No CUDA runtime is found" as DeepSpeed's op builder imports ``torch.utils.cpp_extension``) is silenced first.
    """
    from lightning_dos.host import quiet

    quiet.install()
    from deepspeed.ops.op_builder.builder import OpBuilder

    if getattr(OpBuilder.jit_load, _ANNOUNCES, False):
        return
    jit_load = OpBuilder.jit_load

    @functools.wraps(jit_load)
    def announcing_jit_load(self: Any, verbose: bool = True) -> Any:
        import torch.utils.cpp_extension as cpp_extension

        load = cpp_extension.load
        cpp_extension.load = _announcing(load)  # DeepSpeed imports it by name inside jit_load, after the checks
        try:
            return jit_load(self, verbose)
        finally:
            cpp_extension.load = load

    setattr(announcing_jit_load, _ANNOUNCES, True)
    OpBuilder.jit_load = announcing_jit_load  # type: ignore[method-assign]


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
