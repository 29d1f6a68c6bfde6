"""Statistics of paired, interleaved benchmark rounds (pure Python: run_all and tests use it).

Every benchmark here runs its variants in rounds, one after another in a rotating order, so
the machine's slow drift is shared by the variants of one round. A comparison is the per-round
*paired* ratio (or difference) to a reference, summarised by its median and a distribution-free
95% interval of that median: the order statistics that binomial(n, 1/2) puts around the middle
(no bootstrap, no normality assumption; exact coverage >= 95% from n = 6 on). A headline ratio
needs an interval of at most +-2% of its median; `Stopper` runs rounds until every tracked
ratio's interval is that narrow (a fixed-width sequential interval, Chow and Robbins 1965), or
until its round limit, and the result says which.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

__all__ = [
    "Stopper",
    "fmt_ci",
    "half_width",
    "judge",
    "median_ci",
    "paired_diffs",
    "paired_ratios",
    "summarize",
]

TARGET = 0.02  # a headline ratio's 95% interval: at most +-2% of its median


def median_ci(xs: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(lo, hi, coverage): order statistics x_(j), x_(n+1-j) that cover the median at `level`.

    j is the largest rank with 2 * P(Bin(n, 1/2) < j) <= 1 - level; the exact coverage is
    returned. Below n = 6 no such j exists: (min, max) with its coverage (< 95%) is returned.
    """
    n = len(xs)
    if n == 0:
        raise ValueError("median_ci needs at least one value")
    s = sorted(xs)
    alpha = Fraction(1 - level).limit_denominator(10_000)
    total, c, tail, j = 2**n, 1, 0, 0  # c = comb(n, i); tail = 2**n * P(B <= j - 1)
    for i in range(n // 2 + 1):
        if 2 * (tail + c) > alpha * total:
            break
        tail, j = tail + c, i + 1
        c = c * (n - i) // (i + 1)
    if j == 0:  # too few rounds for 95%: the whole range, with the coverage it has
        return s[0], s[-1], 1 - 2 / total
    return s[j - 1], s[n - j], float(1 - Fraction(2 * tail, total))


def quartiles(xs: Sequence[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def summarize(xs: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, range and the 95% interval of the median (with its coverage)."""
    q1, q3 = quartiles(xs)
    lo, hi, cov = median_ci(xs)
    return {
        "median": statistics.median(xs),
        "q1": q1,
        "q3": q3,
        "min": min(xs),
        "max": max(xs),
        "ci95_lo": lo,
        "ci95_hi": hi,
        "coverage": cov,
        "n": len(xs),
    }


def half_width(s: Mapping[str, float]) -> float:
    """The 95% interval's half-width relative to the median (0.02 = +-2%)."""
    return (s["ci95_hi"] - s["ci95_lo"]) / 2 / abs(s["median"])


def paired_ratios(
    times: Mapping[str, Sequence[float]], base: str, *, speed: bool = True
) -> dict[str, list[float]]:
    """Per round, each variant against `base`: base/variant (speed) or variant/base (time)."""
    return {
        n: [(b / t if speed else t / b) for b, t in zip(times[base], ts, strict=True)]
        for n, ts in times.items()
        if n != base
    }


def paired_diffs(
    times: Mapping[str, Sequence[float]], base: str, *, scale: float = 1.0
) -> dict[str, list[float]]:
    """Per round, each variant's time minus `base`'s, times `scale` (1e3: milliseconds)."""
    return {
        n: [scale * (t - b) for b, t in zip(times[base], ts, strict=True)]
        for n, ts in times.items()
        if n != base
    }


@dataclass
class Stopper:
    """Run rounds until every tracked series' 95% interval is within +-target of its median.

    `series()` returns the per-round values (ratios) to track; they are checked every
    `check_every` rounds from `min_rounds` on; `max_rounds` bounds the run. `reason` says
    why it stopped.
    """

    series: Callable[[], Mapping[str, Sequence[float]]]
    min_rounds: int = 30
    max_rounds: int = 200
    target: float = TARGET
    check_every: int = 10
    reason: str = "not started"

    def __call__(self, rounds_done: int) -> bool:
        if rounds_done >= self.max_rounds:
            self.reason = f"round limit ({self.max_rounds}) reached"
            return True
        if rounds_done < self.min_rounds or (rounds_done - self.min_rounds) % self.check_every:
            return False
        widths = {k: half_width(summarize(v)) for k, v in self.series().items() if v}
        if widths and max(widths.values()) <= self.target:
            self.reason = f"every 95% interval within +-{100 * self.target:g}% after {rounds_done}"
            return True
        return False

    def record(self, rounds_done: int) -> dict[str, Any]:
        """What the result file says about the stopping rule."""
        widths = {k: half_width(summarize(v)) for k, v in self.series().items() if v}
        return {
            "rounds": rounds_done,
            "min_rounds": self.min_rounds,
            "max_rounds": self.max_rounds,
            "target_half_width": self.target,
            "half_widths": widths,
            "met": bool(widths) and max(widths.values()) <= self.target,
            "reason": self.reason,
        }


def fmt_ci(s: Mapping[str, float], digits: int = 3, *, scale: float = 1.0) -> str:
    """ "0.998 [0.988, 1.010]": the median and its 95% interval (a note when n < 6)."""
    f = f"{{:.{digits}f}}"
    med, lo, hi = (scale * s[k] for k in ("median", "ci95_lo", "ci95_hi"))
    few = f" (n={s['n']}: the range, {100 * s['coverage']:.0f}%)" if s["coverage"] < 0.95 else ""
    return f"{f.format(med)} [{f.format(lo)}, {f.format(hi)}]{few}"


def judge(s: Mapping[str, float], target: float, *, higher: bool = True) -> str:
    """Met / not met on the median, and whether the 95% interval resolves it."""
    lo, hi = (s["ci95_lo"], s["ci95_hi"]) if higher else (-s["ci95_hi"], -s["ci95_lo"])
    med, t = (s["median"], target) if higher else (-s["median"], -target)
    if med >= t:
        return "met" if lo >= t else "met on the median, not resolved (the 95% CI crosses it)"
    return "not met, within noise (the 95% CI crosses it)" if hi >= t else "not met"
