"""How far the update's prediction is from the measured update, in a run's ``metrics.csv``.

The checks of issue 52 (point 3): after step ``--after``, the median of predicted over measured within
``--median``x, and every logged step within ``--every``x. By default the update phase the trainer waits for
(``dos/update_s``, from backward's end to the batch's end) against its prediction made when the step was planned
(``dos/update_predicted_s``: the engine's loop as the performance model predicts it under ``overlap="off"``, none of it
under ``"forward"`` and ``"auto"``, where the step returns while the loop runs on, and the step's own work around it
as measured over the steps before). ``--engine`` compares the engine's update loop (``dos/engine_update_s``) with the
performance model's prediction of it (``dos/engine_update_predicted_s``) instead.

    python bench/prediction.py runs/gpt-tiny                       # the README's main job, after it ran
    python bench/prediction.py runs/gpt-tiny/csv/version_0/metrics.csv --engine
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

#: (predicted, measured) columns: the update phase, and with ``--engine`` the engine's update loop.
PHASE = ("dos/update_predicted_s", "dos/update_s")
ENGINE = ("dos/engine_update_predicted_s", "dos/engine_update_s")


@dataclass(frozen=True)
class PredictionCheck:
    """Predicted over measured update time of every logged step of a run.

    Attributes:
        ratios: (step, predicted / measured) of every row with both, in step order.
        after: the first step the median counts (steps after it).
        columns: the (predicted, measured) columns compared.
    """

    ratios: list[tuple[int, float]]
    after: int
    columns: tuple[str, str] = PHASE

    @property
    def median(self) -> float:
        """Median of the ratios after :attr:`after` (NaN when there are none)."""
        late = [r for step, r in self.ratios if step > self.after]
        return statistics.median(late) if late else float("nan")

    @property
    def worst(self) -> tuple[int, float]:
        """The step whose prediction is furthest off, either way, and that factor (>= 1)."""
        return max(((step, max(r, 1 / r)) for step, r in self.ratios), key=lambda pair: pair[1])

    def failures(self, median_within: float, every_within: float) -> list[str]:
        """What fails the checks, in words (empty when both hold)."""
        if not self.ratios:
            return [f"no row has both {self.columns[0]} and {self.columns[1]}"]
        found = []
        if not 1 / median_within <= self.median <= median_within:
            found.append(
                f"median predicted/measured after step {self.after} is {self.median:.3g}, not within {median_within}x"
            )
        found += [
            f"step {step}: predicted/measured {r:.3g}, not within {every_within}x"
            for step, r in self.ratios
            if not 1 / every_within <= r <= every_within
        ]
        return found


def metrics_csv(path: Path) -> Path:
    """``path`` itself when it is a file, else the newest ``metrics.csv`` under it (a run's root or csv folder)."""
    if path.is_file():
        return path
    found = sorted(path.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no metrics.csv under {path}")
    return found[-1]


def check(path: Path, after: int = 50, columns: tuple[str, str] = PHASE) -> PredictionCheck:
    """Read the ratios of the ``metrics.csv`` at (or under) ``path``; ``columns`` names the (predicted, measured)
    columns (:data:`PHASE` or :data:`ENGINE`)."""
    predicted, measured = columns
    ratios = []
    with metrics_csv(path).open() as handle:
        for row in csv.DictReader(handle):
            if row.get(predicted) and row.get(measured) and float(row[measured]) > 0:
                ratios.append((int(row["step"]), float(row[predicted]) / float(row[measured])))
    return PredictionCheck(sorted(ratios), after, columns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a metrics.csv, or a run folder holding one")
    parser.add_argument("--after", type=int, default=50, help="the median counts steps after this one")
    parser.add_argument("--median", type=float, default=1.5, help="the median must be within this factor")
    parser.add_argument("--every", type=float, default=4.0, help="every logged step must be within this factor")
    parser.add_argument(
        "--engine",
        action="store_true",
        help=f"compare {ENGINE[1]} with {ENGINE[0]} (default: {PHASE[1]} with {PHASE[0]})",
    )
    parser.add_argument("--rows", type=int, default=1, help="at least this many logged steps must have both")
    args = parser.parse_args(argv)
    result = check(args.path, args.after, ENGINE if args.engine else PHASE)
    if result.ratios:
        step, factor = result.worst
        print(
            f"{result.columns[0]} / {result.columns[1]}, {len(result.ratios)} steps; median after step {args.after}: "
            f"{result.median:.3g}; furthest off: {factor:.3g}x at step {step}"
        )
    problems = result.failures(args.median, args.every)
    if 0 < len(result.ratios) < args.rows:
        problems.append(f"only {len(result.ratios)} logged steps have both columns, not {args.rows}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
