"""Builds of native code: one extensions folder per DeepSpeed install, for the command, the scripts and the tests."""

from __future__ import annotations

import os
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
