"""Every skipped step is a record (step and reason) in metrics.jsonl, a marker on loss.png,
and a count in `isotrain report`, whatever the log cadence."""

from __future__ import annotations

import pytest
import torch

from isotrain.guard import SkipReason
from isotrain.train.cli.main import main
from isotrain.train.report.plots import loss_figure, summarize_run
from isotrain.train.rundir.metrics import read_metrics
from isotrain.train.update.updater import SkipLog

SMOKE = ["--preset", "smoke", "--data.max-bytes", "60000", "--sample-tokens", "0"]
INJECTED = [3, 4, 7, 11]  # fault injection: NaN loss at these steps (numbered from 1)


@pytest.mark.parametrize("log_every", [2, 10])
def test_each_skip_is_recorded_marked_and_counted(tmp_path, log_every) -> None:
    run = tmp_path / "run"
    nan_at = ["--guard.inject-nan-at", *map(str, INJECTED)]
    argv = ["train", *SMOKE, "--steps", "12", "--log-every", str(log_every), *nan_at]
    assert main([*argv, "--out-dir", str(run)]) == 0
    records = read_metrics(run)
    skips = [(r["step"], r["reason"]) for r in records if r["kind"] == "skip"]
    assert skips == [(s, "NONFINITE_LOSS") for s in INJECTED]
    # each skip record comes before the log step that read it, and after the one before
    logged = [r["step"] for r in records if r["kind"] == "train"]
    kinds = [(r["kind"], r.get("step")) for r in records if r["kind"] in ("skip", "train")]
    for step in INJECTED:
        reader = min(s for s in logged if s >= step)
        assert kinds.index(("skip", step)) < kinds.index(("train", reader))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = loss_figure(plt, records, run)
    try:
        ax = fig.axes[0]
        (marks,) = [c for c in ax.collections if c.get_gid() == "skips"]
        xs = sorted(seg[0][0] for seg in marks.get_segments())
        counts = [(t.xy[0], t.get_text()) for t in ax.texts if t.get_gid() == "skip-count"]
        title, legend = ax.get_title(), [t.get_text() for t in ax.get_legend().get_texts()]
    finally:
        plt.close(fig)
    assert xs == [3, 7, 11] and counts == [(3, "×2")]  # 3 and 4 are one mark, counted
    assert title == "loss: run" and f"skipped step ({len(INJECTED)})" in legend

    facts = summarize_run(run)
    assert facts["skipped_steps"] == len(INJECTED)
    assert facts["skipped_by_reason"] == f"nonfinite_loss {len(INJECTED)}"
    assert facts["skipped_at_steps"] == ", ".join(map(str, INJECTED))


def test_adjacent_skips_cluster_and_resumes_are_marked(tmp_path) -> None:
    from isotrain.train.report.plots import clusters, plot_run, resumes

    assert clusters([5, 6, 7, 20, 40, 41], gap=1) == [(5, 3), (20, 1), (40, 2)]
    assert clusters([100, 106, 300], gap=6) == [(100, 2), (300, 1)]
    run = tmp_path / "run"
    argv = ["train", *SMOKE, "--guard.inject-nan-at", "3", "--out-dir", str(run)]
    assert main([*argv, "--steps", "4"]) == 0
    assert main([*argv, "--steps", "6"]) == 0
    records = read_metrics(run)
    assert resumes(records) == [4]
    out = plot_run(run, tmp_path / "plots")
    assert [p.parent for p in out] == [tmp_path / "plots" / "run"] * 4  # never another run's
    import matplotlib.pyplot as plt

    fig = loss_figure(plt, records, run)
    try:
        (back,) = [c for c in fig.axes[0].collections if c.get_gid() == "resumes"]
        assert [seg[0][0] for seg in back.get_segments()] == [4]
    finally:
        plt.close(fig)


def test_skip_log_reads_every_step_once_in_order(monkeypatch) -> None:
    monkeypatch.setattr(SkipLog, "FOLD", 4)  # fold unread reasons into blocks early
    log = SkipLog()
    codes = [0, 4, 0, 0, 1, 0, 0, 3, 0, 2, 5]
    for step, code in enumerate(codes, start=1):
        log.add(step, torch.tensor(code))
    assert len(log.blocks) == 2 and len(log.recent) == 3
    expected = [(s, SkipReason(c).name) for s, c in enumerate(codes, start=1) if c]
    assert log.drain() == expected
    assert log.drain() == []
    log.add(12, torch.tensor(1))
    assert log.drain() == [(12, "NONFINITE_LOSS")]
