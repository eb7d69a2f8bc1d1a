"""The README's loss chart is what scripts/plot_results.py draws from the committed runs (benchmarks/results/).

The script writes a digest of everything the chart shows (labels, colours, panels, every point) into the PNG; the
test recomputes it from the committed JSON without matplotlib. A stale image (a run added, a label changed, the
data re-measured without redrawing) fails it: redraw with ``python scripts/plot_results.py``.
"""
from __future__ import annotations

from tests.support.tools import REPO, repo_module


def test_committed_loss_chart_is_drawn_from_the_committed_runs():
    plot = repo_module("scripts/plot_results.py")
    runs = plot.loss_runs(str(REPO / "benchmarks" / "results"))
    committed = plot.png_text(str(REPO / "docs" / "img" / "loss_vs_tokens.png")).get(plot.DIGEST_KEY)
    assert committed == plot.loss_digest(runs, 10), "docs/img/loss_vs_tokens.png is stale: run scripts/plot_results.py"
    labels = [r["label"] for r in runs]
    panels = {}
    for r in runs:
        panels.setdefault((r["model"], r["device"].split(":")[0], r["world_size"]), []).append((r["label"], r["color"]))
    for panel, shown in panels.items():  # within a panel every run has its own label and colour
        assert len({label for label, _ in shown}) == len(shown) and len({c for _, c in shown}) == len(shown), panel
    assert any("Adam-mini" in label for label in labels)


def test_committed_w1_step_chart_is_drawn_from_the_committed_runs():
    """docs/img/step_time_w1.png (the README's timing chart) shows the numbers of the runs it names: its digest is
    the committed JSON's, and every run has AdamW, the built-in and ds_muon."""
    plot = repo_module("scripts/plot_results.py")
    rows = plot.w1_rows(str(REPO / "benchmarks" / "results"))
    committed = plot.png_text(str(REPO / "docs" / "img" / "step_time_w1.png")).get(plot.DIGEST_KEY)
    assert committed == plot.w1_digest(rows), "docs/img/step_time_w1.png is stale: run scripts/plot_results.py"
    assert len(rows) == 3 * len(plot.W1_RUNS) and {r["optimizer"] for r in rows} == set(plot.COLORS)
    assert all(abs(r["step_s"] - r["fwd_bwd_s"] - r["opt_step_s"]) < 0.02 for r in rows), rows
