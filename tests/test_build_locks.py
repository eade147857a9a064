"""A build or load killed mid-way never hangs a later run (lightning_dos/host/build_locks.py).

torch's JIT takes a ``lock`` file in an op's build folder for every load of a DeepSpeed op and removes it only on a
clean release; a process killed in between left it, and every later load waited for it for ever, printing nothing.
Here real processes hold torch's real ``FileBaton`` and are killed with SIGKILL: a lock no process holds is removed
in one line, one a live process holds is waited for in one line naming it (and removed should it die meanwhile),
one on a filesystem other hosts may share is never removed. The end-to-end tests kill a run while it compiles the
engine's host kernel and holds DeepSpeed's CPU Adam op's lock mid-load, then run the ``lightning-dos`` command, or a
user's own script with ``Trainer(strategy="dos")``, which go on.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from lightning_dos.engine import native
from lightning_dos.host import build_locks, extensions
from tests.helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]
CPU_ADAM = "DeepSpeed's CPU Adam op"
#: The line a removed lock is said in (a regular expression; ``lock``: the lock's path, escaped).
_REMOVED = (
    f"lightning-dos: removed the build lock of {re.escape(CPU_ADAM)} \\({{lock}}\\): the build or load that took it "
    "[0-9]+ s ago ended without releasing it, and no process on this host holds it"
)


def said(text: str) -> list[str]:
    """The messages in ``text``, each wrapped message (later lines indented) joined into one line; every line of
    this project's messages is at most 80 columns wide (but one word alone: a long path)."""
    messages = [message for message in re.split(r"\n(?! )", text.strip()) if message]
    for message in messages:
        if message.startswith("lightning-dos:"):
            assert all(len(line) <= 80 or " " not in line.strip() for line in message.splitlines()), message
    return [message.replace("\n  ", " ") for message in messages]


def _file_baton_source() -> str:
    """torch's own ``torch/utils/file_baton.py`` (found without importing torch: a child holding it starts fast)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    return str(Path(spec.origin).parent / "utils" / "file_baton.py")


_HOLD_THE_BATON = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("file_baton", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
baton = module.FileBaton(sys.argv[2])
assert baton.try_acquire()
print("held", flush=True)
sys.stdin.readline()  # until told to release (or killed)
baton.release()
print("released", flush=True)
"""


