"""`Monitor`: cheap invariants of a real training run, checked every N steps as it goes.

At a check step the optimizer's step pre-hook takes checksums of the gradients it is about to
apply (and their largest |value|, and each group's learning rate); `after_step()` then takes
the parameters' checksums and compares: across ranks in one all-reduce of a few integers per
parameter (`replica_divergence`, `lost_update`), against the previous check (parameters still
changing), against NaN/Inf, against the learning-rate schedule given. Everything stays on the
device until that check's one read (`# sync:`); other steps cost one integer test.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Kind
from isotrain.doctor.monitor.text import (
    diverged,
    lost_update,
    lr_finding,
    nonfinite,
    stalled,
    unreachable,
)
from isotrain.doctor.ranks.link import (
    RankError,
    Ranks,
    checksum,
    distributed,
    float_sum,
    split_ranks,
)

__all__ = ["DEFAULT_EVERY", "KINDS", "Monitor"]

log = logging.getLogger("isotrain.doctor")
DEFAULT_EVERY = 10  # measured: benchmarks/bench_monitor.py (under 1% of a tiny step at 1 too)
STALL_STEPS = 20  # a held, trainable parameter unchanged this long is reported
LR_RTOL = 1e-5
_LEVELS = {"error": logging.ERROR, "warning": logging.WARNING}

# the kinds only a real run shows (a Monitor also reports replica_divergence)
KINDS = (
    Kind(
        "lost_update",
        "Monitor: the gradients optimizer.step() applied differ across ranks (an all-reduce's "
        "result differed)",
    ),
    Kind(
        "nonfinite_grad",
        "Monitor: optimizer.step() got NaN/Inf gradients (an error once a parameter holds NaN/Inf)",
    ),
    Kind("lr_off_schedule", "Monitor: a step's learning rate is not the one its schedule gives"),
)

Schedule = Callable[[int], "float | Sequence[float]"]


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "to_local", None)
    return local() if callable(local) else t


def _sharded(t: torch.Tensor) -> bool:
    placements = getattr(t, "placements", None)
    return placements is not None and not all(p.is_replicate() for p in placements)


class Monitor:
    """Watch a running training every `every` steps; report each problem once as a `Finding`
    (logged, passed to `on_finding`, kept in `.findings`).

    `schedule(step) -> lr` (or a list, one per param group) is the learning rate optimizer
    step `step` (from 0) should use. Under a process group, build it on every rank at the same
    point and call `after_step()` on every rank; each exchange waits at most `timeout` s.
    `logger=None` leaves the reporting to `on_finding`.

    Example::

        monitor = Monitor(model, optimizer, every=10, schedule=lambda s: sched_lr(s))
        for batch in data:
            loss = model(batch).backward(); optimizer.step(); optimizer.zero_grad()
            monitor.after_step()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        every: int = DEFAULT_EVERY,
        schedule: Schedule | None = None,
        on_finding: Callable[[Finding], Any] | None = None,
        start_step: int = 0,
        timeout: float = 600.0,
        logger: logging.Logger | None = log,
    ) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"Monitor needs a torch.optim.Optimizer (it hooks its step), got "
                f"{type(optimizer).__name__}; pass the one inside the wrapper (e.g. .optimizer)"
            )
        base = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        named = list(base.named_parameters()) if isinstance(base, nn.Module) else []
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.trainable = [p.requires_grad and id(p) in group_of for p in self.params]
        self._group = [group_of.get(id(p), 0) for p in self.params]
        self.shared = [not _sharded(p) for p in self.params]  # whole on every rank
        self.optimizer, self.every, self.schedule = optimizer, every, schedule
        self.on_finding, self.step, self.logger = on_finding, start_step, logger
        self.checked_at: int | None = None  # the step of the last check
        self.findings: list[Finding] = []
        self._said: set[tuple[str, str]] = set()
        self._pending: dict[str, Any] | None = None  # what the pre-hook took at a check step
        self._last: list[int] | None = None
        self._changed_at = [start_step] * len(self.params)
        self.ranks = Ranks(timeout=timeout, label="monitor") if distributed() else None
        self._hook = optimizer.register_step_pre_hook(self._pre_step)

    # -- the hot path: one integer test per step --------------------------------------------
    def _due(self, step: int) -> bool:
        return step % self.every == 0

    def _pre_step(self, optimizer: Any, *_: Any) -> None:
        """At the step before a check: the gradients about to be applied, and the LRs."""
        if not self._due(self.step + 1) or self._pending is not None:
            return
        grads = [_local(p.grad) if p.grad is not None else None for p in self.params]
        present = [g for g in grads if g is not None]
        if not present:
            return
        zero = torch.zeros((), dtype=torch.int64, device=present[0].device)
        sums = torch.stack([checksum(g) if g is not None else zero for g in grads])
        totals = torch.stack([float_sum(g) for g in present])
        self._pending = {
            "step": self.step,
            "sums": sums,
            "has": [g is not None for g in grads],
            "total": totals,
            "lr": [float(g["lr"]) for g in self.optimizer.param_groups],  # sync: a check step
        }

    def after_step(self) -> list[Finding]:
        """Count a finished optimizer step; every `every` steps, check. Returns new findings."""
        self.step += 1
        return self.check_now() if self._due(self.step) else []

    def check_now(self) -> list[Finding]:
        """Check at this step, whatever the period (every rank at the same point): e.g. before
        a snapshot, so that each snapshot is known to be consistent."""
        try:
            return self._check()
        finally:
            self._pending, self.checked_at = None, self.step

    # -- a check --------------------------------------------------------------------------
    def _check(self) -> list[Finding]:
        device = self.params[0].device if self.params else torch.device("cpu")
        local = [_local(p) for p in self.params]
        sums = torch.stack([checksum(t) for t in local]) if local else torch.zeros(0, device=device)
        totals = [float_sum(t) for t in local]
        pending = self._pending
        # sync: one read of this check's few numbers per parameter
        param_sums = sums.cpu()
        param_total = torch.stack(totals).cpu() if totals else torch.zeros(0)
        grad_sums = pending["sums"].cpu() if pending else None
        found: list[Finding] = []
        if self.ranks is not None:
            found += self._across(param_sums, grad_sums)
        found += self._stalls(param_sums.tolist(), param_total.isfinite().tolist())
        if pending is not None:
            grad_total = pending["total"].cpu()
            found += nonfinite(
                self.step, self.names, pending["has"], grad_total, param_total, self.trainable
            )
            found += self._schedule(pending["step"], pending["lr"])
        return self._report(found)

    def _across(self, param_sums: torch.Tensor, grad_sums: torch.Tensor | None) -> list[Finding]:
        """One all-reduce of (step, parameter sums, gradient sums) over the replicated parts."""
        ranks, keep = self.ranks, torch.tensor(self.shared, dtype=torch.bool)
        if ranks is None:
            return []
        grads = grad_sums if grad_sums is not None else torch.zeros_like(param_sums)
        head = torch.tensor([self.step, int(grad_sums is not None)])
        try:
            hi, lo = ranks.max_min(
                torch.cat([head, param_sums[keep], grads[keep]]), f"the check at step {self.step}"
            )
            if hi[0] != lo[0]:
                raise RankError(f"ranks call after_step() at steps {int(lo[0])} to {int(hi[0])}")
            n = int(keep.sum())
            p_bad = (hi[2 : 2 + n] != lo[2 : 2 + n]).tolist()
            g_bad = (hi[2 + n :] != lo[2 + n :]).tolist() if bool(lo[1]) else [False] * n
            if not any(p_bad) and not any(g_bad):
                return []
            return self._name(ranks, p_bad, g_bad, param_sums[keep], grads[keep])
        except RankError as e:
            self.ranks = None  # compare no more: the ranks are out of step
            ranks.close()
            return [unreachable(self.step, str(e))]

    def _name(
        self, ranks: Ranks, p_bad: list[bool], g_bad: list[bool], psums: torch.Tensor,
        gsums: torch.Tensor,
    ) -> list[Finding]:  # fmt: skip
        """The slow path, once something differs: which ranks, and the largest difference."""
        names = [n for n, k in zip(self.names, self.shared) if k]
        params = [p for p, k in zip(self.params, self.shared) if k]
        got = ranks.gather(f"the ranks' sums at step {self.step}", (psums, gsums))
        out = []
        if any(g_bad):
            i = g_bad.index(True)
            who = split_ranks([int(g[1][i]) for g in got])
            out.append(
                lost_update(self.step, [n for n, b in zip(names, g_bad) if b], len(names), who)
            )
        if any(p_bad):
            i = p_bad.index(True)
            who = split_ranks([int(g[0][i]) for g in got])
            spread = ranks.spread(params[i], f"{names[i]} at step {self.step}")
            bad = [n for n, b in zip(names, p_bad) if b]
            out.append(diverged(self.step, bad, len(names), who, spread))
        return out

    def _stalls(self, sums: list[int], finite: list[bool]) -> list[Finding]:
        """Held, trainable parameters whose checksum has not moved for STALL_STEPS steps (a NaN
        one is said once, as nonfinite_grad)."""
        for i, (a, b) in enumerate(zip(sums, self._last or sums)):
            if a != b or self._last is None:  # the first check is the baseline
                self._changed_at[i] = self.step
        self._last = sums
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        still = [
            self.names[i]
            for i, t in enumerate(self.trainable)
            if t
            and finite[i]
            and lrs[self._group[i]] > 0
            and self.step - self._changed_at[i] >= STALL_STEPS
        ]
        total = sum(self.trainable)
        return stalled(self.step, still, total) if still else []

    def _schedule(self, step: int, lrs: list[float]) -> list[Finding]:
        if self.schedule is None:
            return []
        want = self.schedule(step)
        wanted = [float(w) for w in want] if isinstance(want, Sequence) else [float(want)]
        for group, (have, should) in enumerate(zip(lrs, wanted)):
            if abs(have - should) > LR_RTOL * max(abs(should), 1e-12):
                return [lr_finding(step, group, have, should)]
        return []

    def _report(self, found: list[Finding]) -> list[Finding]:
        """Log and hand over each finding not reported before (by kind and where)."""
        new = []
        for f in found:
            if (f.kind, f.where) in self._said:
                continue
            self._said.add((f.kind, f.where))
            new.append(f)
            if self.logger is not None:
                level = _LEVELS.get(f.severity, logging.INFO)
                self.logger.log(
                    level, "%s at step %d: %s: %s", f.kind, self.step, f.where, f.evidence
                )
            if self.on_finding is not None:
                self.on_finding(f)
        self.findings += new
        return new

    def close(self) -> None:
        """Remove the optimizer hook and drop the link between ranks."""
        self._hook.remove()
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
