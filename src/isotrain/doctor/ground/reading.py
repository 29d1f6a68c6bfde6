"""How the model reads each of its token inputs, measured by changing one token at a time.

NOTE [the last token read]
For a (batch, time) integer input of the model's call, the output at position t may change
with token t (a causal LM, a decoder fed its input), only with token t-1 (the model shifts that
input right itself, as a decoder built from its target does), also with token t+1 (it reads
ahead: an encoder's input, or a mask that lets the future in), or with none of them (not read:
targets handed to a model that only scores with them); an input of another length than the
output's time axis is not aligned with it at all (an encoder's source sentence). Checks that
judge alignment (labels_not_shifted) or causality (causal_leak) need to know which is which.
"""

from __future__ import annotations

from typing import Any

import torch

from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.inputs import describe, swap_token

__all__ = ["AHEAD", "UNALIGNED", "UNREAD", "last_read", "token_inputs"]

AHEAD, UNREAD = "reads ahead", "not read"
UNALIGNED = "its positions are not the output's"  # another length: an encoder's input
_NOT_TOKENS = ("mask", "position", "type_ids")  # keyword names of (B, T) ints that are not ids


def token_inputs(ctx: Context) -> list[tuple[str, torch.Tensor, Any]]:
    """(name, ids, path) of each (B, T>=3) token tensor the model's call for the first batch
    passes, the main input first (CannotRun when no call was recorded)."""
    call = ctx.call(ctx.batches[0])
    found = [(p, t) for p, t in call.token_inputs() if t.shape[1] >= 3 and not (
        p[0] == 1 and any(w in str(p[1]) for w in _NOT_TOKENS))]  # fmt: skip
    return [(describe(p), t, p) for p, t in found]


def last_read(ctx: Context, path: Any, ids: torch.Tensor) -> int | str | None:
    """How far behind position t is the last token of `ids` the output at t reads: 0 (token
    t), 1 (token t-1: shifted right inside), AHEAD, UNREAD, or UNALIGNED (the output's time
    axis has another length); None when not measurable (NOTE [the last token read])."""
    B, T = ids.shape
    t = T // 2
    swapped = [swap_token(ids, i) for i in (t, t - 1, t + 1)]
    changed = [c for c in swapped if c is not None]
    if len(changed) < len(swapped):
        return None
    call = ctx.call(ctx.batches[0])
    model, _ = ctx.fresh()
    try:
        calls = [call, *(call.with_at(path, c) for c in changed)]
        outs = ctx.same_draws(model, calls, train=False)
    except CannotRun:
        return None
    finally:
        ctx.reset()
    if outs[0].dim() == 2 and outs[0].shape[0] == B * T:
        outs = [o.view(B, T, -1) for o in outs]
    if outs[0].dim() >= 2 and outs[0].shape[0] == B and outs[0].shape[1] != T:
        return UNALIGNED
    if outs[0].dim() < 2 or tuple(outs[0].shape[:2]) != (B, T):
        return None
    base = outs[0][:, t]
    scale = base.abs().max().clamp_min(1e-6)
    own, before, after = (bool((o[:, t] - base).abs().max() / scale > 1e-5) for o in outs[1:])
    if after:
        return AHEAD
    return 0 if own else 1 if before else UNREAD
