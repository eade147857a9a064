"""A byte-level corpus with no download: local text, by default the Python standard library's own source.

Every machine that runs Python has the standard library's ``*.py`` files, so the default recipe trains on
real text anywhere, offline. Tokens are bytes (vocabulary 256). Training samples are fixed-length windows
at positions drawn from a seed; validation uses consecutive windows from the last ``val_fraction`` of
the corpus, which training never sees.
"""

from __future__ import annotations

import codecs
import sysconfig
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

SNIFF_BYTES = 8192


def _looks_binary(chunk: bytes) -> bool:
    if b"\0" in chunk:
        return True
    try:
        codecs.getincrementaldecoder("utf-8")().decode(chunk, final=False)
    except UnicodeDecodeError:
        return True
    return False


def _is_text(path: Path) -> bool:
    with path.open("rb") as f:
        return not _looks_binary(f.read(SNIFF_BYTES))


def stdlib_sources() -> list[Path]:
    """The standard library's Python sources on this machine, sorted (so the corpus is deterministic).

    Installed packages can live inside the standard library's folder (pyenv puts ``site-packages`` there);
    they are not the standard library and differ between machines, so they are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    installed = ("site-packages", "dist-packages")
    return sorted(p for p in root.rglob("*.py") if not any(part in installed for part in p.relative_to(root).parts))


def _collect_files(path: str | None) -> list[Path]:
    if path is None:
        sources = stdlib_sources()
        if not sources:
            raise FileNotFoundError(
                f"ByteCorpusDataModule path=None uses the Python standard library's sources, but there are no *.py "
                f"files under {sysconfig.get_paths()['stdlib']}; give path= a text file or a folder of text files"
            )
        return sources
    root = Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"ByteCorpusDataModule path={path!r} does not exist; give a text file, a folder of text files, "
            "or no path (the Python standard library's sources)"
        )
    if root.is_file():
        if root.stat().st_size == 0:
            raise ValueError(f"ByteCorpusDataModule path={path!r} is an empty file; give a file with text in it")
        if not _is_text(root):
            raise ValueError(
                f"ByteCorpusDataModule path={path!r} is a binary file (NUL bytes or not UTF-8); give a text file"
            )
        return [root]
    files = [f for f in sorted(root.rglob("*")) if f.is_file() and f.stat().st_size > 0 and _is_text(f)]
    if not files:
        raise ValueError(f"ByteCorpusDataModule path={path!r} holds no non-empty text files; give a folder with text")
    return files


def load_corpus(path: str | None, max_bytes: int) -> torch.Tensor:
    """Concatenate the corpus files (up to ``max_bytes``) into one uint8 tensor."""
    chunks, total = [], 0
    for file in _collect_files(path):
        data = file.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class _Windows(Dataset):
    """(x, y) pairs: ``seq_len`` bytes starting at each position, and the same shifted by one."""

    def __init__(self, tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.starts, self.seq_len = tokens, starts, seq_len

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        chunk = self.tokens[s : s + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class ByteCorpusDataModule(L.LightningDataModule):
    """Byte-level language-modelling data from local text.

    Args:
        path: a text file or a folder of text files; None uses the Python standard library's ``*.py``
            sources found at run time.
        seq_len: tokens (bytes) per sample; at most the model's ``block_size``.
        batch_size: samples per batch (per process).
        val_fraction: share of the corpus, taken from its end, held out for validation (0 < x < 1).
        max_bytes: read at most this many bytes of the corpus (keeps start-up fast).
        num_workers: DataLoader worker processes.
        seed: seed of the training window positions (the same seed gives the same batches).
    """

    def __init__(
        self,
        path: str | None = None,
        seq_len: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_bytes: int = 4_000_000,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("max_bytes", max_bytes)):
            if value < 1:
                raise ValueError(f"ByteCorpusDataModule {name}={value} is not valid; use a positive integer")
        if not 0.0 < val_fraction < 1.0:  # both parts must exist
            raise ValueError(f"ByteCorpusDataModule val_fraction={val_fraction} is not valid; use a number in (0, 1)")
        if num_workers < 0:
            raise ValueError(f"ByteCorpusDataModule num_workers={num_workers} is not valid; use 0 or more")
        self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
        self.val_fraction, self.max_bytes, self.num_workers, self.seed = val_fraction, max_bytes, num_workers, seed
        _collect_files(path)  # refuse a missing, empty or binary path now, before any work
        self.train_set: _Windows | None = None
        self.val_set: _Windows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        tokens = load_corpus(self.path, self.max_bytes)
        split = int(len(tokens) * (1 - self.val_fraction))
        train, val = tokens[:split], tokens[split:]
        for name, part in (("training", train), ("validation", val)):
            if len(part) < self.seq_len + 1:
                raise ValueError(
                    f"ByteCorpusDataModule: the corpus's {name} part has {len(part)} bytes, fewer than "
                    f"seq_len+1={self.seq_len + 1} (path={self.path!r}, max_bytes={self.max_bytes}, "
                    f"val_fraction={self.val_fraction}); use a seq_len of at most {max(0, len(part) - 1)}, "
                    "a larger corpus or max_bytes, or another val_fraction"
                )
        generator = torch.Generator().manual_seed(self.seed)
        n_train = max(1, len(train) // self.seq_len)
        starts = torch.randint(0, len(train) - self.seq_len, (n_train,), generator=generator)
        self.train_set = _Windows(train, starts, self.seq_len)
        self.val_set = _Windows(val, torch.arange(0, len(val) - self.seq_len, self.seq_len), self.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers, drop_last=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self.val_dataloader()
