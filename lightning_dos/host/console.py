"""Printing rich tables and text with no spaces at line ends.

rich pads a centred title or caption, and each line it wraps, with spaces to the console's width; in a log
file or a pipe those spaces stay (and show in a diff, or as a line one column too wide when COLUMNS is
set to a terminal's width less one). What the commands and the end-of-fit summary print goes through
:func:`trimmed`; a command's own sentences through :func:`wrapped`.
"""

from __future__ import annotations

import contextlib
import textwrap
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def trimmed(console: Any = None) -> Iterator[Any]:
    """A rich console whose output in the block is written, when the block ends, with each line's trailing spaces
    removed.

    Args:
        console: the rich console to print with (its width and file); if None, a new ``Console(highlight=False)``:
            the terminal's width, or ``COLUMNS``, or 80 in a pipe or a log file.

    Yields:
        the console: print with it inside the block.
    """
    from rich.console import Console

    console = Console(highlight=False) if console is None else console
    with console.capture() as captured:
        yield console
    console.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))
    console.file.flush()


def wrapped(text: str, width: int = 80) -> str:
    """``text`` wrapped at ``width`` columns, continued lines indented two spaces; a word longer than a line (a
    path) is kept whole, never broken."""
    return textwrap.fill(text, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


__all__ = ["trimmed", "wrapped"]
