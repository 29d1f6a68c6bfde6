"""padding_leak: the tokens at padded positions change the outputs of the real ones.

The invariant: padding is not data. Change one argument of the call only where its rows are
padding and the outputs at its real positions, or a pooled output per sample, must not move.
Every padded argument is judged on its own (the main input, and each integer (B, T) sequence
beside it: token types, position ids, a recommender's item sequences, a seq2seq target), with
the padding its own mask names, or its pad id filling the rows' ends (model.padded). Where a
real token at the padding moves the output, the model's own states there are moved with the
ids kept (NOTE [the ids kept] in model.padstates): a model that takes its mask from the pad id
keeps its outputs then, and is not named. Where it computes no such state (a padding_idx
embedding into an RNN), one more pad id at the end of every right-padded row must not move the
real outputs either. It catches a mask never passed on, inverted
(`key_padding_mask=attention_mask`), applied on the wrong axis or to one sequence of several,
real queries attending to (zeroed) padded keys, and a mean or last-state pooling over the
padding, whichever side it is on.

Cost: one forward, then one per padded argument (at most model.padded.MAX_ARGS), and one or
two more for each argument whose padding moved the output: 1 + 3 * MAX_ARGS at the most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.inputs import ModelCall
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.model.inplace import model_output
from isotrain.doctor.model.padded import Padded, padded_arguments
from isotrain.doctor.model.padstates import PadStates, aligned

__all__ = ["PADDING_LEAK", "check_padding_leak"]

_FIX = (
    "pass the mask to every attention in the orientation it expects (nn.MultiheadAttention's "
    "key_padding_mask is True at padding: ~attention_mask.bool()), and pool with it: "
    "(h * m).sum(1) / m.sum(1), or the last real position's state"
)


@dataclass(frozen=True)
class _Moved:
    """How far an output moved at the argument's real positions (or per sample)."""

    rel: float
    rows: list[int]
    what: str


@dataclass(frozen=True)
class _Leak:
    arg: Padded
    moved: _Moved  # by a real token at the padding
    confirmed: _Moved | None  # by the second measurement (None: a given mask needs none)
    by: str  # what that second measurement moved


class _Unjudged(Exception):
    """One argument the check could not judge (the others still are)."""


