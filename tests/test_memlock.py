"""The locked-memory limit (``RLIMIT_MEMLOCK``): a run whose NVMe tier could not ``mlock`` its buffers is refused in
the pre-flight with one line naming the limit and the fix, where DeepSpeed's allocator would abort the process."""

from __future__ import annotations

import ctypes
import mmap
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lightning_dos.errors import DOSConfigError
from lightning_dos.host.memlock import CAP_IPC_LOCK, LockLimit, check_lock_limit, lock_limit
from lightning_dos.integration.nvme_tier import CALIBRATION_BYTES, check_locked_memory
from lightning_dos.integration.preflight import HostFigure
from tests.helpers import clean_env

MIB = 1 << 20
#: A non-root container's default limit.
CONTAINER_LIMIT = 8 * MIB


def test_the_limit_is_read_with_the_capability_and_what_is_locked() -> None:
    status = "Name:\tpython\nVmLck:\t    2048 kB\nCapEff:\t000001fffeffffff\n"
    read = lock_limit(status)
    assert read.exempt and read.locked == 2 * MIB
    assert (read.soft, read.hard) == tuple(
        None if n == resource.RLIM_INFINITY else n for n in resource.getrlimit(resource.RLIMIT_MEMLOCK)
    )
    assert not lock_limit("CapEff:\t000001fffeffbfff\n").exempt  # bit 14, CAP_IPC_LOCK, cleared
    assert lock_limit("").locked == 0 and not lock_limit("").exempt
    # Read from this thread's own status: the pages it locks, and its own capability (capabilities are per thread).
    _assert_reads_what_this_process_locks()
    _assert_reads_this_threads_capability()


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _ipc_lock_effective(drop: bool = False) -> bool | None:
    """Whether the calling thread has CAP_IPC_LOCK in its effective set, from ``capget`` (after taking it out of
    that set when ``drop``: this thread only, and needing no privilege); None where the calls are refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()  # _LINUX_CAPABILITY_VERSION_3, this thread
    if libc.capget(ctypes.byref(header), data) != 0:
        return None
    if drop:
        data[0].effective &= ~(1 << CAP_IPC_LOCK)
        if libc.capset(ctypes.byref(header), data) != 0 or libc.capget(ctypes.byref(header), data) != 0:
            return None
    return bool(data[0].effective >> CAP_IPC_LOCK & 1)


def _assert_reads_what_this_process_locks() -> None:
    """Four pages locked with ``mlock`` show in ``locked`` (``VmLck``), exactly, and leave it when unlocked; where
    the limit allows them the lock succeeds, and where it does not it fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    for call in (libc.mlock, libc.munlock, libc.munmap):
        call.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 4 * mmap.PAGESIZE
    pages = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert pages not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
    try:
        before = lock_limit()
        locked = libc.mlock(pages, size) == 0
        assert locked == before.allows(size), (before, ctypes.get_errno())
        if locked:
            assert lock_limit().locked == before.locked + size
            assert libc.munlock(pages, size) == 0
        assert lock_limit().locked == before.locked
    finally:
        libc.munmap(pages, size)


def _assert_reads_this_threads_capability() -> None:
    """``exempt`` is the calling thread's CAP_IPC_LOCK, as ``capget`` gives it: in a thread that dropped it, False
    (the process's other threads keep theirs)."""
    mine = _ipc_lock_effective()
    seen: list[tuple[bool | None, LockLimit]] = []
    thread = threading.Thread(target=lambda: seen.append((_ipc_lock_effective(drop=True), lock_limit())))
    thread.start()
    thread.join()
    dropped, limit = seen[0]
    if mine is None or dropped is None:
        pytest.skip("this process may not read or drop its capabilities (capget/capset refused)")
    assert lock_limit().exempt is mine
    assert dropped is False and limit.exempt is False, limit
    assert _ipc_lock_effective() is mine, "the dropping thread's capability was its own"


def test_the_check_refuses_past_the_limit_in_one_line_naming_it_and_the_fix() -> None:
    tight = LockLimit(soft=CONTAINER_LIMIT, hard=CONTAINER_LIMIT)
    check_lock_limit(CONTAINER_LIMIT, "buffers", setting="s", limit=tight)  # exactly the limit: fine
    for allowed in (
        LockLimit(soft=CONTAINER_LIMIT, hard=CONTAINER_LIMIT, exempt=True),  # CAP_IPC_LOCK: the limit does not apply
        LockLimit(soft=None, hard=None),  # unlimited
    ):
        check_lock_limit(1 << 40, "buffers", setting="s", limit=allowed)
    with pytest.raises(DOSConfigError) as refused:
        check_lock_limit(64 * MIB, "the buffers", setting="offload_optimizer.device='nvme'", limit=tight)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("offload_optimizer.device='nvme': the buffers need 64.0 MiB")
    assert "RLIMIT_MEMLOCK (`ulimit -l`) is 8192 KiB" in message and "lacks CAP_IPC_LOCK" in message
    assert "`ulimit -l unlimited` as root: the hard limit is 8192 KiB" in message
    assert "--ulimit memlock=-1" in message and "--cap-add IPC_LOCK" in message
    # What is locked already counts; a hard limit that allows it needs no privilege to reach.
    held = LockLimit(soft=64 * MIB, hard=None, locked=4 * MIB)
    with pytest.raises(DOSConfigError, match=r"already locked.*`ulimit -l 69632`, which the hard limit, unlimited"):
        check_lock_limit(64 * MIB, "the buffers", setting="s", limit=held)


