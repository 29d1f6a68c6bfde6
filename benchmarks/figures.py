"""Pictures a reader trusts at a glance: medians with their 95% intervals, on axes fitted to
the data, values in the labels (never annotations that could overlap). No torch import."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["dot_plot", "fmt_row", "pyplot"]


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (with a note) where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[skip] plot: matplotlib is not installed", file=sys.stderr)
        return None
    return plt


def dot_plot(ax: Any, rows: dict[str, dict[str, float]], *, ref: float, xlabel: str) -> None:
    """Medians with their 95% intervals, one row per label, on an axis fitted to the data.

    The values are in the row labels (never annotations that could overlap); the dashed line
    is the reference (1.0 for ratios, 0 for differences) and the axis always shows it.
    """
    labels = [f"{n}\n{fmt_row(s)}" for n, s in rows.items()]
    ys = list(range(len(rows)))[::-1]
    med = [s["median"] for s in rows.values()]
    err = [
        [s["median"] - s["ci95_lo"] for s in rows.values()],
        [s["ci95_hi"] - s["median"] for s in rows.values()],
    ]
    ax.errorbar(med, ys, xerr=err, fmt="o", color="#2a6", ecolor="#333", capsize=4)
    ax.axvline(ref, color="grey", lw=0.8, ls="--")
    lo = min([ref] + [s["ci95_lo"] for s in rows.values()])
    hi = max([ref] + [s["ci95_hi"] for s in rows.values()])
    pad = 0.15 * (hi - lo) or 0.01 * abs(ref) or 0.01
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.grid(axis="x", alpha=0.3)


def fmt_row(s: dict[str, float]) -> str:
    return f"{s['median']:.3f} [{s['ci95_lo']:.3f}, {s['ci95_hi']:.3f}]"
