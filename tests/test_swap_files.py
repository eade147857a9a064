"""One rank's swap file (lightning_dos/engine/swap_files.py) on a real directory, through DeepSpeed's async I/O op."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_dos.engine.swap_files import SwapFile, logical_block_size
from lightning_dos.errors import DOSConfigError
from lightning_dos.host import disk
from tests.helpers import block_4k_filesystem

AIO_MISSING = disk.aio_unavailable()
pytestmark = pytest.mark.skipif(
    AIO_MISSING is not None,
    reason="libaio-dev is not installed (scripts/nvme-tools.sh installs it as root); tests/test_disk.py checks that",
)
#: Uneven sizes: one element, a part that ends mid-block, one of exactly a block, a larger one.
RECORDS = [1, 1000, 1024, 70_001]


@pytest.fixture(scope="module")
def aio():  # noqa: ANN201
    return disk.load_aio()


@pytest.fixture(scope="module")
def blocks_4k(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A directory on a drive with 4096-byte logical blocks (a loop device), or a skip naming why there is none."""
    with block_4k_filesystem(tmp_path_factory.mktemp("drive")) as directory:
        if directory is None:
            pytest.skip("no 4096-byte-block drive: making one needs root, losetup, mkfs.ext4 and a loop device")
        yield directory


@pytest.mark.parametrize(
    ("master", "state", "states"),
    [(torch.float32, torch.float32, 2), (torch.bfloat16, torch.bfloat16, 2), (torch.bfloat16, torch.float32, 1)],
    ids=["adam-fp32", "adam-bf16", "lion-bf16-master"],
)
def test_records_come_back_bit_for_bit_through_any_slab_in_any_order(
    tmp_path: Path, aio, master, state, states
) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(0)
    written = [
        (
            torch.randn(n, generator=gen).to(master),
            tuple(torch.randn(n, generator=gen).to(state) for _ in range(states)),
        )
        for n in RECORDS
    ]
    swap = SwapFile(tmp_path, 0, RECORDS, master, state, states, slots=2, aio=aio)
    try:
        for record, (m, s) in enumerate(written):
            swap.store(record, m, s, slot=record % 2)
        # Read back in reverse, alternating slabs, one slab read while the other's record is written back again.
        for record in reversed(range(len(RECORDS))):
            slot = record % 2
            swap.slabs[slot].fill_(255)  # what the slab held before is not what the file holds
            swap.read(slot, record)
            if record + 1 < len(RECORDS):  # the other slab holds record + 1, read the iteration before
                swap.write(1 - slot, record + 1)
            swap.wait(slot)
            got_master, got_states = swap.views(slot, record)
            assert torch.equal(got_master, written[record][0])
            assert all(torch.equal(a, b) for a, b in zip(got_states, written[record][1], strict=True))
            swap.wait(1 - slot)
        for record, (m, s) in enumerate(written):  # records written back from slabs are unchanged
            got_master, got_states = swap.load(record, slot=1)
            assert torch.equal(got_master, m) and all(torch.equal(a, b) for a, b in zip(got_states, s, strict=True))
    finally:
        swap.close()


