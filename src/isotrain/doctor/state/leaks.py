"""Leaks of invisible state: what eval_fn (or the step) changes and leaves changed.

`StateAudit` does the measuring: every submodule's training flag, grad mode, autocast, the
default dtype, deterministic flags, threads, subnormals, every buffer and the global RNGs.
Here its differences become findings, and two steps with and without eval_fn between them
show whether the validation pass changes the training that follows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from isotrain._shared import capture_rng, restore_rng, rng_differences
from isotrain._torch_private import DataLoaderIter
from isotrain.contexts import StateAudit
from isotrain.doctor.ground.context import BATCH_NORMS, CannotRun, Context, as_loss, params_of
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.probe import probe_ok
from isotrain.doctor.ground.snapshot import Snapshot
from isotrain.doctor.ground.trace import patched

__all__ = ["LEAKS", "RNG_LEAK", "check_leaks", "check_rng_leak"]

_EVAL_FIX = (
    "run the validation pass inside `with isotrain.contexts.eval_mode(model):`, which puts "
    "every submodule in eval and restores each one's own flag afterwards"
)
_FIX = {
    "mode_leak": _EVAL_FIX + " (a bare model.eval() without model.train() leaks eval mode, "
    "and model.train() flips submodules you had frozen in eval)",
    "grad_mode_leak": "use `with torch.no_grad():` (isotrain.contexts.eval_mode includes it) "
    "instead of torch.set_grad_enabled(False) without setting it back",
    "autocast_leak": "use `with isotrain.contexts.autocast_if_available(dtype):` instead of "
    "torch.autocast(...).__enter__() or torch.set_autocast_enabled without a restore",
    "global_state_leak": "scope the change in a `with` block or try/finally "
    "(isotrain.contexts.flush_subnormals for subnormals) and test it with "
    "isotrain.contexts.StateAudit(raise_on_leak=True)",
}


_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


def _kind_of(difference: str) -> str:
    if difference.startswith(("module ", "parameter ")):
        return "mode_leak"
    if difference.startswith(("grad mode", "inference mode")):
        return "grad_mode_leak"
    if difference.startswith("autocast"):
        return "autocast_leak"
    return "global_state_leak"


def _is_rng(difference: str) -> bool:
    return difference.endswith(" changed") and (
        "RNG state" in difference or "random state" in difference
    )


def _leak_findings(differences: list[str], who: str) -> list[Finding]:
    by_kind: dict[str, list[str]] = {}
    for d in differences:
        if not d.startswith("buffer ") and not _is_rng(d):
            by_kind.setdefault(_kind_of(d), []).append(d)
    out = []
    for kind, diffs in by_kind.items():
        shown = "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else "")
        if kind == "mode_leak":
            shown = _mode_summary(diffs)
        where = who if kind != "mode_leak" else _module_names(diffs)
        sev: Severity = "warning" if kind == "global_state_leak" else "error"
        out.append(Finding(kind, sev, where, f"after {who}: {shown}", _FIX[kind]))
    return out


def _mode_summary(diffs: list[str]) -> str:
    """'3 submodule(s) left in eval mode (were training): <root>, fc, drop'."""
    parts = []
    for before, after, state in (("True", "False", "eval"), ("False", "True", "training")):
        names = [d.split("'")[1] for d in diffs if d.endswith(f"training: {before} -> {after}")]
        if names:
            was = "training" if state == "eval" else "eval"
            parts.append(
                f"{len(names)} submodule(s) left in {state} mode (were in {was}): "
                + ", ".join(names[:4])
                + (" ..." if len(names) > 4 else "")
            )
    grads = [d for d in diffs if "requires_grad" in d]
    if grads:
        parts.append("; ".join(grads[:3]))
    return "; ".join(parts)


def _module_names(diffs: list[str]) -> str:
    names = [d.split("'")[1] for d in diffs if "'" in d]
    return ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")


@contextmanager
def _mode_spy(model: nn.Module) -> Iterator[dict[str, str]]:
    """Record dropout (p > 0) and BatchNorm modules that run in training mode."""
    seen: dict[str, str] = {}
    handles = []
    for name, m in model.named_modules():
        if isinstance(m, _DROPOUT) and m.p > 0:
            what = f"dropout p={m.p} active"
        elif isinstance(m, BATCH_NORMS) and m.track_running_stats:
            what = "BatchNorm updating its running statistics"
        else:
            continue

        def hook(
            mod: nn.Module, args: object, label: str = name or "<root>", w: str = what
        ) -> None:
            if mod.training:
                seen.setdefault(label, w)

        handles.append(m.register_forward_pre_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _step_result(ctx: Context, modes: dict[str, bool] | None) -> list[torch.Tensor]:
    """The loss and parameters after one call of the user's step from the state examine found,
    its modules' training flags set to `modes` first (None: as found)."""
    model, opt = ctx.fresh()
    if modes is not None:
        for name, m in model.named_modules():
            m.training = modes.get(name, m.training)
    loss = as_loss(ctx.run_step(model, opt, ctx.batches[0]))
    kept = [] if loss is None else [loss.detach().clone()]
    return kept + [p.detach().clone() for p in params_of(model).values()]


