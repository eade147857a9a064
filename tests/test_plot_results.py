"""bench/plot_results.py: the README's plot comes from bench/RESULTS.md's summary, and the summary from its entries."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.plot_results import ROOT, main, read_summary

pytest.importorskip("matplotlib")

RESULTS = ROOT / "bench" / "RESULTS.md"


def test_the_summary_of_results_md_draws_a_png(tmp_path: Path) -> None:
    out = tmp_path / "results.png"
    assert main(["--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_summary_figure_its_entry_does_not_hold_is_refused(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    text = RESULTS.read_text()
    first = read_summary(text)[0]
    line = next(line for line in text.splitlines() if line.startswith(f"| {first.hardware} |"))
    wrong = f"{first.seconds * 2:.3f}"  # a figure the entry does not hold
    assert wrong not in text
    altered = tmp_path / "RESULTS.md"
    altered.write_text(text.replace(line, line.replace(f"| {first.figure} |", f"| {wrong} |"), 1))
    out = tmp_path / "results.png"
    assert main(["--results", str(altered), "--out", str(out)]) == 2
    assert f"does not hold {wrong}" in capsys.readouterr().err and not out.exists()
