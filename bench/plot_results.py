"""Draw bench/RESULTS.md's summary table, iteration time per system on each measured machine, into a PNG.

    python bench/plot_results.py                                  # bench/RESULTS.md -> docs/results.png
    python bench/plot_results.py --results FILE --out PNG

The figures come from RESULTS.md's "Summary: iteration time per system" table, whose every row names the entry
(the start of a `## ` heading) it repeats a figure of; a figure its entry does not hold is refused, so the
summary cannot drift from the measurements. Needs matplotlib (a dependency of the project).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The heading of the summary table in RESULTS.md.
SUMMARY = "## Summary: iteration time per system"
COLUMNS = ("hardware", "model", "system", "iteration s", "entry")


@dataclass(frozen=True)
class Row:
    """One measured iteration time: a system on a machine and model, and the entry that recorded it."""

    hardware: str
    model: str
    system: str
    seconds: float
    figure: str  # as written, so that the entry can be searched for it
    entry: str


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _sections(text: str) -> dict[str, str]:
    """Each ``## `` heading of RESULTS.md and the text under it, up to the next one."""
    sections: dict[str, str] = {}
    heading = None
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line[3:]
            sections[heading] = ""
        elif heading is not None:
            sections[heading] += line + "\n"
    return sections


def read_summary(text: str) -> list[Row]:
    """The summary table's rows, each checked against its entry. ValueError names what is missing or wrong."""
    sections = _sections(text)
    summary = next((body for heading, body in sections.items() if f"## {heading}".startswith(SUMMARY)), None)
    if summary is None:
        raise ValueError(f"no {SUMMARY!r} section")
    lines = [line for line in summary.splitlines() if line.startswith("|")]
    if len(lines) < 3 or tuple(_cells(lines[0])) != COLUMNS:
        raise ValueError(f"the summary's table must have the columns {' | '.join(COLUMNS)}")
    rows = []
    for line in lines[2:]:
        hardware, model, system, figure, entry = _cells(line)
        try:
            seconds = float(figure)
        except ValueError:
            raise ValueError(f"summary row {line!r}: {figure!r} is not a number of seconds") from None
        matches = [body for heading, body in sections.items() if heading.startswith(entry)]
        if len(matches) != 1:
            raise ValueError(f"summary row {line!r}: {len(matches)} entries begin with {entry!r} (need exactly one)")
        if figure not in matches[0]:
            raise ValueError(f"summary row {line!r}: the entry {entry!r} does not hold {figure}")
        rows.append(Row(hardware, model, system, seconds, figure, entry))
    if not rows:
        raise ValueError("the summary's table has no rows")
    return rows


def plot(rows: list[Row], out: Path) -> Path:
    """One panel per machine and model, a bar per system, each labelled with its seconds (and, after the first,
    its speed-up over the first)."""
    from matplotlib.figure import Figure  # no pyplot: no display, no global state

    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.hardware, row.model), []).append(row)
    fig = Figure(figsize=(7.5, 1.0 + 1.25 * len(groups)), layout="constrained")
    axes = fig.subplots(len(groups), 1, squeeze=False)[:, 0]
    colours = {}
    for ax, ((hardware, model), members) in zip(axes, groups.items(), strict=True):
        names = [row.system.replace("`", "") for row in members]  # Markdown code marks, not text
        for name in names:
            colours.setdefault(name, f"C{len(colours)}")
        ax.barh(range(len(members)), [row.seconds for row in members], color=[colours[n] for n in names])
        ax.set_yticks(range(len(members)), names)
        ax.invert_yaxis()  # the table's order, top down
        ax.set_title(f"{hardware}: {model}", fontsize=10, loc="left")
        ax.set_xlim(0, max(row.seconds for row in members) * 1.3)
        for i, row in enumerate(members):
            # Each later system's speed-up over the panel's first (stock), as the README's table gives it.
            ratio = f" ({members[0].seconds / row.seconds:.2f}x)" if i else ""
            ax.text(row.seconds, i, f" {row.figure} s{ratio}", va="center", fontsize=9)
        ax.tick_params(labelsize=9)
    axes[-1].set_xlabel("iteration time, s (median per training step; lower is better)")
    fig.suptitle("Iteration time per system, as measured (bench/RESULTS.md)", fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md", help="the results file")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results.png", help="the PNG to write")
    args = parser.parse_args(argv)
    try:
        rows = read_summary(args.results.read_text())
    except (OSError, ValueError) as error:
        print(f"plot_results: {args.results}: {error}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_results: needs matplotlib (a dependency of the project): pip install -e .", file=sys.stderr)
        return 2
    print(f"wrote {plot(rows, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