def _judged(ctx: Context, finding: Finding, left: dict[str, bool]) -> Finding:
    """A mode_leak of eval_fn judged by what it does: an error when the user's next step,
    started from the modes eval_fn left, computes another loss or update than from the modes
    it found; information when it computes the same (it sets the mode itself, or nothing the
    step runs reads it)."""
    if finding.kind != "mode_leak":
        return finding
    try:
        same = all(
            torch.equal(a, b)
            for a, b in zip(_step_result(ctx, None), _step_result(ctx, left), strict=True)
        )
    except Exception:  # the step cannot run twice here: the leak is judged by itself
        return finding
    finally:
        ctx.reset()
    if not same:
        return dataclasses.replace(
            finding, evidence=finding.evidence + "; your next step, run from there, computes "
            "another loss and update than from the modes it found"
        )  # fmt: skip
    return dataclasses.replace(
        finding, severity="info", evidence=finding.evidence + "; your next step, run from "
        "there, computes the same loss and update bit for bit (it sets the mode itself, or "
        "nothing it runs reads the mode): no effect on this training",
    )  # fmt: skip


def check_leaks(ctx: Context) -> list[Finding]:
    """mode/grad/autocast/global leaks of the step and of eval_fn, eval_in_train_mode,
    buffer_write_in_eval."""
    out = _leak_findings(probe_ok(ctx).step_leaks, "your step")
    if ctx.eval_fn is None:
        why = "no eval_fn given: pass eval_fn=your_validation(model, batches) to examine it"
        for kind in ("eval_in_train_mode", "buffer_write_in_eval"):
            out.append(Finding(kind, "info", "eval_fn", why, "pass eval_fn=..."))
        return out
    model, _ = ctx.fresh()
    audit = StateAudit(model, warn=False)
    with _mode_spy(model) as spied, audit:
        ctx.run_eval(model)
        left = {name: m.training for name, m in model.named_modules()}
    audit.restore()
    out += [_judged(ctx, f, left) for f in _leak_findings(audit.differences, "eval_fn")]
    if spied:
        names = list(spied)
        out.append(
            Finding(
                "eval_in_train_mode",
                "error",
                ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else ""),
                f"during eval_fn: {'; '.join(f'{n}: {w}' for n, w in list(spied.items())[:3])}",
                _EVAL_FIX,
            )
        )
    buffers = [d.split("'")[1] for d in audit.differences if d.startswith("buffer ")]
    if buffers:
        out.append(
            Finding(
                "buffer_write_in_eval",
                "error",
                ", ".join(buffers[:3]) + (f" (+{len(buffers) - 3})" if len(buffers) > 3 else ""),
                f"eval_fn changed {len(buffers)} buffer(s); BatchNorm running statistics are "
                "training state, and evaluation that updates them changes the model",
                _EVAL_FIX + " (BatchNorm in eval reads its statistics instead of updating them)",
            )
        )
    return out


