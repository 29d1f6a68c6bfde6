"""What the loss is given: the calls a check reads, and input and target shapes.

Each check reads the loss-function calls the trace's call watch saw in the first call of the
user's step, with their real arguments (`LossCall`), and the batch those calls came from.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from isotrain.doctor.ground.calls import ELEMENTWISE, LossCall
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import trace_ok

__all__ = ["LOSS_BROADCAST", "at", "check_loss_broadcast", "first_calls", "token_ids"]


def first_calls(ctx: Context) -> list[LossCall]:
    """The loss calls of the trace's first call of the step."""
    return [c for c in trace_ok(ctx).watch.calls if c.step == 0]


def at(call: LossCall) -> str:
    """The loss call named for the evidence, with the library line when it ran inside one."""
    return call.name + (f" (at {call.inner})" if call.inner != call.where else "")


def token_ids(ctx: Context, batch: Any) -> torch.Tensor | None:
    """The (batch, time) token ids the targets should be the next tokens of: the decoder's
    input for an encoder-decoder, else the model's main input."""
    if isinstance(batch, dict):
        if "decoder_input_ids" in batch:
            ids = batch["decoder_input_ids"]
        elif getattr(getattr(ctx.model, "config", None), "is_encoder_decoder", False):
            return None  # the decoder's input is made from the labels inside the model
        else:
            ids = batch.get("input_ids")
    else:
        try:
            ids = ctx.main_input(batch)[0]
        except CannotRun:
            return None
    ok = isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()
    return ids if ok and ids.shape[1] >= 2 else None


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def check_loss_broadcast(ctx: Context) -> list[Finding]:
    """loss_broadcast: an elementwise loss's input and target differ in shape and broadcast."""
    tr = trace_ok(ctx)
    out: dict[tuple[str, str], Finding] = {}
    for call in first_calls(ctx):
        a, b = call.input_shape, call.target_shape
        if call.name not in ELEMENTWISE or a == b:
            continue
        shape = _broadcast(a, b)
        if shape is None or math.prod(shape) == math.prod(a) == math.prod(b):
            continue  # (N,) against (N, 1) after a reduction of 1s: same numbers
        crossed = math.prod(shape) > max(math.prod(a), math.prod(b))
        said = [m for w, m in tr.watch.warned if w == call.where and "target size" in m]
        torch_said = f"; torch warned: {said[0].split('. ')[0]}" if said else ""
        what = (
            "every prediction is compared with every target"
            if crossed
            else "one side is repeated along the broadcast dimensions"
        )
        out[(call.where, str(a))] = Finding(
            "loss_broadcast", "error" if crossed else "warning", call.where,
            f"{at(call)}(input {a}, target {b}) broadcast to {shape}: {what}{torch_said}",
            "give input and target the same shape before the loss: pred.squeeze(-1) against "
            "a (N,) target, or target.view_as(pred) / target.unsqueeze(-1)",
        )  # fmt: skip
    return list(out.values())


LOSS_BROADCAST = Check(
    "loss_broadcast",
    (
        Kind(
            "loss_broadcast",
            "an elementwise loss's input and target differ in shape and broadcast",
        ),
    ),
    check_loss_broadcast,
)
