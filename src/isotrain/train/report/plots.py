"""Pictures and tables of a finished (or running) run, from its metrics file alone."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from isotrain.train.files import make_dir, new_file
from isotrain.train.rundir.metrics import read_metrics

__all__ = ["loss_figure", "plot_run", "skips", "summarize_run"]


def _num(value: Any) -> float:
    """Metrics store NaN/Inf as strings (JSON has none); turn them back into floats (anything
    that is not a number, from a damaged file, becomes NaN)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in records if r["kind"] == kind and key in r and isinstance(r.get("step"), int)]
    return [r["step"] for r in rows], [_num(r[key]) for r in rows]


def skips(records: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """(step, reason) of every skipped step: the run's `skip` records; a run written before
    they existed gives the skipped log steps it recorded."""
    rows = [r for r in records if r["kind"] == "skip" and isinstance(r.get("step"), int)]
    if not rows:
        rows = [r for r in records if r["kind"] == "train" and r.get("applied") is False]
        rows = [r for r in rows if isinstance(r.get("step"), int)]
    return sorted({r["step"]: str(r.get("reason", "?")) for r in rows}.items())


def loss_figure(plt: Any, records: list[dict[str, Any]]) -> Any:
    """Train and validation loss, a red line at every skipped step, the unigram baseline."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(records, "train", "loss"), label="train loss")
    ax.plot(*_series(records, "eval", "val_loss"), "o-", label="val loss")
    skipped = [step for step, _ in skips(records)]
    if skipped:  # one collection, however many: x in steps, y spanning the axes
        ax.vlines(skipped, 0, 1, transform=ax.get_xaxis_transform(), colors="red", alpha=0.3,
                  lw=1, label=f"skipped step ({len(skipped)})", gid="skips")  # fmt: skip
    base = [_num(r.get("unigram_baseline")) for r in records if r["kind"] == "eval"]
    if base and math.isfinite(base[-1]):
        ax.axhline(base[-1], color="gray", ls="--", label="unigram baseline")
    ax.set(xlabel="step", ylabel="nats per token", title="loss")
    ax.legend()
    return fig


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write loss.png (train, val, skipped steps marked), lr.png, throughput.png, grad_norm.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "plots need matplotlib, which is not installed; try pip install 'isotrain[plots]'"
        ) from e
    records = read_metrics(run_dir)
    out = make_dir(out_dir or run_dir, follow=True)  # a folder the user named
    written = []

    def save(fig: Any, name: str) -> None:
        try:
            fig.tight_layout()
            with new_file(out / name) as f:  # never through a link or FIFO planted there
                fig.savefig(f, dpi=110, format="png")
        finally:
            plt.close(fig)
        written.append(out / name)

    save(loss_figure(plt, records), "loss.png")
    for key, name, label in [
        ("lr", "lr.png", "learning rate"),
        ("tokens_per_s", "throughput.png", "tokens / s"),
        ("grad_norm", "grad_norm.png", "gradient norm (before clipping)"),
    ]:
        steps, values = _series(records, "train", key)
        if not steps:
            continue
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.plot(steps, values)
        ax.set(xlabel="step", ylabel=label, title=label)
        save(fig, name)
    return written


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """The facts of a run: config essentials, last/best losses, throughput, skipped steps."""
    records = read_metrics(run_dir)
    configs = [r for r in records if r["kind"] == "config"]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    cfg = configs[-1].get("config") if configs else None
    model = cfg.get("model") if isinstance(cfg, dict) else None
    model = model if isinstance(model, dict) else {}
    tps = sorted(_num(r.get("tokens_per_s")) for r in train[1:] or train)
    out: dict[str, Any] = {
        "run": str(run_dir),
        "model": f"{model.get('n_layer')} layers, d_model {model.get('d_model')}, "
        f"block {model.get('block_size')}",
        "steps": train[-1].get("step") if train else 0,
        "last_train_loss": _num(train[-1].get("loss")) if train else math.nan,
        "last_val_loss": _num(evals[-1].get("val_loss")) if evals else math.nan,
        "best_val_loss": min((_num(r.get("val_loss")) for r in evals), default=math.nan),
        "unigram_baseline": _num(evals[-1].get("unigram_baseline")) if evals else math.nan,
        "median_tokens_per_s": tps[len(tps) // 2] if tps else math.nan,
        **_skip_counts(records, train),
        "resumes": max(len(configs) - 1, 0),
    }
    return out


def _skip_counts(records: list[dict[str, Any]], train: list[dict[str, Any]]) -> dict[str, Any]:
    """Skipped steps: total and by reason (the guard's counters at the last log step, else
    the `skip` records), and the first steps skipped."""
    skipped = skips(records)
    last = train[-1] if train else {}
    counted = last.get("skipped_by_reason")
    by_reason: dict[str, int] = {}
    if isinstance(counted, dict):
        by_reason = {str(k).lower(): v for k, v in counted.items() if isinstance(v, int) and v}
    else:
        for _, reason in skipped:
            by_reason[reason.lower()] = by_reason.get(reason.lower(), 0) + 1
    steps = ", ".join(str(s) for s, _ in skipped[:10]) + (", ..." if len(skipped) > 10 else "")
    return {
        "skipped_steps": last.get("skipped_total", len(skipped)),
        "skipped_by_reason": ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())) or "-",
        "skipped_at_steps": steps or "-",
    }
