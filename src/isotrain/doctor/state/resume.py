"""resume_mismatch: a run resumed by the user's own save/load code against one not interrupted.

From examine's state, the step runs BEFORE calls, `save(path)`, AFTER more calls (the run not
interrupted); then everything is put back to examine's state (what a new process holds
before it loads), `load(path)`, and the same AFTER calls again. The parameters must end
bitwise equal. What `load` did not bring back is named by comparing, at the save and right
after the load: parameters and buffers, optimizer state and hyperparameters, the schedulers
bound to the optimizers, the state the step keeps (a GradScaler, a counter) and the RNGs.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from isotrain._shared import capture_rng
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.probe import probe_ok

__all__ = ["RESUME", "check_resume"]

BEFORE, AFTER = 2, 2  # calls of the step before the save, and after it


def _pieces(ctx: Context) -> dict[str, list[Any]]:
    """Every piece of training state, flattened to comparable leaves (tensors copied: the live
    ones change in place), by name."""
    out: dict[str, list[Any]] = {
        "model parameters and buffers": list(ctx.model.state_dict().values()),
        "optimizer state (moments, step counts)": [
            v for o in ctx.optimizers for s in o.state.values() for v in s.values()
        ],
        "optimizer hyperparameters (lr)": [
            g.get("lr") for o in ctx.optimizers for g in o.param_groups
        ],
        "learning-rate schedulers": [
            (s.last_epoch, *s.get_last_lr()) if hasattr(s, "last_epoch") else s.state_dict()
            for s in ctx.snapshot.scheduler_objects
        ],
        "GradScaler scale": [
            v._scale for _, _, v, _ in ctx.step_state.slots
            if isinstance(v, torch.amp.GradScaler) and v._scale is not None
        ],
        "RNG states (torch, random, numpy)": _rng(),
    }  # fmt: skip
    return {k: [_kept(v) for v in leaves] for k, leaves in out.items()}


def _kept(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return tuple(_kept(v) for v in value) if isinstance(value, tuple) else value


def _rng() -> list[Any]:
    state = capture_rng()
    leaves = [state["torch"], repr(state["python"])]
    if "numpy" in state:
        leaves.append(repr(state["numpy"][1].tolist()))
    return leaves


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    try:
        return bool(a == b)
    except Exception:
        return False


def _missing(saved: dict[str, list[Any]], loaded: dict[str, list[Any]]) -> list[str]:
    """The pieces that differ between the save and right after the load."""
    return [
        name for name, values in saved.items()
        if len(values) != len(loaded[name])
        or not all(_equal(a, b) for a, b in zip(values, loaded[name], strict=True))
    ]  # fmt: skip


def _run(ctx: Context, model: Any, opt: Any, start: int, calls: int) -> None:
    for i in range(start, start + calls):
        ctx.run_step(model, opt, ctx.batches[i % len(ctx.batches)])


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def check_resume(ctx: Context) -> list[Finding]:
    """resume_mismatch: the resumed run's parameters against the uninterrupted run's."""
    if ctx.checkpoint is None:  # said only when asked for by name: most setups pass none
        if "resume_mismatch" not in ctx.asked:
            return []
        raise CannotRun("pass save=your_save(path) and load=your_load(path) to check a resume")
    probe_ok(ctx)
    save, load = ctx.checkpoint
    with tempfile.TemporaryDirectory(prefix="isotrain-doctor-") as where:
        path = os.path.join(where, "checkpoint")
        model, opt = ctx.fresh()
        _run(ctx, model, opt, 0, BEFORE)
        save(path)
        saved = _pieces(ctx)
        _run(ctx, model, opt, BEFORE, AFTER)
        straight = _params(model)
        model, opt = ctx.fresh()
        load(path)
        loaded = _pieces(ctx)
        _run(ctx, model, opt, BEFORE, AFTER)
        resumed = _params(model)
    differ = {n: (t - straight[n]).abs().max().item() for n, t in resumed.items()
              if not torch.equal(t, straight[n])}  # fmt: skip
    missing = _missing(saved, loaded)
    if not differ and not missing:
        return []
    what = "; not brought back by your load: " + ", ".join(missing) if missing else ""
    if not differ:
        return [Finding(
            "resume_mismatch", "info", "your save/load",
            f"the resumed run ended as the one not interrupted{what} (no effect on these "
            f"{AFTER} calls)",
            "save and load it too if later steps read it",
        )]  # fmt: skip
    return [Finding(
        "resume_mismatch", "error", "your save/load",
        f"{BEFORE} calls of your step, save, {AFTER} more; load, the same {AFTER} again: "
        f"{len(differ)} parameter(s) end differently (max |difference| "
        f"{max(differ.values()):.3g}){what}",
        "save and load every piece of training state: model, optimizer, scheduler and "
        "GradScaler state_dicts, the RNG states (torch, numpy, random) and your step counter; "
        "load the optimizer after building the schedulers",
    )]  # fmt: skip


RESUME = Check(
    "resume",
    (
        Kind(
            "resume_mismatch",
            "a run resumed by your save/load differs from one not interrupted",
        ),
    ),
    check_resume,
)