def check_rng_leak(ctx: Context) -> list[Finding]:
    """rng_leak: step, [eval_fn], step from the same state; do the two trainings differ?"""
    if ctx.eval_fn is None:
        raise CannotRun("no eval_fn given: pass eval_fn=your_validation(model, batches)")
    probe_ok(ctx)
    model, opt = ctx.fresh()
    ctx.run_step(model, opt, ctx.batches[0])
    after_first = capture_rng()
    middle = Snapshot(model, ctx.optimizers, ctx.snapshot.scheduler_objects)  # for a rerun
    kept = ctx.step_state.now()  # a step counter, a hidden state: as after the first step
    ctx.run_step(model, opt, ctx.batches[1])
    plain = _values(model)
    middle.restore()
    kept.restore()
    restore_rng(after_first)
    audit = StateAudit(model, warn=False, check_rng=False)
    seeded: list[Any] = []  # DataLoaders whose iterators eval_fn started off the global RNG

    def counting(original: Any) -> Any:
        def init(it: Any, loader: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(loader, "generator", None) is None:
                seeded.append(loader)
            return original(it, loader, *args, **kwargs)

        return init

    with audit, patched(DataLoaderIter, "__init__", counting):
        ctx.run_eval(model)
    audit.restore()  # flags, buffers and grad mode back: only the RNG may differ now
    why = (
        f" ({len(seeded)} DataLoader iterator(s) it started drew their base seed from it, as a "
        "DataLoader without a generator of its own does, shuffle=False included)"
        if seeded else ""
    )  # fmt: skip
    own = "; or give the eval DataLoader its own generator=torch.Generator()" if seeded else ""
    consumed = capture_rng()
    ctx.run_step(model, opt, ctx.batches[1])
    now = _values(model)
    moved = [n for n, v in plain.items() if not torch.equal(v, now[n])]
    if moved:
        return [
            Finding(
                "rng_leak",
                "warning",
                "eval_fn",
                f"eval_fn drew from the training RNG{why}: the next step then changed "
                f"{len(moved)} parameter(s) differently (e.g. {moved[0]}) than without the "
                "evaluation",
                "wrap the validation pass in `isotrain.contexts.rng_isolated()` "
                f"(with isotrain.contexts.eval_mode(model), rng_isolated(seed=0): ...){own}",
            )
        ]
    if rng_differences(after_first, consumed):
        return [
            Finding(
                "rng_leak",
                "info",
                "eval_fn",
                f"eval_fn advanced the global RNG{why}, but this step draws no random numbers, "
                "so training is unchanged today (dropout or a shuffle added later would change)",
                f"wrap the validation pass in `isotrain.contexts.rng_isolated()`{own}",
            )
        ]
    return []


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in params_of(model).items()}


LEAKS = Check(
    "leaks",
    (
        Kind(
            "mode_leak",
            "after eval_fn or the step, a submodule's train/eval flag differs from before",
        ),
        Kind("grad_mode_leak", "after eval_fn or the step, grad mode (or inference mode) differs"),
        Kind("autocast_leak", "after eval_fn or the step, autocast is on, off or of another dtype"),
        Kind(
            "global_state_leak",
            "default dtype, deterministic flags, threads or subnormals changed",
        ),
        Kind("eval_in_train_mode", "eval_fn ran dropout or BatchNorm in training mode"),
        Kind("buffer_write_in_eval", "eval_fn changed a buffer (BatchNorm running statistics)"),
    ),
    check_leaks,
)


RNG_LEAK = Check(
    "rng_leak",
    (Kind("rng_leak", "running eval_fn between two steps changes the training that follows"),),
    check_rng_leak,
)