def _holder(lock: Path) -> subprocess.Popen:
    """A process holding torch's ``FileBaton`` on ``lock``, as a build or load holds it."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_BATON, _file_baton_source(), str(lock)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "held\n"
    return child


def _kill(child: subprocess.Popen) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.wait()


def _waiting(lock: Path, out: io.StringIO) -> threading.Thread:
    thread = threading.Thread(target=build_locks.clear_or_wait, args=(lock, CPU_ADAM, out), daemon=True)
    thread.start()
    return thread


def _until(condition, seconds: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_lock_its_holder_left_when_killed_is_removed_in_one_line(tmp_path: Path) -> None:
    lock = tmp_path / "cpu_adam" / "lock"
    holder = _holder(lock)
    state = build_locks.inspect(lock)
    assert (state.kind, state.holders) == ("held", (holder.pid,))
    _kill(holder)
    assert lock.exists() and build_locks.inspect(lock).kind == "abandoned"
    out = io.StringIO()
    build_locks.clear_or_wait(lock, CPU_ADAM, out)
    assert not lock.exists()
    (line,) = said(out.getvalue())
    assert re.fullmatch(_REMOVED.format(lock=re.escape(str(lock))), line), line
    build_locks.clear_or_wait(lock, CPU_ADAM, out)  # no lock: nothing to say
    assert len(said(out.getvalue())) == 1


def test_ranks_finding_the_same_abandoned_lock_remove_it_once(tmp_path: Path) -> None:
    """Each rank of a run checks the lock before its own load: they take turns (flock on the op's folder), the
    first removes it, the others find none."""
    lock = tmp_path / "cpu_adam" / "lock"
    _kill(_holder(lock))
    outs = [io.StringIO() for _ in range(3)]
    ranks = [_waiting(lock, out) for out in outs]
    for rank in ranks:
        rank.join(10)
    assert not any(rank.is_alive() for rank in ranks) and not lock.exists()
    lines = [line for out in outs for line in said(out.getvalue())]
    assert len(lines) == 1 and re.fullmatch(_REMOVED.format(lock=re.escape(str(lock))), lines[0]), lines


def test_a_held_lock_is_waited_for_quietly_until_released(tmp_path: Path) -> None:
    lock = tmp_path / "cpu_adam" / "lock"
    holder = _holder(lock)
    out = io.StringIO()
    waiter = _waiting(lock, out)
    time.sleep(1.0)
    assert waiter.is_alive() and lock.exists()
    assert holder.stdin is not None and holder.stdout is not None
    holder.stdin.write("\n")
    holder.stdin.flush()
    assert holder.stdout.readline() == "released\n"
    waiter.join(10)
    assert not waiter.is_alive() and out.getvalue() == "", "a short wait, as a rank loading the op makes, says nothing"
    holder.wait()


def test_a_wait_says_for_whom_and_how_long_and_takes_over_when_the_holder_is_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build_locks, "QUIET_S", 0.5)
    monkeypatch.setattr(build_locks, "INSPECT_S", 0.2)
    lock = tmp_path / "cpu_adam" / "lock"
    holder = _holder(lock)
    out = io.StringIO()
    waiter = _waiting(lock, out)
    _until(lambda: out.getvalue().endswith("\n"))
    line = said(out.getvalue())[0]
    assert line.startswith(f"lightning-dos: waiting for process {holder.pid} (python") and f"{lock}" in line, line
    assert f"which has held the build lock of {CPU_ADAM} for " in line and line.endswith(
        f"building or loading the op ({lock})"
    )
    assert waiter.is_alive() and lock.exists()
    _kill(holder)
    waiter.join(10)
    assert not waiter.is_alive() and not lock.exists()
    lines = said(out.getvalue())
    assert len(lines) == 2 and re.fullmatch(_REMOVED.format(lock=re.escape(str(lock))), lines[1]), lines


def test_a_lock_on_a_filesystem_other_hosts_may_share_is_never_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build_locks, "QUIET_S", 0.0)
    monkeypatch.setattr(build_locks, "filesystem_type", lambda path: "nfs4")
    lock = tmp_path / "cpu_adam" / "lock"
    _kill(_holder(lock))
    state = build_locks.inspect(lock)
    assert state.kind == "unknown" and "its filesystem is nfs4" in state.why
    out = io.StringIO()
    waiter = _waiting(lock, out)
    _until(lambda: out.getvalue().endswith("\n"))
    time.sleep(build_locks.SETTLE_S + 0.5)
    assert waiter.is_alive() and lock.exists(), "not removed: a process on another host may hold it"
    (line,) = said(out.getvalue())
    assert line.startswith(f"lightning-dos: waiting for the build lock of {CPU_ADAM}, taken ")
    assert line.endswith(
        "its filesystem is nfs4, where a build on another host cannot be seen from here; "
        f"if no build of the op is running, remove {lock}"
    ), line
    lock.unlink()  # as the line says
    waiter.join(10)
    assert not waiter.is_alive()


def test_a_process_that_cannot_be_looked_into_keeps_a_lock_only_if_it_could_have_taken_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process of the lock's owner whose open files cannot be read (an undumpable one: ssh-agent, a set-user-ID
    program; made so here by refusing to list its /proc/PID/fd) could be the holder if it started before the lock
    was taken, and then the lock is not removed; one started later cannot have taken it."""
    lock = tmp_path / "cpu_adam" / "lock"
    _kill(_holder(lock))
    other = subprocess.Popen(["sleep", "60"])
    _until(lambda: Path(f"/proc/{other.pid}/cmdline").read_bytes() == b"sleep\x0060\x00")  # it runs sleep now
    listdir = os.listdir

    def refusing(path):  # noqa: ANN001, ANN202
        if str(path) == f"/proc/{other.pid}/fd":
            raise PermissionError(path)
        return listdir(path)

    monkeypatch.setattr(build_locks.os, "listdir", refusing)
    taken = lock.stat().st_mtime
    try:
        monkeypatch.setattr(build_locks, "started", lambda pid: taken - 5.0)
        state = build_locks.inspect(lock)
        assert (state.kind, state.why) == (
            "unknown",
            f"process {other.pid} (sleep 60), one of its owner's, cannot be looked into",
        ), state
        monkeypatch.setattr(build_locks, "started", lambda pid: taken + 5.0)
        assert build_locks.inspect(lock).kind == "abandoned"
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("torch_lock", ["FileBaton", "FileLock"])
def test_a_lock_file_is_cleared_only_where_torch_waits_on_its_existence(
    torch_lock: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Up to torch 2.13 the JIT waits while the lock file exists (``FileBaton``): a left one is removed, in one line.
    From torch 2.14 it holds an OS-level lock on the file (``FileLock``), which stays there between loads: left
    alone, nothing said. (This install's torch is whichever it is.)"""
    assert extensions.lock_files_block(cpp_extension.load) == (
        hasattr(cpp_extension, "FileBaton") and not hasattr(cpp_extension, "FileLock")
    )
    module = types.ModuleType(f"a_torch_with_{torch_lock}")
    setattr(module, torch_lock, object)
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def load(name: str, sources: list[str], build_directory: str) -> str:
        return "loaded"

    load.__module__ = module.__name__
    lock = tmp_path / "cpu_adam" / "lock"
    _kill(_holder(lock))  # a FileBaton's file a killed load left (or FileLock's, which any load leaves)
    assert extensions._announcing(load)("cpu_adam", [], build_directory=str(lock.parent)) == "loaded"
    about_locks = [line for line in said(capsys.readouterr().err) if "lock" in line]  # not the build notice
    if torch_lock == "FileBaton":
        assert not lock.exists() and len(about_locks) == 1 and "removed the build lock" in about_locks[0], about_locks
    else:
        assert lock.exists() and about_locks == [], about_locks


def test_partial_kernel_libraries_killed_builds_left_are_removed_an_hour_on(tmp_path: Path) -> None:
    fresh, old = tmp_path / "host_adam-0123.so.11.22.tmp", tmp_path / "host_adam-0123.so.33.44.tmp"
    fresh.write_bytes(b"x")
    old.write_bytes(b"x")
    os.utime(old, (time.time() - native.PARTIAL_LEFT_S - 60,) * 2)
    native.remove_partials_left(tmp_path)
    assert fresh.exists() and not old.exists()


# -- end to end: a run killed mid-build, then the next run --------------------------------------------------------

#: The killed run: it compiles the engine's host kernel (in a thread, as the engine would) while loading DeepSpeed's
#: CPU Adam op, holding torch's baton on its folder; both stop at the end of their compiler and ninja steps, told to
#: by the wrappers below, so the test kills it with both under way.
_KILLED_RUN = """
import threading
from deepspeed.ops.op_builder import CPUAdamBuilder
from lightning_dos.engine import native
threading.Thread(target=native.build, daemon=True).start()
CPUAdamBuilder().load(verbose=False)
"""

#: The next run, from a user's own script.
_USERS_SCRIPT = """
import lightning as L
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
from torch.utils.data import DataLoader, TensorDataset

import lightning_dos  # noqa: F401 - registers "dos"


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return DeepSpeedCPUAdam(self.parameters(), lr=1e-3)


trainer = L.Trainer(
    strategy="dos", accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(64, 32)), batch_size=8))
print("fitted", trainer.global_step)
"""

_COMMAND = [
    "-m", "lightning_dos", "fit", "--config", str(ROOT / "recipes" / "gpt-tiny.yaml"), "--trainer.max_steps", "2",
    "--trainer.limit_val_batches", "0", "--trainer.enable_checkpointing", "false", "--trainer.callbacks", "null",
    "--model.n_layer", "1", "--model.optimizer", "deepspeed_adamw", "--data.max_bytes", "100000",
]  # fmt: skip


def _wrappers(folder: Path) -> tuple[Path, Path]:
    """A C compiler for the kernel's builds here (cc at -O0: seconds, not the 5-40 s of -O3; the same build code
    otherwise) that, with HOLD_MARK set, waits once it has compiled, and a ``ninja`` that, with HOLD_MARK set, waits
    once it has run (torch's baton held): where each stops, it touches HOLD_MARK.<what>."""
    folder.mkdir()
    compiler, ninja = folder / "quick-cc", folder / "ninja"
    compiler.write_text(
        '#!/bin/sh\ncc "$@" -O0 || exit\n'
        'case "$*" in *host_adam.c*)\n'
        '  if [ -n "$HOLD_MARK" ]; then touch "$HOLD_MARK.kernel"; exec sleep 600; fi;;\nesac\n'
    )
    real = shutil.which("ninja")
    assert real is not None, "DeepSpeed's JIT needs ninja"
    ninja.write_text(
        f'#!/bin/sh\n{real} "$@" || exit\n'
        'if [ "$1" != --version ] && [ -n "$HOLD_MARK" ]; then touch "$HOLD_MARK.op"; exec sleep 600; fi\n'
    )
    for path in (compiler, ninja):
        path.chmod(0o755)
    return compiler, ninja


def _built_ops() -> Path:
    """This install's extensions folder, with DeepSpeed's CPU Adam and shared-memory ops built (once per install)."""
    from deepspeed.ops.op_builder import CPUAdamBuilder
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    CPUAdamBuilder().load(verbose=False)
    ShareMemCommBuilder().load(verbose=False)
    return Path(os.environ[extensions.ENV])


@pytest.mark.parametrize("next_run", ["command", "script"])
def test_the_run_after_one_killed_mid_build_goes_on(tmp_path: Path, next_run: str) -> None:
    """SIGKILL a process while it compiles the engine's host kernel and holds DeepSpeed's CPU Adam op's lock
    mid-load (its ninja step done), as a job's time limit kills a run; the next run, through the command or a user's
    script, says in one line it removed the lock, builds the kernel again and trains. (The ops are copies of this
    install's, so none is rebuilt: the kernel's is the build that matters, no lock in it.)"""
    ops = tmp_path / "extensions"
    for name in ("cpu_adam", "deepspeed_shm_comm"):
        shutil.copytree(_built_ops() / name, ops / name)  # copy2: the times ninja compares are kept
    compiler, ninja = _wrappers(tmp_path / "bin")
    cache = tmp_path / "cache"
    env = {**clean_env(), extensions.ENV: str(ops), "XDG_CACHE_HOME": str(cache), "CC": str(compiler)}
    mark = tmp_path / "held"
    killed = subprocess.Popen(
        [sys.executable, "-c", _KILLED_RUN],
        cwd=ROOT,
        env={**env, "HOLD_MARK": str(mark), "PATH": f"{ninja.parent}{os.pathsep}{env['PATH']}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its group: the compiler and ninja die with it, as a job's are
    )
    try:
        _until(
            lambda: killed.poll() is not None or (Path(f"{mark}.kernel").exists() and Path(f"{mark}.op").exists()), 240
        )
        assert killed.poll() is None, killed.stderr.read() if killed.stderr else ""
    finally:
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
    lock = ops / "cpu_adam" / "lock"
    kernels = cache / "lightning_dos" / "native"
    assert lock.exists() and build_locks.inspect(lock).kind == "abandoned"
    assert [p.name for p in kernels.iterdir() if p.suffix == ".tmp"] and not list(kernels.glob("*.so")), "mid-build"
    if next_run == "command":
        command = [sys.executable, *_COMMAND, "--trainer.default_root_dir", str(tmp_path / "run")]
    else:
        (tmp_path / "train.py").write_text(_USERS_SCRIPT)
        command = [sys.executable, str(tmp_path / "train.py")]
    start = time.monotonic()
    # From this checkout (a script's own folder comes first on its path: this checkout's package next, not an
    # installed one); a run that hangs is stopped at the timeout.
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said_lines = [line for line in said(done.stderr) if line.startswith("lightning-dos:")]
    about_locks = [line for line in said_lines if "lock" in line]
    if extensions.lock_files_block(cpp_extension.load):
        assert len(about_locks) == 1, done.stderr[-3000:]
        assert re.fullmatch(_REMOVED.format(lock=re.escape(str(lock))), about_locks[0]), about_locks
        assert not lock.exists(), "the lock gone"
    else:  # torch's lock is an OS-level one the kernel released when the holder died: nothing to say or remove
        assert not about_locks, about_locks
    assert any(line.startswith("lightning-dos: building the host update kernel") for line in said_lines), said_lines
    assert list(kernels.glob("*.so")), "the kernel built again"
    assert "building DeepSpeed" not in done.stderr, "the op was only loaded"
    if next_run == "script":
        assert done.stdout.splitlines()[-1] == "fitted 2", done.stdout
    print(f"next run ({next_run}): {time.monotonic() - start:.1f} s", *said_lines, sep="\n")
