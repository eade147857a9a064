"""Chrome traces of chosen training steps: the step's phases and the engine's per-sub-group spans.

The file is the JSON object format ``{"traceEvents": [...]}`` that https://ui.perfetto.dev and
``chrome://tracing`` open. One process per rank; one lane (a ``tid`` with ``thread_name`` metadata) for
the step's phases (forward, backward, update) and one per kind of engine operation in
:data:`~lightning_dos.model.step_report.LANES`. Every operation is one complete event (``"ph": "X"``,
``ts``/``dur`` in microseconds) whose ``args`` name its sub-group and the bytes it moved.

A lane is one stream or one thread, so its spans must follow one another. The engine's device spans
come from events on one stream and are serialised already; rounding to microseconds and the
approximate placement of the engine's clock inside the update phase can still make neighbours touch,
so the writer clips every span to start no earlier than the previous one in its lane ended, and
counts what it clipped (``otherData.clipped_spans``).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_dos.model.step_report import LANES, StepReport

PHASES_LANE = "phases"
#: Overlap, in microseconds, above which clipping is worth a warning (below it is rounding noise).
OVERLAP_WARN_US = 50.0


@dataclass
class TracedStep:
    """One training step to draw.

    Attributes:
        step: the step's index (the trainer's ``global_step`` when it started).
        start_s: when the step started, in seconds on the trace's clock (the first traced step may be 0).
        phases: ``(name, start_s, end_s)`` of each phase, in seconds since the step started.
        report: the engine's report of the step's optimizer update, with spans when timing was on.
        engine_offset_s: where the engine's clock (0 = start of its update loop) falls, in seconds
            since the step started.
    """

    step: int
    start_s: float
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    report: StepReport | None = None
    engine_offset_s: float = 0.0


def _us(seconds: float) -> float:
    # A nanosecond grid: fine enough for any span, and rounding the same way on both ends keeps
    # the overlap check exact on what is written.
    return round(seconds * 1e6, 3)


def _raw_events(steps: Iterable[TracedStep], tids: dict[str, int]) -> list[dict[str, Any]]:
    """Complete events for every phase and span, before clipping."""
    events: list[dict[str, Any]] = []
    for traced in steps:
        for name, start, end in traced.phases:
            events.append(
                {
                    "name": name,
                    "cat": PHASES_LANE,
                    "tid": tids[PHASES_LANE],
                    "start": traced.start_s + start,
                    "end": traced.start_s + end,
                    "args": {"step": traced.step},
                }
            )
        report = traced.report
        if report is None:
            continue
        base = traced.start_s + traced.engine_offset_s
        for span in report.spans:
            if span.lane not in tids:
                # A lane the engine added after this writer was written: give it a lane of its own.
                tids[span.lane] = len(tids)
            events.append(
                {
                    "name": f"{span.lane} {span.sub_group}",
                    "cat": span.lane,
                    "tid": tids[span.lane],
                    "start": base + span.start_s,
                    "end": base + span.end_s,
                    "args": {"step": traced.step, "sub_group": span.sub_group, "bytes": span.nbytes},
                }
            )
    return events


def _clip_lanes(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int, float]:
    """Turn raw events into Chrome ``X`` events with no overlap inside a lane.

    Returns the events, how many were clipped, and the largest overlap removed (microseconds).
    """
    out: list[dict[str, Any]] = []
    clipped, worst = 0, 0.0
    lane_end: dict[int, float] = {}
    for event in sorted(events, key=lambda e: (e["tid"], e["start"], e["end"])):
        ts, end = _us(event["start"]), _us(event["end"])
        end = max(end, ts)
        previous = lane_end.get(event["tid"])
        if previous is not None and ts < previous:
            clipped += 1
            worst = max(worst, previous - ts)
            ts, end = previous, max(end, previous)
        lane_end[event["tid"]] = end
        out.append(
            {
                "name": event["name"],
                "cat": event["cat"],
                "ph": "X",
                "ts": ts,
                "dur": round(end - ts, 3),
                "pid": 0,
                "tid": event["tid"],
                "args": event["args"],
            }
        )
    return out, clipped, worst


def build_trace(steps: Sequence[TracedStep], rank: int = 0) -> dict[str, Any]:
    """The Chrome trace object for ``steps`` (see the module docstring for its layout).

    Args:
        steps: the steps to draw, on one clock.
        rank: the process's global rank, shown as the process name.
    """
    lanes = (PHASES_LANE, *LANES)
    tids = {lane: i for i, lane in enumerate(lanes)}
    events, clipped, worst = _clip_lanes(_raw_events(steps, tids))
    if worst > OVERLAP_WARN_US:
        warnings.warn(
            f"lightning-dos trace: {clipped} span(s) overlapped their lane's previous span by up to "
            f"{worst:.0f} us and were clipped; the engine's spans may not be serialised per lane",
            RuntimeWarning,
            stacklevel=2,
        )
    meta: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": 0,
            "tid": 0,
            "args": {"name": f"lightning-dos rank {rank}"},
        }
    ]
    for lane, tid in tids.items():
        meta.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": lane}})
        # Keep the lanes in pipeline order instead of the viewer's alphabetical default.
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ms",
        "otherData": {"steps": [s.step for s in steps], "clipped_spans": clipped},
    }


def write_trace(path: str | Path, steps: Sequence[TracedStep], rank: int = 0) -> Path:
    """Write the Chrome trace of ``steps`` to ``path`` (parent folders are created) and return the path.

    Args:
        path: the JSON file to write.
        steps: the steps to draw, on one clock.
        rank: the process's global rank, shown as the process name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(build_trace(steps, rank)))
    return path


def lane_overlaps(trace: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Pairs of consecutive events in one lane that overlap: ``(lane name, earlier, later)``.

    Empty for any trace :func:`build_trace` wrote; tests and external checks use it.
    """
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    lanes: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "X":
            lanes.setdefault((event["pid"], event["tid"]), []).append(event)
    found = []
    for (_, tid), events in lanes.items():
        events.sort(key=lambda e: e["ts"])
        for earlier, later in zip(events, events[1:]):
            if later["ts"] < earlier["ts"] + earlier["dur"] - 1e-6:
                found.append((names.get(tid, str(tid)), earlier, later))
    return found
