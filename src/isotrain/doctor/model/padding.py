"""padding_leak: the tokens at padded positions change the outputs of the real ones.

The invariant: padding is not data. Change the input only where a row is padding (where the
call's attention mask is 0, or a `*padding_mask` is True; without a mask, the model config's
pad id or the value filling the rows' ends in runs of different lengths) and the outputs at
real positions, or a pooled output per sample, must not move. It catches a mask never passed
on, inverted (`key_padding_mask=attention_mask`), applied on the wrong axis, and a mean or
last-state pooling over the padding, whichever side it is on.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.model.inplace import model_output

__all__ = ["PADDING_LEAK", "check_padding_leak"]

_FIX = (
    "pass the mask to every attention in the orientation it expects (nn.MultiheadAttention's "
    "key_padding_mask is True at padding: ~attention_mask.bool()), and pool with it: "
    "(h * m).sum(1) / m.sum(1), or the last real position's state"
)


def _named(obj: Any, name: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) of every tensor under a mapping key in nested containers."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _named(v, str(k))
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _named(v, name)


def _from_mask(call: Any, x: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """(real (B, T) bool, how) from a 0/1 tensor named like a mask in the call, or None."""
    for name, m in _named((call.args, call.kwargs)):
        low = name.lower()
        if "mask" not in low or m.dim() != 2 or m.shape != x.shape[:2] or m.is_floating_point():
            continue
        if not bool(((m == 0) | (m == 1)).all()):
            continue
        pad = m.bool() if "pad" in low else ~m.bool()
        return ~pad, f"{name} {'True' if 'pad' in low else '0'}"
    return None


def _end_runs(rows: torch.Tensor, value: int) -> torch.Tensor:
    """(B, T) bool: the positions of each row's leading and trailing runs of `value`."""
    tail = (rows.flip(1) == value).int().cumprod(1).flip(1).bool()
    head = (rows == value).int().cumprod(1).bool()
    return tail | head


def _from_pad_id(ctx: Context, x: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """(real, how) from the config's pad id, or the value filling the rows' ends in runs of
    different lengths (padding to the longest row), for (B, T) token ids without a mask."""
    if x.is_floating_point() or x.dim() != 2:
        return None
    pad = getattr(getattr(ctx.model, "config", None), "pad_token_id", None)
    candidates = [pad] if isinstance(pad, int) else [int(v) for v in x[:, [0, -1]].unique()]
    eos = getattr(getattr(ctx.model, "config", None), "eos_token_id", None)
    for value in candidates:
        runs = _end_runs(x, value)
        lengths = runs.sum(1)
        if bool(runs.all(1).any()) or bool((x[~runs] == value).any()):
            continue  # a row all of it, or the value inside the text: not padding
        if isinstance(pad, int) and int(lengths.max()) >= (2 if pad == eos else 1):
            return ~runs, f"the config's pad_token_id={pad}"
        if int((lengths > 0).sum()) >= 2 and len(lengths.unique()) >= 2 and int(lengths.max()) >= 2:
            return ~runs, f"{value}, filling the ends of {int((lengths > 0).sum())} rows"
    return None


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


def check_padding_leak(ctx: Context) -> list[Finding]:
    """padding_leak: do the padded positions' inputs change the real positions' outputs?"""
    batch = ctx.batches[0]
    x, rebuild = ctx.main_input(batch)
    call = ctx.call(batch)
    found = _from_mask(call, x) if x.dim() >= 2 else None
    masked = found is not None
    found = found or (_from_pad_id(ctx, x) if x.dim() >= 2 else None)
    if found is None or not bool((~found[0]).any()):
        return []  # no padding in the batch: nothing can leak from it
    real, how = found
    pads = ~real
    if not bool(real.any()):
        raise CannotRun(f"every position of the first batch is padding ({how})")
    model, _ = ctx.fresh()
    model.eval()  # dropout off: examine puts every flag back after the check
    a = model_output(ctx, model, call)
    b = model_output(ctx, model, rebuild(_changed(x, pads)))
    if a.shape != b.shape:
        raise CannotRun(f"the output's shape changed with the padding's tokens ({tuple(a.shape)})")
    per_position = a.dim() >= 2 and a.shape[:2] == x.shape[:2]
    keep = real if per_position else torch.ones(a.shape[0], dtype=torch.bool)
    keep = keep.view(*keep.shape, *([1] * (a.dim() - keep.dim()))) & a.isfinite() & b.isfinite()
    diff = torch.where(keep, (a - b).abs(), 0.0)  # NaN rows (all keys masked) aside
    scale = torch.where(keep, a.abs(), 0.0).max().clamp_min(1e-6)
    moved = float((diff.max() / scale).item())
    if moved <= 1e-5:
        return []
    rows = (diff.flatten(1).amax(1) / scale > 1e-5).nonzero().flatten().tolist()
    what = "outputs at real positions" if per_position else "per-sample outputs (pooled)"
    sev: Severity = "error" if masked else "warning"
    return [Finding(
        "padding_leak", sev, "model forward",
        f"changing only the {int(pads.sum())} padded positions ({how}) changed the {what} of "
        f"row(s) {', '.join(map(str, rows[:5]))}{' ...' if len(rows) > 5 else ''} (by "
        f"{moved:.2g} relative): a sample's result depends on its padding"
        + ("" if masked else "; the model is given no mask to ignore it"),
        _FIX if masked else f"pass the attention mask to the model; {_FIX}",
    )]  # fmt: skip


PADDING_LEAK = Check(
    "padding_leak",
    (Kind("padding_leak",
          "changing the padded positions' inputs changes the real positions' outputs"),),
    check_padding_leak,
)  # fmt: skip
