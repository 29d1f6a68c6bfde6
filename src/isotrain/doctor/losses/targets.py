"""What the loss is given: targets against the inputs, and input and target shapes.

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

__all__ = [
    "LABELS_NOT_SHIFTED",
    "LOSS_BROADCAST",
    "at",
    "check_labels",
    "check_loss_broadcast",
    "first_calls",
    "token_ids",
]

_MIN_TARGETS = 8  # fewer targets than this say nothing about their alignment


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


def _agreement(target: torch.Tensor, ids: torch.Tensor, ignore: int) -> tuple[float, float, int]:
    """(fraction of targets equal to the input at their position, fraction equal to the next
    input, targets counted) for targets laid out over all T positions or the first T-1."""
    B, T = ids.shape
    if target.numel() == B * T:
        t = target.reshape(B, T)
        same, nxt, valid = t == ids, t[:, :-1] == ids[:, 1:], t != ignore
        nvalid = valid[:, :-1]
    elif target.numel() == B * (T - 1):
        t = target.reshape(B, T - 1)
        same, nxt, valid = t == ids[:, :-1], t == ids[:, 1:], t != ignore
        nvalid = valid
    else:
        return 0.0, 0.0, 0
    n = int(valid.sum())
    if n < _MIN_TARGETS or int(nvalid.sum()) == 0:
        return 0.0, 0.0, n
    return float(same[valid].float().mean()), float(nxt[nvalid].float().mean()), n


def check_labels(ctx: Context) -> list[Finding]:
    """labels_not_shifted (task="lm"): a language model's targets equal its input tokens."""
    if ctx.task != "lm":
        raise CannotRun('needs task="lm" (targets are the next tokens of the input)')
    ids = token_ids(ctx, ctx.batches[0])
    calls = [c for c in first_calls(ctx) if c.target is not None]
    if ids is None or not calls:
        return []
    out = []
    for call in calls:
        same, nxt, n = _agreement(call.target, ids, call.ignore_index)  # type: ignore[arg-type]
        if same >= 0.9 and nxt <= 0.5:
            out.append(Finding(
                "labels_not_shifted", "error", call.where,
                f"{at(call)}: {same:.0%} of its {n} targets equal the input token at the same "
                f"position ({nxt:.0%} equal the next one): the model learns to copy its input "
                "and the loss falls toward 0 without learning to predict",
                "predict the next token: cross_entropy(logits[:, :-1].reshape(-1, V), "
                "ids[:, 1:].reshape(-1)), or targets = ids[:, 1:] of a window of T+1 tokens; "
                "Hugging Face *ForCausalLM models shift labels=input_ids themselves, a head that "
                "does not (MBartForCausalLM) needs them shifted before the call",
            ))  # fmt: skip
    return out


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


LABELS_NOT_SHIFTED = Check(
    "labels_not_shifted",
    (
        Kind(
            "labels_not_shifted",
            "a language model's targets equal its input tokens at the same position",
        ),
    ),
    check_labels,
)


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