def test_the_tier_counts_the_measurement_or_the_slabs_with_deepspeeds_native_pins() -> None:
    figure = HostFigure(items=[("DeepSpeed fp32 gradients", 20 * MIB), ("engine slabs", 500 * MIB)], backend="torch")
    roomy = LockLimit(soft=CALIBRATION_BYTES, hard=CALIBRATION_BYTES)
    check_locked_memory(CALIBRATION_BYTES // 2, figure, limit=roomy)  # the measurement's buffer is the most at once
    with pytest.raises(DOSConfigError, match=r"need 65\.0 MiB.*or smaller staging slabs \(a smaller sub_group_size\)"):
        check_locked_memory(CALIBRATION_BYTES + MIB, figure, limit=roomy)
    with pytest.raises(DOSConfigError, match=r"need 64\.0 MiB .*RLIMIT_MEMLOCK") as refused:
        check_locked_memory(MIB, figure, limit=LockLimit(soft=CONTAINER_LIMIT, hard=CONTAINER_LIMIT))
    assert "smaller staging slabs" not in str(refused.value)  # the measurement alone is past the limit
    # DS_PIN_MEMORY_BACKEND=native: DeepSpeed's buffers are mlock'ed too, beside the slabs (the engine's are not).
    figure.backend = "native"
    beside = r"slabs \(44\.0 MiB beside DeepSpeed's 20\.0 MiB under DS_PIN_MEMORY_BACKEND=native\) need 64\.0"
    with pytest.raises(DOSConfigError, match=beside):
        check_locked_memory(44 * MIB, figure, limit=LockLimit(soft=CALIBRATION_BYTES - 1, hard=None))
    check_locked_memory(44 * MIB, figure, limit=roomy)


#: The child: CAP_IPC_LOCK dropped from this thread's sets (capset; dropping needs no privilege), the limit lowered
#: to a container's default, then a tiny fit with all of the state on NVMe.
CHILD = """
import ctypes, resource, sys

class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

libc = ctypes.CDLL(None, use_errno=True)
header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3
ok = libc.capget(ctypes.byref(header), data) == 0
if ok:
    data[0].effective &= ~(1 << 14)
    data[0].permitted &= ~(1 << 14)
    ok = libc.capset(ctypes.byref(header), data) == 0
if not ok:
    print("CANNOT DROP CAP_IPC_LOCK: errno", ctypes.get_errno())
    sys.exit(5)
resource.setrlimit(resource.RLIMIT_MEMLOCK, ({limit}, {limit}))

import lightning as L
from lightning_dos import DeepOptimizerStatesStrategy
from lightning_dos.errors import DOSConfigError
from lightning_dos.host.memlock import lock_limit
from tests.helpers import TinyLM, loader, trainer

assert not lock_limit().exempt
steps = []

class Counting(L.Callback):
    def on_train_batch_end(self, *args):
        steps.append(1)

strategy = DeepOptimizerStatesStrategy(
    offload_optimizer_device="nvme", nvme_path={path!r}, host_memory_budget=0, sub_group_size=700
)
try:
    trainer(strategy, steps=2, callbacks=[Counting()]).fit(TinyLM(), loader())
except DOSConfigError as error:
    print("REFUSED:", error, flush=True)
    print("STEPS:", len(steps))
    sys.exit(3)
print("TRAINED:", len(steps))
"""


def test_a_run_that_cannot_lock_its_slabs_is_refused_before_any_work(tmp_path: Path) -> None:
    """A real fit, in a process without CAP_IPC_LOCK under a container's 8 MiB limit: refused with one line naming
    RLIMIT_MEMLOCK, the process exits by itself (DeepSpeed's allocator would abort it, SIGABRT), and no step ran,
    nothing was left in ``nvme_path``."""
    script = CHILD.format(limit=CONTAINER_LIMIT, path=str(tmp_path))
    env = {**clean_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 5:
        pytest.skip(f"no process may drop CAP_IPC_LOCK here ({done.stdout.strip()}); the check's own tests run")
    console = done.stdout + done.stderr
    assert done.returncode != -signal.SIGABRT, console[-3000:]
    assert done.returncode == 3, console[-3000:]
    refused = [line for line in done.stdout.splitlines() if line.startswith("REFUSED:")]
    assert len(refused) == 1 and "RLIMIT_MEMLOCK (`ulimit -l`) is 8192 KiB" in refused[0], console[-3000:]
    # The pre-flight's line (before the drive is measured), not the measurement's own guard.
    assert refused[0].startswith("REFUSED: offload_optimizer.device='nvme': the drive's measurement (64 MiB)")
    assert "`ulimit -l unlimited`" in refused[0]
    assert "STEPS: 0" in done.stdout
    assert list(tmp_path.iterdir()) == []
