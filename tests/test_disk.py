"""The NVMe drive under nvme_path (lightning_dos/host/disk.py): bad input refused before any work, with the setting
named; the drive's bandwidth measured through DeepSpeed's async I/O op, on a real directory."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from lightning_dos.errors import DOSConfigError
from lightning_dos.host import disk

#: Whether DeepSpeed's async I/O op can be built here (libaio-dev; scripts/setup.sh installs it when run as root).
AIO_MISSING = disk.aio_unavailable()


def test_a_writable_directory_passes_and_keeps_no_probe(tmp_path: Path) -> None:
    assert disk.check_nvme_path(tmp_path, needed_bytes=1 << 20) == tmp_path.resolve()
    assert list(tmp_path.iterdir()) == []


def test_each_bad_nvme_path_is_refused_naming_the_setting_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DOSConfigError, match=r"nvme_path='.*nope' does not exist: create it"):
        disk.check_nvme_path(tmp_path / "nope")
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(DOSConfigError, match="is not a directory"):
        disk.check_nvme_path(afile)
    # /sys refuses new files even to root (CI runs as root, for whom a chmod'ed directory stays writable).
    with pytest.raises(DOSConfigError, match=r"cannot create a file there \(Permission denied\)"):
        disk.check_nvme_path("/sys")
    with pytest.raises(
        DOSConfigError, match=r"GB free; the optimizer state that would live there needs 1000000000\.00 GB"
    ):
        disk.check_nvme_path(tmp_path, needed_bytes=10**18)
    assert list(tmp_path.iterdir()) == [afile]  # no probe left behind


def test_a_filesystem_that_refuses_o_direct_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every filesystem of this machine accepts O_DIRECT (tmpfs too, on its kernel), so the refusal is what
    Linux returns for one that does not (EINVAL at open), raised in place of the real open: the substitute for a
    filesystem this machine lacks. The real probe passes in the test above."""
    real_open = os.open

    def refusing_open(path, flags, *args):  # noqa: ANN001, ANN202
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(disk.os, "open", refusing_open)
    with pytest.raises(DOSConfigError, match=r"its filesystem refuses O_DIRECT .* \(ext4, xfs\)"):
        disk.check_nvme_path(tmp_path, setting="offload_optimizer.nvme_path")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(AIO_MISSING is not None, reason="libaio-dev is not installed: the next test checks the error")
def test_the_drive_is_measured_through_deepspeeds_async_io(tmp_path: Path) -> None:
    rates = disk.measure_disk(tmp_path, 8 << 20, repeats=1)
    # Any real drive (or the page cache behind it) moves more than 10 MB/s and less than 1 TB/s.
    assert 1e7 < rates.read_bps < 1e12 and 1e7 < rates.write_bps < 1e12
    assert list(tmp_path.iterdir()) == []  # the measuring file is removed
    with pytest.raises(ValueError, match="multiple of 4096"):
        disk.measure_disk(tmp_path, 1000)
    # Reading and writing at once (the rate of an update whose reads and writes overlap; bench/run.py's floor).
    assert 1e7 < disk.measure_mixed(tmp_path, 8 << 20, repeats=1) < 1e12
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="multiple of 4096"):
        disk.measure_mixed(tmp_path, 1000)


def test_without_libaio_the_error_names_the_package_and_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where libaio-dev is missing this is the real answer; where it is installed (CI installs it), DeepSpeed's
    compatibility check is made to answer as it does without it: the substitute for a machine without it."""
    if AIO_MISSING is None:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    reason = disk.aio_unavailable()
    assert reason is not None and "libaio-dev" in reason and "apt-get install libaio-dev" in reason
    with pytest.raises(DOSConfigError, match="offload_optimizer.device='nvme': DeepSpeed's async I/O op needs libaio"):
        disk.load_aio()


@pytest.mark.skipif(AIO_MISSING is not None, reason="libaio-dev is not installed: the next test checks the error")
def test_calibrate_measures_the_drive_into_the_profile_that_plan_reads(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    import json

    from lightning_dos.commands.main import main
    from lightning_dos.planning.profiles import load_profile

    out, drive = tmp_path / "me.yaml", tmp_path / "drive"
    drive.mkdir()
    assert main(["calibrate", "--device", "cpu", "--out", str(out), "--nvme-path", str(drive), "--nvme-bytes",
                 str(8 << 20)]) == 0  # fmt: skip
    assert "NVMe drive" in capsys.readouterr().out
    _, meta = load_profile(out)
    assert meta["nvme"]["read_bps"] > 0 and meta["nvme"]["write_bps"] > 0 and list(drive.iterdir()) == []
    assert main(["plan", "--params", "1e8", "--profile", str(out), "--json"]) == 0
    nvme = json.loads(capsys.readouterr().out)["nvme"]
    assert nvme["read_gbs"] == pytest.approx(meta["nvme"]["read_bps"] / 1e9)


def test_calibrate_refuses_a_bad_nvme_path_before_measuring_anything(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from lightning_dos.commands.main import main

    out = tmp_path / "me.yaml"
    assert main(["calibrate", "--device", "cpu", "--out", str(out), "--nvme-path", str(tmp_path / "nope")]) == 2
    assert "--nvme-path=" in capsys.readouterr().err and not out.exists()
    assert main(["calibrate", "--out", str(out), "--nvme-path", str(tmp_path), "--nvme-bytes", "1000"]) == 2
    assert "--nvme-bytes 1000: give a positive multiple of 4096" in capsys.readouterr().err and not out.exists()


def test_an_arch_specific_cuda_target_does_not_stop_the_async_io_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU node's TORCH_CUDA_ARCH_LIST="9.0a" stopped the NVMe tier on an H200 (2026-11-28): DeepSpeed's JIT
    builder reads each entry as two integers. Its own parser, run here as a CUDA build would run it, refuses the
    list as given and takes it once load_aio's context has made it readable; the user's value comes back after."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder  # the CUDA accelerator's builder, on any machine

    def deepspeed_reads_the_list() -> None:
        builder = AsyncIOBuilder()
        builder.jit_mode, builder._jit_arch_list = True, None  # as in AsyncIOBuilder.jit_load, before nvcc's flags
        builder.compute_capability_args()

    assert disk.deepspeed_arch_list("9.0a") == "9.0"
    assert disk.deepspeed_arch_list("8.0 9.0a;9.0 10.0f+PTX") == "8.0;9.0;10.0+PTX"
    assert disk.deepspeed_arch_list("sm_90") is None
    for value in ("9.0a", "8.0;9.0a+PTX", "sm_90"):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", value)
        with pytest.raises(ValueError, match="invalid literal for int"):
            deepspeed_reads_the_list()
        with disk.arch_list_deepspeed_parses():
            if value == "sm_90":
                assert "TORCH_CUDA_ARCH_LIST" not in os.environ  # DeepSpeed reads the visible GPUs instead
            else:
                deepspeed_reads_the_list()
        assert os.environ["TORCH_CUDA_ARCH_LIST"] == value


@pytest.mark.skipif(AIO_MISSING is not None, reason="libaio-dev is not installed (scripts/nvme-tools.sh installs it)")
def test_the_nvme_ops_can_be_built_ahead_and_a_built_install_says_nothing() -> None:
    """`python -m lightning_dos.host.disk` (scripts/nvme-tools.sh runs it, as scripts/test.sh does first): the tier's
    ops built into this install's folder (announced, where one is not built yet); run again, it is quick and silent."""
    import subprocess
    import sys

    for _ in range(2):
        command = [sys.executable, "-m", "lightning_dos.host.disk"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=os.environ)
        assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout + done.stderr == ""
