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


def test_split_is_the_corpus_tail_and_windows_are_shifted_by_one(tmp_path: Path) -> None:
    text = bytes((i * 7 + i // 13) % 95 + 32 for i in range(5000))  # printable ASCII
    (tmp_path / "c.txt").write_bytes(text)
    dm = ByteCorpusDataModule(path=str(tmp_path / "c.txt"), seq_len=16, batch_size=4, val_fraction=0.2, seed=3)
    dm.setup("fit")
    corpus = torch.tensor(list(text))
    split = int(len(text) * 0.8)
    assert torch.equal(dm.train_set.tokens, corpus[:split].to(torch.uint8))
    assert torch.equal(dm.val_set.tokens, corpus[split:].to(torch.uint8)), "validation is the last 20%"
    for dataset, offset in ((dm.train_set, 0), (dm.val_set, split)):
        for i in range(len(dataset)):
            x, y = dataset[i]
            start = int(dataset.starts[i]) + offset
            assert torch.equal(x, corpus[start : start + 16])
            assert torch.equal(y, corpus[start + 1 : start + 17])
    # The same seed gives the same split and positions; another gives other positions.
    again = ByteCorpusDataModule(path=str(tmp_path / "c.txt"), seq_len=16, batch_size=4, val_fraction=0.2, seed=3)
    again.setup("fit")
    assert torch.equal(again.train_set.starts, dm.train_set.starts)
    other = ByteCorpusDataModule(path=str(tmp_path / "c.txt"), seq_len=16, batch_size=4, val_fraction=0.2, seed=4)
    other.setup("fit")
    assert not torch.equal(other.train_set.starts, dm.train_set.starts)
    assert torch.equal(other.val_set.starts, dm.val_set.starts)


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"seq_len": 0}, ["seq_len=0", "positive integer"]),
        ({"batch_size": 0}, ["batch_size=0", "positive integer"]),
        ({"max_bytes": 0}, ["max_bytes=0", "positive integer"]),
        ({"val_fraction": 0.0}, ["val_fraction=0.0", "(0, 1)"]),
        ({"val_fraction": -0.5}, ["val_fraction=-0.5", "(0, 1)"]),
    ],
)
def test_messages_name_the_setting_and_what_is_valid(kwargs, fragments) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as refused:
        ByteCorpusDataModule(**kwargs)
    for fragment in fragments:
        assert fragment in str(refused.value)


def test_binary_detection(tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 100)  # no NUL, not UTF-8
    with pytest.raises(ValueError, match="binary file"):
        ByteCorpusDataModule(path=str(tmp_path / "latin1.txt"))
    (tmp_path / "nul.txt").write_bytes(b"text\0text" * 100)
    with pytest.raises(ValueError, match="binary file"):
        ByteCorpusDataModule(path=str(tmp_path / "nul.txt"))
    only_binary = tmp_path / "bin"
    only_binary.mkdir()
    (only_binary / "x.bin").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="no non-empty text files"):
        ByteCorpusDataModule(path=str(only_binary))
    # UTF-8 text whose first chunk ends inside a multi-byte character is still text.
    (tmp_path / "utf8.txt").write_text("a" + "é" * 10_000, encoding="utf-8")
    ByteCorpusDataModule(path=str(tmp_path / "utf8.txt"))


def test_validation_part_shorter_than_a_sequence_is_refused_naming_seq_len(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("x" * 1000)
    dm = ByteCorpusDataModule(path=str(tmp_path / "c.txt"), seq_len=64, val_fraction=0.05)
    with pytest.raises(ValueError, match="validation part has 50 bytes, fewer than seq_len\\+1=65"):
        dm.setup("fit")