def _changed(x: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """`x` with its padded positions (B, T) set to a real token, or moved by noise."""
    y = x.clone()
    if x.is_floating_point():
        g = torch.Generator(device=x.device).manual_seed(0)
        y[pads] += torch.randn(y[pads].shape, generator=g, device=x.device, dtype=x.dtype)
    else:
        real = x[~pads]
        other = real.max() if bool(real.max() != x[pads][0]) else real.min()
        y[pads] = other
    return y


def _moved(a: torch.Tensor, b: torch.Tensor, arg: Padded) -> _Moved | None:
    """The change from `a` to `b` at `arg`'s real positions (per sample when the output has
    no time axis of its length), relative to `a`'s scale; None below 1e-5."""
    if a.shape != b.shape:
        raise CannotRun(
            f"the output's shape changed with the padding of {arg.label} ({tuple(a.shape)})"
        )
    per_position = a.dim() >= 2 and a.shape[:2] == arg.pads.shape
    keep = ~arg.pads if per_position else torch.ones(a.shape[0], dtype=torch.bool)
    keep = keep.to(a.device)
    keep = keep.view(*keep.shape, *([1] * (a.dim() - keep.dim()))) & a.isfinite() & b.isfinite()
    diff = torch.where(keep, (a - b).abs(), 0.0)  # NaN rows (all keys masked) aside
    scale = torch.where(keep, a.abs(), 0.0).max().clamp_min(1e-6)
    rel = float((diff.max() / scale).item())
    if rel <= 1e-5:
        return None
    per_row = diff.reshape(diff.shape[0], -1).amax(1)  # a (B,) output too: one score each
    rows = (per_row / scale > 1e-5).nonzero().flatten().tolist()
    pooled = "per-sample outputs (pooled)" if a.dim() <= 2 else "outputs (every position)"
    what = "outputs at real positions" if per_position else pooled
    return _Moved(rel, rows, what)


def _judge(
    ctx: Context, model: nn.Module, call: ModelCall, arg: Padded, a: torch.Tensor, seen: PadStates
) -> _Leak | None:
    """One argument: a real token at its padding; where that moves the real outputs, the
    model's own states there moved with the ids kept decide (NOTE [the ids kept]). Where none
    could be moved: a given mask leaves no doubt; a pad id at the rows' ends is judged by one
    more at the end of every row; any other padding is left unjudged."""
    changed = PadStates()
    x = _changed(arg.tensor, arg.pads)
    moved = _moved(a, model_output(ctx, model, arg.with_tensor(call, x), changed), arg)
    if moved is None:
        return None
    ids = None if arg.tensor.is_floating_point() else arg.tensor
    probe = PadStates(ids, arg.pads, aligned(seen, changed, arg.pads))
    kept = _moved(a, model_output(ctx, model, call, probe), arg)
    if probe.embeddings or probe.states:
        counts = ((probe.embeddings, "embedding output"), (probe.states, "hidden state"))
        states = " and ".join(f"{n} {what}{'s' * (n > 1)}" for n, what in counts if n)
        by = f"noise on {states} the model computes there, the ids kept"
        return _Leak(arg, moved, kept, by) if kept is not None else None
    if arg.masked:
        return _Leak(arg, moved, None, "")
    longer = arg.longer(call)
    if longer is None:
        raise _Unjudged(
            f"{arg.label}'s padding ({arg.how}) set to a real token moves the outputs, as it "
            "does in a model that takes its mask from the pad id, and with the ids kept the "
            "doctor found no state of the model there to move (an embedding's padding_idx is "
            "left as the model fixed it); pass the attention mask to the model to have it judged"
        )
    more = _moved(a, _first_steps(_longer_output(ctx, model, longer, arg), a), arg)
    return _Leak(arg, moved, more, "one more pad id at the end of every row") if more else None


def _longer_output(ctx: Context, model: nn.Module, call: ModelCall, arg: Padded) -> torch.Tensor:
    """The output for the call with one more pad id per row; _Unjudged if the model refuses it."""
    try:
        return model_output(ctx, model, call)
    except CannotRun as e:
        raise _Unjudged(
            f"{arg.label}'s padding ({arg.how}) set to a real token moves the outputs, and the "
            f"model does not take one more pad id at the end of its rows ({e}); pass the "
            "attention mask to the model to have it judged"
        ) from e


def _first_steps(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """`b`, an output one step longer than `a` on its time axis, cut to `a`'s length."""
    if b.dim() >= 2 and b.shape[0] == a.shape[0] and b.shape[1] == a.shape[1] + 1:
        return b[:, : a.shape[1]]
    return b


def check_padding_leak(ctx: Context) -> list[Finding]:
    """padding_leak: do any padded argument's padded positions change the real outputs?"""
    call = ctx.call(ctx.batches[0])
    args, notes = padded_arguments(ctx, call)
    if not args:
        if notes:
            raise CannotRun("; ".join(notes))
        return []  # no padding in the batch: nothing can leak from it
    model, _ = ctx.fresh()
    model.eval()  # dropout off: examine puts every flag back after the check
    seen = PadStates()
    a = model_output(ctx, model, call, seen)
    leaks = []
    for arg in args:
        try:
            leak = _judge(ctx, model, call, arg, a, seen)
        except (_Unjudged, CannotRun) as e:
            notes.append(str(e))
            continue
        leaks += [leak] if leak is not None else []
    if leaks:
        return [_finding(leaks)]
    if notes:
        raise CannotRun("; ".join(notes))
    return []


def _finding(leaks: list[_Leak]) -> Finding:
    """One finding for the call, naming the first leaking argument and then the others."""
    first, moved = leaks[0], leaks[0].moved
    masked = any(leak.arg.masked for leak in leaks)
    rows = ", ".join(map(str, moved.rows[:5])) + (" ..." if len(moved.rows) > 5 else "")
    also = first.confirmed
    confirmed = f", and so did {first.by} (by {also.rel:.2g} relative)" if also else ""
    others = "".join(f"; so does the padding of {x.arg.label} ({x.arg.how})" for x in leaks[1:])
    sev: Severity = "error" if masked else "warning"
    return Finding(
        "padding_leak", sev, "model forward",
        f"changing only the {int(first.arg.pads.sum())} padded positions of {first.arg.label} "
        f"({first.arg.how}) to a real token changed the {moved.what} of row(s) {rows} (by "
        f"{moved.rel:.2g} relative){confirmed}: a sample's result depends on its padding{others}"
        + ("" if masked else "; the model is given no mask to ignore it"),
        _FIX if masked else f"pass the attention mask to the model; {_FIX}",
    )  # fmt: skip


PADDING_LEAK = Check(
    "padding_leak",
    (Kind("padding_leak",
          "changing the padded positions' inputs changes the real positions' outputs"),),
    check_padding_leak,
)  # fmt: skip
