"""Known noise of the pinned torch, DeepSpeed and Lightning, silenced narrowly so that real problems show.

Each entry below names one message and the module it is attributed to; nothing else is filtered, so a
user's own warnings (and any other warning of these libraries) still show. The strategy installs this
when it is built (and the CLI before it builds its parser); installing again adds only what is missing
(``warnings.catch_warnings`` blocks, as pytest runs each test in, drop filters on exit).

- ``torch.distributed.reduce_scatter_tensor`` / ``all_gather_into_tensor`` are deprecated in torch 2.13
  (DeepSpeed 0.19 calls them every step; the replacement is DeepSpeed's to make).
- ``isinstance(treespec, LeafSpec)`` is deprecated in torch 2.13 (Lightning 2.6's own pytree copy).
- DeepSpeed's "Setting accelerator to CPU" on a machine without a GPU (Lightning already says "GPU
  available: False"), and its "... deepspeed_shm_comm_op built successfully" on every start.
- torch's "No CUDA runtime is found, using CUDA_HOME='...'" under a CUDA build of torch on a machine without a GPU
  (``torch.utils.cpp_extension`` logs it as it is imported, which DeepSpeed's op builder does on every CPU run).
- Lightning's litlogger tip and its "TPU available: False" line.
- Lightning's note that it skips its default model summary because the CLI gave it
  :class:`~lightning_dos.integration.callbacks.DOSModelSummary` (a user's own summary callback is still named).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import TextIO

#: (category, message regex, module regex) of each warning silenced.
KNOWN_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        r"torch\.distributed\.c10d_logger",
    ),
    (
        FutureWarning,
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        r"lightning\.pytorch\.utilities\._pytree",
    ),
)

#: (logger name, message prefix) of each log record dropped.
KNOWN_LOG_LINES: tuple[tuple[str, str], ...] = (
    ("DeepSpeed", "Setting accelerator to CPU."),
    # DeepSpeed's advice on SSD wear, one line of 365 characters: a run on the NVMe tier says it in 80 columns
    # (host.disk.ssd_wear_notice).
    ("DeepSpeed", "Offloading to NVMe can generate heavy write traffic"),
    # A CUDA build of torch without a GPU: torch.utils.cpp_extension finds a CUDA_HOME (the CUDA_HOME variable, nvcc
    # on the PATH, /usr/local/cuda) while torch.cuda.is_available() is False, and logs this as it is imported.
    ("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME="),
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud logging"),
    ("lightning.pytorch.utilities.rank_zero", "TPU available: False"),
    (
        "lightning.pytorch.utilities.rank_zero",
        "Trainer already configured with model summary callbacks: "
        "[<class 'lightning_dos.integration.callbacks.summary.DOSModelSummary'>]",
    ),
)

#: Lines DeepSpeed prints to stdout (``print``) that carry nothing for a user, as prefix and suffix.
KNOWN_PRINTS: tuple[tuple[str, str], ...] = (("DeepSpeed ", " built successfully"),)


class _DropKnownLines(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def install() -> None:
    """Silence the known warnings and log lines; adds nothing that is in place already (call it freely)."""
    for category, message, module in KNOWN_WARNINGS:
        present = any(
            f[0] == "ignore" and f[1] is not None and f[1].pattern == message and f[2] is category
            for f in warnings.filters
        )
        if not present:
            warnings.filterwarnings("ignore", message=message, category=category, module=module)
    by_logger: dict[str, tuple[str, ...]] = {}
    for name, prefix in KNOWN_LOG_LINES:
        by_logger[name] = (*by_logger.get(name, ()), prefix)
    for name, prefixes in by_logger.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownLines) for f in log.filters):
            log.addFilter(_DropKnownLines(prefixes))


def is_known_print(line: str) -> bool:
    """True for a line DeepSpeed prints that :data:`KNOWN_PRINTS` drops."""
    text = line.strip()
    return any(text.startswith(head) and text.endswith(tail) for head, tail in KNOWN_PRINTS)


class _LineFilter:
    """A text stream that passes everything on to ``target`` except whole lines :func:`is_known_print` drops."""

    def __init__(self, target: TextIO) -> None:
        self.target = target
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not is_known_print(line):
                self.target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.target.flush()

    def close(self) -> None:
        if self.pending and not is_known_print(self.pending):
            self.target.write(self.pending)
        self.pending = ""


#: DeepSpeed's advice on SSD wear, logged once per process at its async I/O op's first write.
SSD_WEAR_NOTICE = ("DeepSpeed", "Offloading to NVMe can generate heavy write traffic")


@contextlib.contextmanager
def log_line_dropped(logger: str, prefix: str) -> Iterator[None]:
    """Run a block with ``logger``'s records that start with ``prefix`` dropped (a one-off measurement's writes
    are not what a notice about sustained writes is for). A notice logged once per process is then gone for the
    whole process: use it only where that process does nothing else the notice is for."""
    drop = _DropKnownLines((prefix,))
    log = logging.getLogger(logger)
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


@contextlib.contextmanager
def known_prints_dropped() -> Iterator[None]:
    """Run a block with the known DeepSpeed prints removed from ``sys.stdout`` (everything else passes)."""
    stream = _LineFilter(sys.stdout)
    with contextlib.redirect_stdout(stream):  # type: ignore[type-var]
        try:
            yield
        finally:
            stream.close()


__all__ = [
    "KNOWN_LOG_LINES",
    "KNOWN_PRINTS",
    "KNOWN_WARNINGS",
    "install",
    "is_known_print",
    "known_prints_dropped",
    "log_line_dropped",
]
