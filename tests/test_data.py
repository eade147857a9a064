"""The byte corpus: real text with no download, deterministic, and clear errors for bad paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_dos.data import ByteCorpusDataModule, stdlib_sources


def test_default_corpus_is_the_standard_library_source() -> None:
    sources = stdlib_sources()
    assert len(sources) > 100
    assert not any("site-packages" in p.parts for p in sources), "installed packages are not the standard library"
    dm = ByteCorpusDataModule(seq_len=32, batch_size=4, max_bytes=200_000)
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]), "targets are the inputs shifted by one"
    text = bytes(x[0].tolist()).decode("utf-8", errors="replace")
    assert any(ch.isalpha() for ch in text)


def test_split_and_batches_are_deterministic() -> None:
    def first_batches(seed: int) -> list[torch.Tensor]:
        dm = ByteCorpusDataModule(seq_len=16, batch_size=2, max_bytes=50_000, seed=seed)
        dm.setup("fit")
        it = iter(dm.train_dataloader())
        return [next(it)[0] for _ in range(3)]

    assert all(torch.equal(a, b) for a, b in zip(first_batches(0), first_batches(0)))
    assert not all(torch.equal(a, b) for a, b in zip(first_batches(0), first_batches(1)))


def test_a_user_file_or_folder(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world " * 100)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 50)  # binary files in a folder are skipped
    for path in (tmp_path / "a.txt", tmp_path):
        dm = ByteCorpusDataModule(path=str(path), seq_len=8, batch_size=2, val_fraction=0.1)
        dm.setup("fit")
        x, _ = next(iter(dm.val_dataloader()))
        assert b"\0" not in bytes(x.flatten().tolist())


@pytest.mark.parametrize(
    ("make", "kwargs", "fragment"),
    [
        (None, {"path": "/no/such/corpus"}, "path='/no/such/corpus' does not exist"),
        ("empty_file", {}, "empty file"),
        ("empty_dir", {}, "no non-empty text files"),
        ("binary", {}, "binary file"),
        (None, {"seq_len": 0}, "seq_len=0"),
        (None, {"batch_size": -1}, "batch_size=-1"),
        (None, {"val_fraction": 1.0}, "val_fraction=1.0"),
        (None, {"num_workers": -2}, "num_workers=-2"),
    ],
)
def test_bad_data_settings_are_refused(tmp_path: Path, make, kwargs, fragment) -> None:  # noqa: ANN001
    if make == "empty_file":
        (tmp_path / "e.txt").touch()
        kwargs = {"path": str(tmp_path / "e.txt")}
    elif make == "empty_dir":
        kwargs = {"path": str(tmp_path)}
    elif make == "binary":
        (tmp_path / "b.dat").write_bytes(bytes(range(256)) * 8)
        kwargs = {"path": str(tmp_path / "b.dat")}
    with pytest.raises((ValueError, FileNotFoundError), match=fragment.replace("(", r"\(").replace(")", r"\)")):
        ByteCorpusDataModule(**kwargs)


def test_corpus_shorter_than_a_sequence_is_refused_at_setup(tmp_path: Path) -> None:
    (tmp_path / "short.txt").write_text("tiny")
    dm = ByteCorpusDataModule(path=str(tmp_path / "short.txt"), seq_len=64)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        dm.setup("fit")
