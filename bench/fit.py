"""A capture fitted: what each system measured beside what the performance model predicts, per mode and phase.

Reads the per-step JSON lines of a capture (``bash scripts/gpu-check.sh capture --out DIR`` writes
``DIR/steps.jsonl``; ``bench/run.py --steps-jsonl`` writes the same), and for each system and clip setting prints,
over its steady-state steps (bench/steps.py: after the warm-up, neither the planner's timed iteration nor a plan
switch), the median measured beside the median predicted, their ratio, and after the table the term furthest off in
seconds (a phase, the forward's wait or the update loop), overall and in each run.

Predicted, per step, by the iteration model (``lightning_dos.model.iteration``) from what the step recorded: its
plan (in the order the next forward needs the sub-groups, where one was recorded), the rates the planner used
(calibrated, refined from spans and corrected), and forward and backward alone: the planner's own when it timed them
(``gpu_fraction="auto"`` with overlap on a GPU), else the medians measured by the same run with ``overlap="off"``
(``auto@off`` for ``auto``), which are then that run's inputs rather than predictions. The phases:

- ``off``: forward, backward, the update (the model's update loop), the iteration (their sum);
- ``forward`` and ``auto``: the forward beside the update (forward alone, then each sub-group's layers after its
  landing and, before backward, the update's end), the forward's wait for the update (that less forward alone;
  measured: the forward's all-gathers' waits and backward's wait for the rest), backward (under ``auto`` the host
  updates beside it, charged nothing), the update left after backward (not modelled: nothing is predicted), the
  iteration;
- every mode of ours: the engine's update loop beside the planner's own prediction of it, and the update phase and
  the iteration beside the planner's predictions of them where it made them (``(planner)``).

    python bench/fit.py bench/captures/2026-11-28-cpu
    python bench/fit.py DIR/steps.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_dos.model.iteration import Speculation, mode_iteration_s, predicted_timeline  # noqa: E402
from lightning_dos.model.perfmodel import HardwareRates  # noqa: E402
from lightning_dos.model.plan import Place, Plan  # noqa: E402
from lightning_dos.model.update_problem import TrainingPhases, UpdateProblem  # noqa: E402
from lightning_dos.model.update_rules import RULES, Footprint  # noqa: E402

WIDTH = 80
STEPS_FILE = "steps.jsonl"
#: ``--clip-under``: the threshold over the largest gradient norm of the steps without clipping.
CLIP_MARGIN = 1.25
#: Phase labels per overlap mode (None: stock offload, measured only), in the table's order.
LABELS = {
    None: ("forward", "backward", "update", "iteration"),
    "off": ("forward", "backward", "update", "iteration", "update loop (engine)", "update (planner)"),
    "forward": ("forward beside the update", "forward's wait for the update", "backward", "update after backward",
                "iteration", "update loop (engine)", "update (planner)", "iteration (planner)"),
    "auto": ("forward beside the update", "forward's wait for the update", "backward beside host updates",
             "update after backward", "iteration", "update loop (engine)", "update (planner)", "iteration (planner)"),
}  # fmt: skip
#: Rows of the planner's own predictions, left out where it made none.
PLANNER_ROWS = ("update (planner)", "iteration (planner)")


class CaptureError(ValueError):
    """The path is not a capture bench/fit.py can read (said in words)."""


@dataclasses.dataclass
class Row:
    """One phase of one system: medians over its steady steps (``predicted`` None: nothing predicted; ``is_input``:
    the figure is the model's input measured by this same run, not a prediction)."""

    system: str
    clip: str
    phase: str
    steps: int
    measured: float | None
    predicted: float | None
    is_input: bool = False

    @property
    def ratio(self) -> float | None:
        """Measured over predicted, where both are there and positive (and the prediction is one)."""
        if self.is_input or not self.measured or not self.predicted or self.measured <= 0 or self.predicted <= 0:
            return None
        return self.measured / self.predicted


def load(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The run lines and step lines of the capture at ``path`` (its folder, or its JSON-lines file)."""
    file = path / STEPS_FILE if path.is_dir() else path
    hint = "bash scripts/gpu-check.sh capture --out DIR writes one; bench/run.py --steps-jsonl PATH too"
    if not file.is_file():
        raise CaptureError(f"{path} is not a capture: no {STEPS_FILE} there ({hint})")
    runs, steps = [], []
    for number, text in enumerate(file.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as error:
            raise CaptureError(f"{file}, line {number}: not JSON ({error.msg})") from None
        (runs if line.get("kind") == "run" else steps if line.get("kind") == "step" else []).append(line)
    if not runs or not steps:
        raise CaptureError(f"{file} is not a capture: {len(runs)} run line(s), {len(steps)} step line(s) ({hint})")
    return runs, steps


def _clip(value: float | None) -> str:
    return "off" if not value else f"{value:g}"


def _median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(kept) if kept else None


def _rates(data: dict[str, Any]) -> HardwareRates:
    """Rates as recorded, less fields this model no longer has (an older capture keeps loading)."""
    known = {f.name for f in dataclasses.fields(HardwareRates)}
    return HardwareRates.from_dict({k: v for k, v in data.items() if k in known})


def _plan(step: dict[str, Any]) -> Plan:
    """The plan the step executed, in the order the next forward needs its sub-groups where one was recorded."""
    recorded = step["plan"]
    plan = Plan(tuple(Place(p) for p in recorded["places"]), recorded["device_buffers"],
                frozenset(recorded["after_backward"]))  # fmt: skip
    order = recorded.get("order") or step.get("need_order") or ()
    if order and hasattr(plan, "in_order"):
        plan = plan.in_order(order)
    return plan


def _footprint(run: dict[str, Any]) -> Footprint:
    f = run["footprint"]
    return Footprint(RULES[f["rule"]], f["master"], f["state"], f["grads_on_device"])


def _measured_wait(step: dict[str, Any]) -> float | None:
    """Seconds the step's forward waited for the update in flight: its all-gathers' waits and backward's start."""
    waits = step.get("waits")
    if waits is None:
        return None
    return sum(end - began for phase, began, end, _ in waits if phase in ("forward", "settle"))


def predicted_phases(run: dict[str, Any], step: dict[str, Any], alone: tuple[float, float]) -> dict[str, float]:
    """The model's figure for each phase of ``step`` (labels of :data:`LABELS`), forward and backward ``alone``."""
    mode, (forward_s, backward_s) = run["overlap"], alone
    out = {"update loop (engine)": step["predicted"]["update_loop_s"]}
    if step["predicted"].get("iteration_s") is not None:
        out["iteration (planner)"] = step["predicted"]["iteration_s"]
    metrics = step["metrics"]
    if "dos/engine_update_predicted_s" in metrics and "dos/update_predicted_s" in metrics:
        # The monitor's names since issue 52: dos/update_predicted_s predicts the update phase (dos/update_s).
        out["update (planner)"] = metrics["dos/update_predicted_s"]
    if step.get("rates") is None:
        return out
    plan, rates = _plan(step), _rates(step["rates"]["used"])
    problem = UpdateProblem(run["sizes"], rates, run["lp_bytes"], _footprint(run))
    timeline = predicted_timeline(problem, plan)
    speculation = Speculation(**step["speculation"]) if step.get("speculation") else None
    # As the planner predicts it: contention charged where the mode overlaps the training thread.
    iteration = mode_iteration_s(problem, plan, TrainingPhases(forward_s, backward_s, mode), speculation=speculation)
    if mode == "off":
        return {**out, "forward": forward_s, "backward": backward_s, "update": timeline.total_s, "iteration": iteration}
    beside = iteration - backward_s
    back = "backward" if mode == "forward" else "backward beside host updates"
    return {**out, "forward beside the update": beside, "forward's wait for the update": beside - forward_s,
            back: backward_s, "iteration": iteration}  # fmt: skip


def _measured_phases(mode: str | None, step: dict[str, Any]) -> dict[str, float | None]:
    phases, overlapped = step["phases"], mode in ("forward", "auto")
    out = {
        "forward beside the update" if overlapped else "forward": phases.get("forward_s"),
        "backward beside host updates" if mode == "auto" else "backward": phases.get("backward_s"),
        "update after backward" if overlapped else "update": phases.get("update_s"),
        "iteration": phases.get("step_s"),
    }
    if mode is not None:
        out["update loop (engine)"] = step["metrics"].get("dos/engine_update_s")
        out["update (planner)"] = phases.get("update_s")
        out["iteration (planner)"] = phases.get("step_s")
    if mode in ("forward", "auto"):
        out["forward's wait for the update"] = _measured_wait(step)
    return out


def fit(runs: Sequence[dict[str, Any]], steps: Sequence[dict[str, Any]]) -> tuple[list[Row], list[str]]:
    """Each system's rows (:class:`Row`, in capture order) and notes on where forward and backward alone came
    from."""
    by_run: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for step in steps:
        if step.get("steady"):
            by_run.setdefault((step["system"], _clip(step["clip"])), []).append(step)
    rows, notes = [], []
    for run in runs:
        key = (run["system"], _clip(run["clip"]))
        steady, mode = by_run.get(key, []), run.get("overlap")
        if not steady:
            notes.append(f"{key[0]}, clip {key[1]}: no steady step recorded (a run cut short?)")
            continue
        measured = [_measured_phases(mode, s) for s in steady]
        predicted: list[dict[str, float]] = []
        alone, source = _alone(run, steady, by_run)
        if mode is not None and alone is not None:
            predicted = [predicted_phases(run, s, alone) for s in steady]
            notes.append(f"{key[0]}, clip {key[1]}: forward and backward alone {source}")
        committed = [s["metrics"]["dos/committed"] for s in steady if "dos/committed" in s["metrics"]]
        if committed:
            done = f"{sum(committed):g} of {len(committed)}"
            notes.append(f"{key[0]}, clip {key[1]}: updates begun during backward committed in {done} steady steps "
                         "(a clipped step's are redone)")  # fmt: skip
        for label in LABELS[mode]:
            m = _median(row.get(label) for row in measured)
            p = _median(row.get(label) for row in predicted)
            if m is None or (p is None and label in PLANNER_ROWS):
                continue  # nothing measured; or no prediction of the planner's (no timed phases, older metrics)
            own = source == "as measured here" and label in ("forward", "backward")
            rows.append(Row(key[0], key[1], label, len(steady), m, p, is_input=own))
    return rows, notes


def _alone(
    run: dict[str, Any], steady: Sequence[dict[str, Any]], by_run: dict[tuple[str, str], list[dict[str, Any]]]
) -> tuple[tuple[float, float] | None, str]:
    """Forward and backward alone for ``run``'s model: the planner's, else its ``@off`` sibling's medians."""
    planner = [s["planner_phases"] for s in steady if s.get("planner_phases")]
    if planner:
        return (_median(p[0] for p in planner), _median(p[1] for p in planner)), "as the planner timed them"
    sibling = run["system"].partition("@")[0] + "@off"
    off = by_run.get((sibling, _clip(run["clip"])))
    if not off:
        return None, ""
    alone = (_median(s["phases"]["forward_s"] for s in off), _median(s["phases"]["backward_s"] for s in off))
    if sibling == run["system"]:
        return alone, "as measured here"
    source = f"from {sibling}'s steady steps"
    threads = [_median(s["metrics"].get("dos/host_threads") for s in runs) for runs in (off, steady)]
    if None not in threads and threads[0] != threads[1]:
        # host_threads="auto" leaves the training thread a core of its own under overlap: forward and backward then
        # run with other threads than the sibling's, on a loaded machine several times faster or slower.
        source += f" (which ran {threads[0]:g} torch threads, this run {threads[1]:g}: not quite this run's alone)"
    return alone, source


def _ms(value: float | None) -> str:
    """Seconds as milliseconds in at most 6 characters (3 or more significant digits)."""
    if value is None:
        return "-"
    ms = 1e3 * value
    return (
        f"{ms:.0f}"
        if abs(ms) >= 100
        else f"{ms:.1f}"
        if abs(ms) >= 10
        else f"{ms:.2f}"
        if abs(ms) >= 1
        else f"{ms:.3f}"
    )


def table(rows: Sequence[Row]) -> str:
    """The rows at :data:`WIDTH` columns: system, clip, phase, steady steps, measured, predicted, their ratio."""
    head = f"{'system':<13} {'clip':<4} {'phase':<29} {'n':>2} {'measured':>8} {'predicted':>9} {'ratio':>7}"
    lines = [head, f"{'':<13} {'':<4} {'':<29} {'':>2} {'ms':>8} {'ms':>9} {'':>7}".rstrip(), "-" * len(head)]
    for row in rows:
        system = row.system if len(row.system) <= 13 else row.system[:12] + "~"
        predicted = "(input)" if row.is_input else _ms(row.predicted)
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else ""
        lines.append(
            f"{system:<13} {row.clip:<4} {row.phase:<29} {row.steps:>2} {_ms(row.measured):>8} {predicted:>9} "
            f"{ratio:>7}".rstrip()
        )
    return "\n".join(lines)


def most_off(rows: Sequence[Row]) -> Row | None:
    """The term whose measurement is furthest from its prediction in seconds, either way: a phase, a wait or the
    update loop (not an iteration, which sums them; a far ratio on a millisecond costs less than a near one on a
    second)."""
    terms = [row for row in rows if row.ratio is not None and not row.phase.startswith("iteration")]
    return max(terms, key=lambda row: abs(row.measured - row.predicted), default=None)


def _off(row: Row) -> str:
    return f"{row.phase}: measured {row.ratio:.2f}x predicted ({_ms(row.measured)} ms against {_ms(row.predicted)} ms)"


def report(path: Path) -> str:
    """The fit of the capture at ``path``, as printed."""
    runs, steps = load(path)
    rows, notes = fit(runs, steps)
    first = runs[0]
    head = (
        f"Capture {path}: {first.get('device')}, GPT {'x'.join(str(v) for v in first['shape'][:2])} "
        f"({first['params'] / 1e6:.1f}M params), {first['precision']}; medians over each run's steady steps "
        "(n: after the warm-up, neither the planner's timed iteration nor a plan switch)."
    )
    out = [textwrap.fill(head, WIDTH), "", table(rows), ""]
    worst = most_off(rows)
    if worst is not None:
        out.append(textwrap.fill(f"Most off: {worst.system}, clip {worst.clip}, {_off(worst)}.", WIDTH))
    for run in dict.fromkeys((row.system, row.clip) for row in rows):
        term = most_off([row for row in rows if (row.system, row.clip) == run])
        if term is not None and term is not worst:
            out.append(textwrap.fill(f"{run[0]}, clip {run[1]}: most off, {_off(term)}.", WIDTH,
                                     subsequent_indent="  "))  # fmt: skip
    out += [textwrap.fill(note + ".", WIDTH, subsequent_indent="  ") for note in notes]
    return "\n".join(out)


def clip_under(path: Path, margin: float = CLIP_MARGIN) -> float:
    """A clipping threshold the capture's steps without clipping stayed under: ``margin`` times the largest global
    gradient norm of their steady steps (the steps a run with it takes on the same batches stay under it until their
    trajectories part, as training past its warm-up mostly does)."""
    runs, steps = load(path)
    norms = [s["grad_norm"] for s in steps if s.get("steady") and not s["clip"] and s.get("grad_norm")]
    if not norms:
        raise CaptureError(f"{path}: no steady step without clipping recorded a gradient norm")
    return float(f"{margin * max(norms):.3g}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("capture", type=Path, help=f"a capture's folder (holding {STEPS_FILE}), or that file")
    parser.add_argument(
        "--clip-under", action="store_true",
        help=f"print a clipping threshold the capture's steps without clipping stayed under ({CLIP_MARGIN}x their "
        "largest gradient norm) instead of the fit",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        print(f"{clip_under(args.capture):g}" if args.clip_under else report(args.capture))
    except CaptureError as error:
        print(f"bench/fit.py: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
