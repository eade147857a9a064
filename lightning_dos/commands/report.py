"""``lightning-dos report RUN_DIR [--out PNG]``: one PNG of a run's ``DOSMonitor`` metrics.

It finds the newest CSVLogger ``metrics.csv`` under ``RUN_DIR`` that holds ``dos/`` metrics (a later
``validate`` or ``test`` writes a newer log without them, which is passed over and named), says which it
drew, and draws, step by step: the loss (train
and validation), the learning rate of each param group, the forward/backward/update split of each step,
the update time against the performance model's prediction, memory per phase, PCIe throughput and bytes
per direction, the share of the update done on the device, and the run's medians. A panel whose metrics
the run did not log (or logged as zero throughout, like PCIe on a CPU run) is left out. Drawing needs
matplotlib, which installs with the package (a dependency, not an extra).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_dos.host.console import wrapped
from lightning_dos.integration.metrics import MEDIANS, PREFIX

#: matplotlib is a dependency: missing, the install was broken or partial (installed with --no-deps, or removed).
INSTALL_HINT = "pip install 'matplotlib>=3.8.0'"
PHASES = ("forward", "backward", "update")
PHASE_COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "update": "#55A868"}

#: A run's metrics: metric name -> (steps, values), sorted by step.
Series = dict[str, tuple[list[int], list[float]]]


def find_metrics(run_dir: Path) -> Path | None:
    """The newest ``metrics.csv`` anywhere under ``run_dir`` (CSVLogger writes one per version)."""
    found = _newest_first(run_dir)
    return found[0] if found else None


def _newest_first(run_dir: Path) -> list[Path]:
    # Newest by modification time; a higher version folder wins a tie.
    found = [p for p in run_dir.rglob("metrics.csv") if p.is_file()]
    return sorted(found, key=lambda p: (p.stat().st_mtime, str(p)), reverse=True)


def has_dos_metrics(series: Series) -> bool:
    """Whether ``series`` holds anything ``DOSMonitor`` logged (a fit with the callback)."""
    return any(key.startswith(PREFIX) for key in series)


def find_run(run_dir: Path) -> tuple[Path, Series, list[Path]] | None:
    """The newest ``metrics.csv`` under ``run_dir`` with ``dos/`` metrics, its metrics, and the newer logs without.

    A ``validate`` or ``test`` after the fit writes a newer CSVLogger version holding only validation metrics;
    the fit's log is the one to draw. None when no log under ``run_dir`` has ``dos/`` metrics.
    """
    passed_over: list[Path] = []
    for path in _newest_first(run_dir):
        series = read_metrics(path)
        if has_dos_metrics(series):
            return path, series, passed_over
        passed_over.append(path)
    return None


def read_metrics(path: Path) -> Series:
    """Every numeric column of a CSVLogger file, merged by step (the logger writes a row per call)."""
    by_step: dict[str, dict[int, float]] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            step_text = row.pop("step", "")
            if not step_text:
                continue
            step = int(float(step_text))
            for key, text in row.items():
                try:
                    value = float(text)
                except (TypeError, ValueError):
                    continue
                if math.isfinite(value):
                    by_step.setdefault(key, {})[step] = value
    series: Series = {}
    for key, values in by_step.items():
        steps = sorted(values)
        series[key] = (steps, [values[s] for s in steps])
    return series


def _unit(max_value: float, base: str) -> tuple[float, str]:
    """A factor and unit that keep GB-denominated values readable (a tiny test model moves kilobytes)."""
    for factor, prefix in ((1.0, "G"), (1e3, "M"), (1e6, "k")):
        if max_value * factor >= 1.0:
            return factor, prefix + base
    return 1e9, base.replace("B", "bytes", 1) if base.startswith("B") else base


def _get(series: Series, key: str) -> tuple[list[int], list[float]]:
    return series.get(f"dos/{key}", ([], []))


def _no_data(ax: Any, why: str) -> bool:
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])
    return False


NEEDS_ENGINE = "(logged with DeepOptimizerStatesStrategy only)"
PHASE_MARKERS = {"forward": "o", "backward": "s", "update": "^"}


def _memory(ax: Any, series: Series, kind: str) -> bool:
    """Allocated (peak line, band down to the lowest sample) or reserved (peak) memory of each phase."""
    keys = [f"mem_peak_{p}_gb" if kind == "allocated" else f"mem_reserved_peak_{p}_gb" for p in PHASES]
    values = [v for k in keys for v in _get(series, k)[1]]
    if not values:
        return _no_data(ax, "no memory metrics")
    factor, unit = _unit(max(values), "B")
    for phase, key in zip(PHASES, keys):
        steps, peak = _get(series, key)
        colour = PHASE_COLOURS[phase]
        # Distinct markers keep phases with equal values visible on top of each other.
        ax.plot(steps, [v * factor for v in peak], color=colour, marker=PHASE_MARKERS[phase], ms=4, label=phase)
        low_steps, low = _get(series, f"mem_low_{phase}_gb")
        if kind == "allocated" and low_steps == steps:
            ax.fill_between(steps, [v * factor for v in low], [v * factor for v in peak], color=colour, alpha=0.15)
    what = "allocated: peak, band down to lowest" if kind == "allocated" else "reserved: peak"
    ax.set_title(f"Memory per phase ({what})")
    ax.set_ylabel(f"{unit} (host RSS on CPU)")
    ax.legend(fontsize="small")
    return True


#: The two directions of a transfer metric (``dos/h2d_*``, ``dos/d2h_*``): the key's prefix, the legend's label, and
#: the side of the step its bars stand on.
DIRECTIONS = (("h2d", "host to device", -1), ("d2h", "device to host", 1))
#: What draws one direction: ``(steps, values in the chosen unit, label, side)``.
DrawDirection = Callable[[list[int], list[float], str, int], None]


def _per_direction(
    ax: Any, series: Series, metric: str, base: str, missing: str, draw: DrawDirection
) -> tuple[float, float] | None:
    """Draw ``dos/h2d_<metric>`` and ``dos/d2h_<metric>`` with ``draw(steps, values, label, side)`` (:data:`DIRECTIONS`)
    in one unit of ``base`` that keeps both readable (the y axis's label); return the unit's factor and the largest
    value logged (0 for none above it), or None, with ``missing`` on ``ax``, when neither direction was logged."""
    logged = [(_get(series, f"{prefix}_{metric}"), label, side) for prefix, label, side in DIRECTIONS]
    if not any(steps for (steps, _), _, _ in logged):
        _no_data(ax, f"{missing}\n{NEEDS_ENGINE}")
        return None
    largest = max([v for (_, values), _, _ in logged for v in values] + [0.0])
    factor, unit = _unit(largest, base)
    for (steps, values), label, side in logged:
        draw(steps, [v * factor for v in values], label, side)
    ax.set_ylabel(unit)
    return factor, largest


def _pcie(ax: Any, series: Series) -> bool:
    def line(steps: list[int], values: list[float], label: str, _side: int) -> None:
        ax.plot(steps, values, marker=".", label=label)

    if _per_direction(ax, series, "gbps", "B/s", "no transfer rates", line) is None:
        return False
    ax.set_title("PCIe throughput per direction (over the engine's update loop)")
    ax.set_ylim(bottom=0)
    util_steps, util = _get(series, "pcie_util")
    if util_steps:
        twin = ax.twinx()
        twin.plot(
            util_steps,
            [100 * v for v in util],
            color="0.55",
            ls="--",
            lw=1,
            zorder=0,
            label="utilisation (right)",
        )
        twin.set_ylabel("% of calibrated peak, both directions")
        twin.set_ylim(bottom=0)
        twin.legend(loc="upper right", fontsize="small")
    ax.legend(loc="upper left", fontsize="small")
    return True


def _bytes_moved(ax: Any, series: Series) -> bool:
    def bars(steps: list[int], values: list[float], label: str, side: int) -> None:
        ax.bar([s + side * 0.2 for s in steps], values, width=0.4, label=label)  # the two directions side by side

    drawn = _per_direction(ax, series, "gb", "B", "no bytes moved", bars)
    if drawn is None:
        return False
    factor, largest = drawn
    ax.set_ylim(top=1.3 * factor * max(largest, 1e-12))  # room for the legend above the bars
    ax.set_title("Bytes moved per update")
    ax.legend(fontsize="small")
    return True


def _breakdown(ax: Any, series: Series) -> bool:
    """The phase split as stacked bands over the steps, each labelled with its median share of the step."""
    parts = {phase: dict(zip(*_get(series, f"{phase}_s"))) for phase in PHASES}
    steps = sorted(set().union(*parts.values()))
    if not steps:
        return _no_data(ax, "no phase times")
    heights = [[parts[phase].get(s, 0.0) for s in steps] for phase in PHASES]
    totals = [sum(column) for column in zip(*heights)]
    labels = []
    for phase, values in zip(PHASES, heights):
        shares = [v / t for v, t in zip(values, totals) if t > 0]
        labels.append(f"{phase} ({statistics.median(shares):.0%} of the step)" if shares else phase)
    ax.stackplot(steps, heights, labels=labels, colors=[PHASE_COLOURS[p] for p in PHASES], alpha=0.85, step="mid")
    ax.set_title("Time per step, by phase (median share in the legend)")
    ax.set_ylabel("seconds")
    ax.set_ylim(0, 1.4 * max(totals + [1e-9]))  # room for the legend above the bands
    ax.legend(loc="upper right", fontsize="small")
    return True


def _loss(ax: Any, series: Series) -> bool:
    train_steps, train = series.get("train/loss", ([], []))
    val_steps, val = series.get("val/loss", ([], []))
    if not train_steps and not val_steps:
        return _no_data(ax, "no loss logged")
    if train_steps:
        ax.plot(train_steps, train, color="#4C72B0", lw=1.5, label="train/loss")
    if val_steps:
        ax.plot(val_steps, val, color="#C44E52", marker="o", lw=1.5, label="val/loss")
    ax.set_title("Loss")
    ax.set_ylabel("loss")
    ax.legend(fontsize="small")
    return True


def _learning_rates(ax: Any, series: Series) -> bool:
    keys = sorted(k for k in series if k.startswith("lr-"))
    if not keys:
        return _no_data(ax, "no learning rate logged")
    for key in keys:
        steps, values = series[key]
        ax.plot(steps, values, marker=".", label=key)
    ax.set_title("Learning rate of each param group")
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.legend(fontsize="small")
    return True


def _device_share(ax: Any, series: Series) -> bool:
    steps, share = _get(series, "gpu_fraction")
    if not steps:
        return _no_data(ax, f"no device share\n{NEEDS_ENGINE}")
    ax.step(steps, [100 * v for v in share], where="mid", marker=".", color="#8172B3")
    ax.set_ylim(-5, 105)
    ax.set_title("Share of the update done on the device")
    ax.set_ylabel("% of elements")
    return True


def _update_vs_predicted(ax: Any, series: Series) -> bool:
    steps, measured = _get(series, "update_s")
    if not steps:
        return _no_data(ax, "no update times")
    ax.plot(steps, measured, marker=".", color=PHASE_COLOURS["update"], label="update phase (measured)")
    loop_steps, loop = _get(series, "engine_update_s")
    if loop_steps:
        ax.plot(loop_steps, loop, marker=".", color="#C44E52", label="engine update loop (measured)")
    predictions = {"update_predicted_s": "update phase", "engine_update_predicted_s": "engine update loop"}
    if not _any(series, "dos/engine_update_predicted_s"):
        # A log from before the loop's prediction had a name of its own: there, update_predicted_s was the loop's.
        predictions = {"update_predicted_s": "engine update loop"}
    for key, what in predictions.items():
        pred_steps, predicted = _get(series, key)
        colour = "#C44E52" if what == "engine update loop" else PHASE_COLOURS["update"]
        if pred_steps:
            ax.plot(pred_steps, predicted, marker="x", ls="--", color=colour, label=f"{what} (predicted)")
    ax.set_title("Update time: measured and predicted")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    return True


def median_rows(series: Series) -> list[str]:
    """The medians panel's rows: one per metric logged, as the console's end-of-run summary shows them.

    A device-side metric (a bus rate, the device's share) that is zero throughout a run without an accelerator
    is left out, as the console leaves it out: it would read as a measurement of one. The log does not name the
    device; a run that pinned host memory (only CUDA pins) or moved bytes between the sides had one.
    """
    crossed_a_bus = _any(series, "dos/pinned_gb", "dos/h2d_gb", "dos/d2h_gb", nonzero=True)
    rows = []
    for metric in MEDIANS:
        values = _get(series, metric.key)[1]
        if not values or (metric.device and not crossed_a_bus and not any(values)):
            continue
        rows.append(f"{metric.label:<24}{statistics.median(values) * metric.scale:>12.4g} {metric.unit}")
    return rows


def _medians(ax: Any, series: Series) -> None:
    ax.axis("off")
    ax.set_title("Medians over the run")
    text = "\n".join(median_rows(series)) or "no metrics"
    ax.text(0.02, 0.95, text, va="top", family="monospace", transform=ax.transAxes)


#: Every panel the report can draw, by name.
PANEL_NAMES = (
    "loss",
    "learning rate",
    "phases",
    "update",
    "memory",
    "reserved memory",
    "PCIe",
    "bytes",
    "device share",
)


def _any(series: Series, *keys: str, nonzero: bool = False) -> bool:
    """Whether any of ``keys`` was logged (with a value other than 0, when ``nonzero``)."""
    return any(v != 0 or not nonzero for key in keys for v in series.get(key, ([], []))[1])


def panels(series: Series) -> list[tuple[str, Any]]:
    """The panels ``series`` has data for, in drawing order: (name, function drawing it on an axis)."""
    mem = [f"dos/mem_peak_{p}_gb" for p in PHASES]
    candidates = [
        ("loss", _any(series, "train/loss", "val/loss"), lambda ax: _loss(ax, series)),
        ("learning rate", any(k.startswith("lr-") for k in series), lambda ax: _learning_rates(ax, series)),
        ("phases", _any(series, *(f"dos/{p}_s" for p in PHASES)), lambda ax: _breakdown(ax, series)),
        ("update", _any(series, "dos/update_s"), lambda ax: _update_vs_predicted(ax, series)),
        ("memory", _any(series, *mem), lambda ax: _memory(ax, series, "allocated")),
        (
            "reserved memory",
            _any(series, *(f"dos/mem_reserved_peak_{p}_gb" for p in PHASES)),
            lambda ax: _memory(ax, series, "reserved"),
        ),
        ("PCIe", _any(series, "dos/h2d_gbps", "dos/d2h_gbps", nonzero=True), lambda ax: _pcie(ax, series)),
        ("bytes", _any(series, "dos/h2d_gb", "dos/d2h_gb", nonzero=True), lambda ax: _bytes_moved(ax, series)),
        ("device share", _any(series, "dos/gpu_fraction", nonzero=True), lambda ax: _device_share(ax, series)),
    ]
    return [(name, draw_one) for name, present, draw_one in candidates if present]


def draw(series: Series, out: Path, title: str) -> Path:
    """Draw the panels ``series`` has data for, and the medians, into ``out`` (a PNG); return its path."""
    from matplotlib.figure import Figure

    chosen = panels(series)
    rows = math.ceil((len(chosen) + 1) / 2)  # + the medians
    fig = Figure(figsize=(13, 3.4 * rows), layout="constrained")
    axes = list(fig.subplots(rows, 2, squeeze=False).flat)
    for ax, (_, draw_one) in zip(axes, chosen):
        if draw_one(ax):
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
    _medians(axes[len(chosen)], series)
    for ax in axes[len(chosen) + 1 :]:
        ax.set_visible(False)
    drawn = {name for name, _ in chosen}
    left_out = [name for name in PANEL_NAMES if name not in drawn]
    subtitle = f"\n(no data, left out: {', '.join(left_out)})" if left_out else ""
    fig.suptitle(title + subtitle, fontsize="large")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run ``lightning-dos report``; return its exit status.

    0: the PNG was written; 1: nothing to draw (no folder, no metrics.csv, no ``dos/`` metrics);
    2: a usage error, or matplotlib is missing.

    Args:
        argv: the arguments after ``report`` (``RUN_DIR [--out PNG]``); None reads ``sys.argv``.
    """
    parser = argparse.ArgumentParser(
        prog="lightning-dos report", description="Draw a run's DOSMonitor metrics (CSVLogger) into one PNG."
    )
    parser.add_argument("run_dir", type=Path, help="folder holding the run's CSVLogger output (searched recursively)")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: RUN_DIR/dos-report.png)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help or a usage error: report it as a status, not an exception
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        missing = "lightning-dos report needs matplotlib, a dependency missing here (installed with --no-deps?)"
        print(f"{wrapped(missing)}; install it with:\n  {INSTALL_HINT}", file=sys.stderr)
        return 2
    if not args.run_dir.is_dir():
        print(wrapped(f"lightning-dos report: {args.run_dir} is not a folder"), file=sys.stderr)
        return 1
    if find_metrics(args.run_dir) is None:
        print(
            wrapped(f"lightning-dos report: no metrics.csv under {args.run_dir}; log with CSVLogger"), file=sys.stderr
        )
        return 1
    found = find_run(args.run_dir)
    if found is None:
        print(
            wrapped(
                f"lightning-dos report: no metrics.csv under {args.run_dir} has dos/ metrics; "
                "add the DOSMonitor callback to the training run"
            ),
            file=sys.stderr,
        )
        return 1
    metrics, series, passed_over = found
    print(wrapped(_picked(args.run_dir, metrics, passed_over)))
    out = args.out if args.out is not None else args.run_dir / "dos-report.png"
    title = f"lightning-dos run report: {metrics.relative_to(args.run_dir)}"
    print(wrapped(f"wrote {draw(series, out, title)}"))
    return 0


def _picked(run_dir: Path, metrics: Path, passed_over: list[Path]) -> str:
    """One line naming the log drawn, and the newer logs without ``dos/`` metrics passed over."""
    line = f"lightning-dos report: drawing {metrics.relative_to(run_dir).parent}"
    if not passed_over:
        return line
    newer = ", ".join(str(p.relative_to(run_dir).parent) for p in passed_over)
    return line + f" (newest with dos/ metrics; skipped {newer})"


if __name__ == "__main__":
    sys.exit(main())