def test_each_rank_has_one_file_of_exactly_its_records_removed_at_close(tmp_path: Path, aio) -> None:  # noqa: ANN001
    ranks = [SwapFile(tmp_path, rank, RECORDS[: rank + 2], torch.float32, torch.float32, 2, 1, aio) for rank in (0, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lightning-dos-rank0.swap", "lightning-dos-rank1.swap"]
    for swap in ranks:
        assert swap.path.stat().st_size == swap.nbytes == sum(swap.record_bytes(n) for n in swap.numels)
        assert swap.nbytes % 4096 == 0
        swap.close()
        swap.close()  # again: nothing
    assert list(tmp_path.iterdir()) == []


def test_a_second_user_is_refused_and_a_file_left_behind_never_grows(tmp_path: Path, aio) -> None:  # noqa: ANN001
    left = tmp_path / "lightning-dos-rank0.swap"
    left.write_bytes(b"\0" * (8 << 20))  # a killed run's file, larger than this run needs
    swap = SwapFile(tmp_path, 0, RECORDS, torch.float32, torch.float32, 2, 1, aio)
    assert left.stat().st_size == swap.nbytes < 8 << 20
    with pytest.raises(DOSConfigError, match="lightning-dos-rank0.swap is in use by another process"):
        SwapFile(tmp_path, 0, RECORDS, torch.float32, torch.float32, 2, 1, aio)
    swap.read(0, 0)
    with pytest.raises(RuntimeError, match="in flight"):
        swap.read(0, 1)
    swap.close()
    again = SwapFile(tmp_path, 0, RECORDS, torch.float32, torch.float32, 2, 1, aio)  # free once closed
    again.close()
    assert list(tmp_path.iterdir()) == []


def test_a_swap_file_that_cannot_be_made_leaves_nothing_behind(tmp_path: Path, aio) -> None:  # noqa: ANN001
    """A record past what a file offset can hold (2^62 elements of 12 bytes): sizing the file fails on any
    filesystem, and the half-made swap file leaves no file and no lock behind."""
    with pytest.raises(OverflowError):
        SwapFile(tmp_path, 0, [1 << 62], torch.float32, torch.float32, 2, 1, aio)
    assert list(tmp_path.iterdir()) == []
    SwapFile(tmp_path, 0, RECORDS, torch.float32, torch.float32, 2, 1, aio).close()  # the lock was released


def test_a_slab_that_cannot_be_allocated_leaves_nothing_behind(tmp_path: Path, aio) -> None:  # noqa: ANN001
    """The second slab's page-locked allocation fails after its handle was made: the error raised is that one,
    and the first slab, the file and the lock are all given back."""

    class SecondSlabFails:
        def __init__(self) -> None:
            self.made = 0

        def aio_handle(self, *args):  # noqa: ANN002, ANN202
            handle = aio.aio_handle(*args)
            self.made += 1
            if self.made < 2:
                return handle

            class Refusing:
                def new_cpu_locked_tensor(self, *_: object) -> None:
                    raise MemoryError("no page-locked memory left")

                def free_cpu_locked_tensor(self, *_: object) -> None:
                    raise AssertionError("a slab never allocated was freed")

            return Refusing()

    with pytest.raises(MemoryError, match="no page-locked memory left"):
        SwapFile(tmp_path, 0, RECORDS, torch.float32, torch.float32, 2, 2, SecondSlabFails())
    assert list(tmp_path.iterdir()) == []
    SwapFile(tmp_path, 0, RECORDS, torch.float32, torch.float32, 2, 1, aio).close()  # the lock was released


#: Adam fp32 records of an odd number of pages: 1 page per part (3), 3 per part (9), 1 element (3), 18 per part (54).
ODD_PAGES = [1024, 3077, 1, 18_000]


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
def test_records_of_odd_page_counts_survive_any_io_thread_count_on_4096_byte_blocks(
    blocks_4k: Path, aio, threads: int
) -> None:  # noqa: ANN001
    """DeepSpeed's op splits a request evenly over its threads: each share must be whole 4096-byte blocks there, or
    O_DIRECT refuses it and the op says nothing (before the fix, 2 threads left records unread: silent corruption)."""
    assert logical_block_size(blocks_4k) == 4096
    gen = torch.Generator().manual_seed(threads)
    written = [
        (torch.randn(n, generator=gen), (torch.randn(n, generator=gen), torch.randn(n, generator=gen)))
        for n in ODD_PAGES
    ]
    swap = SwapFile(blocks_4k, 0, ODD_PAGES, torch.float32, torch.float32, 2, slots=2, aio=aio, threads=threads)
    try:
        for record in range(len(ODD_PAGES)):
            nbytes = swap.record_bytes(ODD_PAGES[record])
            assert swap.offsets[record] % 4096 == 0 and nbytes % (4096 * threads) == 0, "a share is not aligned"
        for record, (m, s) in enumerate(written):
            swap.store(record, m, s, slot=record % 2)
        for record, (m, s) in enumerate(written):
            swap.slabs[1].fill_(255)
            got_master, got_states = swap.load(record, slot=1)
            assert torch.equal(got_master, m) and all(torch.equal(a, b) for a, b in zip(got_states, s, strict=True))
    finally:
        swap.close()


def test_a_request_the_drive_refuses_is_an_error_never_silence(blocks_4k: Path, aio) -> None:  # noqa: ANN001
    """Records laid out for 512-byte blocks on a 4096-byte-block drive: O_DIRECT refuses their requests (EINVAL),
    which DeepSpeed's op does not report. The swap file's start-up check finds the refused write; made without it,
    a read's canaries find the refused read, as an error naming the record and the file."""
    with pytest.raises(DOSConfigError, match="its drive refused the swap file's writes"):  # found at start-up
        SwapFile(blocks_4k, 0, [1, 1000], torch.float32, torch.float32, 2, slots=1, aio=aio, align=512)
    assert list(blocks_4k.iterdir()) == [blocks_4k / "lost+found"]
    swap = SwapFile(blocks_4k, 0, [1, 1000], torch.float32, torch.float32, 2, 1, aio, align=512, verify=False)
    try:
        assert swap.offsets[1] % 4096 != 0
        # Blocks written once (a drive answers a read of blocks never written with zeros, aligned or not).
        swap.path.write_bytes(b"\x07" * swap.nbytes)
        swap.store(1, torch.ones(1000), (torch.zeros(1000), torch.zeros(1000)))  # refused, and nothing says so
        with pytest.raises(OSError, match=r"reading record 1 of .*lightning-dos-rank0.swap failed"):
            swap.load(1)
    finally:
        swap.close()


def test_a_block_size_that_is_not_whole_drive_blocks_is_refused(tmp_path: Path, aio) -> None:  # noqa: ANN001
    with pytest.raises(DOSConfigError, match=r"aio.block_size=6144 is not valid .* multiple of its drive's 4096-byte"):
        SwapFile(tmp_path, 0, RECORDS, torch.float32, torch.float32, 2, 1, aio, block_size=6144)
    assert list(tmp_path.iterdir()) == []
