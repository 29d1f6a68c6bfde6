"""Pictures and tables of a finished (or running) run, from its metrics file alone."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from isotrain.train.report import read_metrics

__all__ = ["plot_run", "summarize_run"]


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
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(records, "train", "loss"), label="train loss")
    ax.plot(*_series(records, "eval", "val_loss"), "o-", label="val loss")
    skipped = [r.get("step") for r in records if r["kind"] == "train" and r.get("applied") is False]
    for i, step in enumerate(s for s in skipped if isinstance(s, int)):
        ax.axvline(step, color="red", alpha=0.3, lw=1, label="skipped step" if i == 0 else None)
    base = [_num(r.get("unigram_baseline")) for r in records if r["kind"] == "eval"]
    if base and math.isfinite(base[-1]):
        ax.axhline(base[-1], color="gray", ls="--", label="unigram baseline")
    ax.set(xlabel="step", ylabel="nats per token", title="loss")
    ax.legend()
    save(fig, "loss.png")
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
        "skipped_steps": train[-1].get("skipped_total", 0) if train else 0,
        "resumes": max(len(configs) - 1, 0),
    }
    return out
