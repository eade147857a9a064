"""Builds of native code: one extensions folder per DeepSpeed install (for the command, the scripts and the tests),
and a notice before each build of a DeepSpeed op, none when it is built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dos.host import extensions
from tests.helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]


def test_each_deepspeed_install_has_its_own_extensions_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(extensions.ENV, raising=False)
    folder = extensions.use_own_extensions_dir()
    assert folder == os.environ[extensions.ENV] == extensions.own_extensions_dir()
    assert Path(folder).parent == tmp_path / ".cache" / "torch_extensions"
    assert Path(folder).name.startswith("deepspeed-") and len(Path(folder).name) == len("deepspeed-") + 12
    monkeypatch.setenv(extensions.ENV, str(tmp_path / "mine"))
    assert extensions.use_own_extensions_dir() == str(tmp_path / "mine"), "a folder already set is kept"


def test_the_command_gives_its_run_the_installs_folder(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_dos.commands.main import main

    monkeypatch.delenv(extensions.ENV, raising=False)
    assert main(["plan", "--help"]) == 0
    capsys.readouterr()
    assert os.environ.get(extensions.ENV) == extensions.own_extensions_dir()


def test_the_scripts_ask_the_package_for_the_folder() -> None:
    """scripts/bench.sh runs Python without the command: it exports what the package names (scripts/train.sh
    runs the command, which sets it itself)."""
    env = {k: v for k, v in clean_env().items() if k != extensions.ENV}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_dos.host.extensions"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == extensions.own_extensions_dir()
    assert "-m lightning_dos.host.extensions" in (ROOT / "scripts" / "bench.sh").read_text()


def _shm_op() -> tuple[str, list[str], Path]:
    """DeepSpeed's shared-memory op (every CPU run builds it), built in this install's folder: name, sources, folder."""
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    builder = ShareMemCommBuilder()
    builder.load(verbose=False)  # built already by any CPU run of this install; else built now, once
    sources = [os.path.abspath(builder.deepspeed_src_path(path)) for path in builder.sources()]
    return builder.name, sources, Path(os.environ[extensions.ENV]) / builder.name


def test_a_build_is_pending_only_where_torch_would_compile(tmp_path: Path) -> None:
    import deepspeed

    name, sources, folder = _shm_op()
    assert extensions.pending_build(name, sources, folder) is None, "built here: loaded, not announced"
    assert extensions.pending_build(name, sources, tmp_path / "empty") == "once per install"
    # The same build made by another install: its build file names that install's sources, which ninja rebuilds.
    other = tmp_path / "other" / name
    shutil.copytree(folder, other)
    here = str(Path(deepspeed.__file__).parent)
    ninja = other / "build.ninja"
    ninja.write_text(ninja.read_text().replace(here, "/another/venv/site-packages/deepspeed"))
    assert extensions.pending_build(name, sources, other) == "again: another install's build was there"
    # This install's build, older than its sources.
    older = tmp_path / "older" / name
    shutil.copytree(folder, older)
    os.utime(older / f"{name}.so", (0, 0))
    assert extensions.pending_build(name, sources, older) == "again: its sources changed"


_LOAD_THE_SHM_OP = """
import sys
from lightning_dos.host.extensions import announce_op_builds
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
announce_op_builds()
try:
    ShareMemCommBuilder().load(verbose=False)
    print("loaded", file=sys.stderr)
except Exception as error:
    print("not built:", type(error).__name__, file=sys.stderr)
"""


def test_deepspeeds_op_builds_announce_themselves_first_and_loads_say_nothing(tmp_path: Path) -> None:
    """A real JIT load of DeepSpeed's shared-memory op, in a process of its own: into an empty folder it announces
    the build before torch starts it (here torch stops at once: the compiler named by CXX fails), in one notice of
    at most 80 columns a line; from this install's folder, where it is built, it loads without a word."""
    _shm_op()
    env = {**clean_env(), extensions.ENV: str(tmp_path / "empty"), "CXX": shutil.which("false") or "/bin/false"}
    command = [sys.executable, "-c", _LOAD_THE_SHM_OP]
    fresh = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = fresh.stderr.splitlines()
    assert lines[-1] == "not built: CalledProcessError", fresh.stderr[-3000:]
    notice = [line for line in lines if line.startswith("lightning-dos:")]
    assert notice == ["lightning-dos: building DeepSpeed's shared-memory op for CPU collectives"], fresh.stderr
    follows = lines[lines.index(notice[0]) + 1]
    assert follows.startswith("  (once per install, about ") and follows.endswith(" ...") and len(follows) <= 80
    env[extensions.ENV] = os.environ[extensions.ENV]
    del env["CXX"]  # torch asks the compiler its version before every JIT load, built or not
    built = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert built.stderr.splitlines()[-1] == "loaded", built.stderr[-3000:]
    assert "lightning-dos" not in built.stderr
