"""Pictures and tables of a finished (or running) run, from its metrics file alone."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from isotrain.train.files import make_dir, new_file, remove_stale
from isotrain.train.rundir.metrics import read_metrics

__all__ = ["clusters", "loss_figure", "plot_run", "resumes", "skips", "summarize_run"]


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


def resumes(records: list[dict[str, Any]]) -> list[int]:
    """The steps the run was resumed at: every config record after the first."""
    steps = [r.get("step") for r in records if r["kind"] == "config"][1:]
    return [s for s in steps if isinstance(s, int) and s > 0]


def clusters(steps: list[int], *, gap: int) -> list[tuple[int, int]]:
    """(first step, count) of each run of skipped steps closer than `gap` to the previous one,
    so two skips on adjacent steps read as one mark labelled 2, not as one line."""
    out: list[list[int]] = []
    for step in sorted(steps):
        if out and step - out[-1][2] <= gap:
            out[-1][1] += 1
            out[-1][2] = step
        else:
            out.append([step, 1, step])
    return [(first, n) for first, n, _ in out]


def _marks(ax: Any, records: list[dict[str, Any]]) -> None:
    """Skipped steps (red, clusters counted) and resumes (grey, dashed) on any step axis."""
    skipped = [step for step, _ in skips(records)]
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    span = max(steps, default=1) - min(steps, default=0)
    groups = clusters(skipped, gap=max(1, span // 150))  # closer than a line is wide
    if groups:  # one collection, however many: x in steps, y spanning the axes
        ax.vlines([g for g, _ in groups], 0, 1, transform=ax.get_xaxis_transform(),
                  colors="red", alpha=0.4, lw=1.2, gid="skips",
                  label=f"skipped step ({len(skipped)})")  # fmt: skip
        for first, n in groups:
            if n > 1:
                ax.annotate(f"×{n}", (first, 1.0), xycoords=("data", "axes fraction"),
                            xytext=(2, -10), textcoords="offset points", color="red",
                            fontsize=8, gid="skip-count")  # fmt: skip
    back = resumes(records)
    if back:
        ax.vlines(back, 0, 1, transform=ax.get_xaxis_transform(), colors="gray", ls=":",
                  lw=1.2, gid="resumes", label=f"resumed ({len(back)})")  # fmt: skip


def _title(what: str, run_dir: str | Path) -> str:
    return f"{what}: {Path(run_dir).resolve().name}"


def loss_figure(plt: Any, records: list[dict[str, Any]], run_dir: str | Path = "") -> Any:
    """Train and validation loss, a red line at every skipped step (adjacent ones counted),
    a dotted one at every resume, the unigram baseline; titled with the run's name."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(records, "train", "loss"), label="train loss")
    ax.plot(*_series(records, "eval", "val_loss"), "o-", label="val loss")
    _marks(ax, records)
    base = [_num(r.get("unigram_baseline")) for r in records if r["kind"] == "eval"]
    if base and math.isfinite(base[-1]):
        ax.axhline(base[-1], color="gray", ls="--", label="unigram baseline")
    ax.set(xlabel="step", ylabel="nats per token", title=_title("loss", run_dir))
    ax.legend()
    return fig


def _clip(records: list[dict[str, Any]]) -> float:
    """The run's --optim.grad-clip (0: off), from its last config record."""
    configs = [r.get("config") for r in records if r["kind"] == "config"]
    optim = configs[-1].get("optim") if configs and isinstance(configs[-1], dict) else None
    return _num(optim.get("grad_clip")) if isinstance(optim, dict) else math.nan


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write loss.png (train, val, skips and resumes marked), lr.png, throughput.png and
    grad_norm.png (with the clip level) into the run, or into OUT/<run name>/."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "plots need matplotlib, which is not installed; try pip install 'isotrain[plots]'"
        ) from e
    records = read_metrics(run_dir)
    out = Path(run_dir) if out_dir is None else Path(out_dir) / Path(run_dir).resolve().name
    fresh = not out.exists()
    out = make_dir(out, follow=True)  # a folder the user named; files in it are never followed
    remove_stale(out)  # what a killed plot left
    try:
        return _draw(plt, records, run_dir, out)
    except BaseException:  # a full disk: a folder this call made goes again, with what it holds
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        raise


def _draw(plt: Any, records: list[dict[str, Any]], run_dir: str | Path, out: Path) -> list[Path]:
    """Each figure of `plot_run`, written into `out` through fresh files."""
    written = []

    def save(fig: Any, name: str) -> None:
        try:
            fig.tight_layout()
            with new_file(out / name) as f:  # never through a link or FIFO planted there
                fig.savefig(f, dpi=110, format="png")
        finally:
            plt.close(fig)
        written.append(out / name)

    save(loss_figure(plt, records, run_dir), "loss.png")
    for key, name, label in [
        ("lr", "lr.png", "learning rate"),
        ("tokens_per_s", "throughput.png", "tokens / s"),
        ("grad_norm", "grad_norm.png", "gradient norm (before clipping)"),
    ]:
        steps, values = _series(records, "train", key)
        if not steps:
            continue
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.plot(steps, values, label=label)
        clip = _clip(records)
        if key == "grad_norm" and clip > 0:
            ax.axhline(clip, color="green", ls="--", lw=1, label=f"clipped to {clip:g}")
        _marks(ax, records)
        ax.set(xlabel="step", ylabel=label, title=_title(label, run_dir))
        if key == "grad_norm" or len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize=8)
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
