"""The monitor's findings in words: what it measured at which step, and the fix."""

from __future__ import annotations

import math

import torch

from isotrain.doctor.ground.finding import Finding

__all__ = ["diverged", "lost_update", "lr_finding", "nonfinite", "stalled", "unreachable"]


def _list(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def unreachable(step: int, why: str) -> Finding:
    """The ranks could not be compared (a timeout, or ranks at other steps): said once."""
    return Finding(
        "doctor_error", "error", "across ranks",
        f"at step {step} the monitor stopped comparing ranks: {why}",
        "call after_step() on every rank after every optimizer step, and build the Monitor on "
        "every rank at the same point",
    )  # fmt: skip


def diverged(step: int, bad: list[str], total: int, ranks: str, spread: float) -> Finding:
    """replica_divergence: parameter checksums differ across ranks after a step."""
    return Finding(
        "replica_divergence", "error", _list(bad),
        f"at step {step}, {len(bad)} of {total} replicated parameters differ across ranks "
        f"({ranks}; max |difference| {spread:.3g} in {bad[0]}): the replicas drifted apart "
        "since the last check (an all-reduce whose result differed on a rank, or an update "
        "applied on some ranks only)",
        "stop and resume from the last consistent snapshot; look for rank-dependent code "
        "between backward and optimizer.step() and, if there is none, for a faulty device or "
        "link (run the same steps on other hardware)",
    )  # fmt: skip


def lost_update(step: int, bad: list[str], total: int, ranks: str) -> Finding:
    """lost_update: the gradients optimizer.step() applied differ across ranks."""
    return Finding(
        "lost_update", "error", _list(bad),
        f"at step {step}, the gradients optimizer.step() applied differ across ranks for "
        f"{len(bad)} of {total} replicated parameters ({ranks}): an all-reduce's result "
        "differed between ranks (faulty link or device, pytorch#84803), or something changed "
        "one rank's gradients after it",
        "stop and resume from the last consistent snapshot; if no code of yours touches "
        "gradients on some ranks only, test the hardware (NCCL_ALGO=Ring, another node)",
    )  # fmt: skip


def nonfinite(
    step: int, names: list[str], has: list[bool], grad_sums: torch.Tensor,
    param_sums: torch.Tensor, trainable: list[bool],
) -> list[Finding]:  # fmt: skip
    """nonfinite_grad: NaN/Inf in the applied gradients (an error once in a parameter); the
    sums are float sums, NaN/Inf where a tensor holds one."""
    with_grad = [n for n, h in zip(names, has) if h]
    bad_grads = [n for n, v in zip(with_grad, grad_sums.tolist()) if not math.isfinite(v)]
    bad_params = [
        n for n, v, t in zip(names, param_sums.tolist(), trainable) if t and not math.isfinite(v)
    ]
    if bad_params:
        return [Finding(
            "nonfinite_grad", "error", _list(bad_params),
            f"at step {step}, {len(bad_params)} parameter(s) hold NaN/Inf: a non-finite update "
            "reached the weights, and every step from here trains on them",
            "resume from the last snapshot before the NaN and keep such steps out of the "
            "weights: isotrain.guard.StepGuard (or GradScaler with fp16) skips them",
        )]  # fmt: skip
    if bad_grads:
        return [Finding(
            "nonfinite_grad", "info", _list(bad_grads),
            f"at step {step} optimizer.step() got NaN/Inf gradients in {len(bad_grads)} "
            "parameter(s), and the parameters stayed finite (the step was skipped)",
            "nothing to fix while steps are skipped; many in a row mean a data or precision "
            "problem (isotrain.guard.find_nonfinite_source names the first module)",
        )]  # fmt: skip
    return []


def stalled(step: int, still: list[str], total: int) -> list[Finding]:
    """params_unchanged: held, trainable parameters that stopped changing."""
    every = len(still) == total
    return [Finding(
        "params_unchanged", "error" if every else "warning", _list(still),
        f"at step {step}, {len(still)} of {total} trainable parameter(s) the optimizer holds "
        "have not changed for 20 steps or more (the learning rate is above 0)",
        "check that their gradients reach optimizer.step() (zero_grad between backward and "
        "step, a detached branch, a frozen copy) and that no step skipper skips every step",
    )]  # fmt: skip


def lr_finding(step: int, group: int, have: float, should: float) -> Finding:
    """lr_off_schedule: the learning rate applied is not the schedule's."""
    return Finding(
        "lr_off_schedule", "warning", f"param group {group}",
        f"optimizer step {step} used lr {have:.6g}; the schedule gives {should:.6g} for it",
        "step the scheduler once per optimizer step (not per micro-batch, not on skipped "
        "steps), and restore its state on resume (scheduler.load_state_dict)",
    )  # fmt: skip
