"""What the loss is given: targets against the inputs and the attention mask, shapes, and
whether a classification loss receives probabilities.

Each check reads the loss-function calls the trace's call watch saw in the first call of the
user's step, with their real arguments (`LossCall`), and the batch those calls came from.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from isotrain.doctor.ground.calls import ELEMENTWISE, LossCall
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.trace import trace_ok

__all__ = [
    "LABELS_NOT_SHIFTED",
    "LOSS_BROADCAST",
    "PADDING_IN_LOSS",
    "SOFTMAX_BEFORE_LOSS",
    "check_labels",
    "check_loss_broadcast",
    "check_padding",
    "check_softmax",
]

_MIN_TARGETS = 8  # fewer targets than this say nothing about their alignment


def _first_calls(ctx: Context) -> list[LossCall]:
    return [c for c in trace_ok(ctx).watch.calls if c.step == 0]


def _at(call: LossCall) -> str:
    """The loss call named for the evidence, with the library line when it ran inside one."""
    return call.name + (f" (at {call.inner})" if call.inner != call.where else "")


def _token_ids(ctx: Context, batch: Any) -> torch.Tensor | None:
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
    ids = _token_ids(ctx, ctx.batches[0])
    calls = [c for c in _first_calls(ctx) if c.target is not None]
    if ids is None or not calls:
        return []
    out = []
    for call in calls:
        same, nxt, n = _agreement(call.target, ids, call.ignore_index)  # type: ignore[arg-type]
        if same >= 0.9 and nxt <= 0.5:
            out.append(Finding(
                "labels_not_shifted", "error", call.where,
                f"{_at(call)}: {same:.0%} of its {n} targets equal the input token at the same "
                f"position ({nxt:.0%} equal the next one): the model learns to copy its input "
                "and the loss falls toward 0 without learning to predict",
                "predict the next token: cross_entropy(logits[:, :-1].reshape(-1, V), "
                "ids[:, 1:].reshape(-1)), or targets = ids[:, 1:] of a window of T+1 tokens; "
                "Hugging Face *ForCausalLM models shift labels=input_ids themselves, a head that "
                "does not (MBartForCausalLM) needs them shifted before the call",
            ))  # fmt: skip
    return out


def _offset(target: torch.Tensor, labels: torch.Tensor) -> int | None:
    """How the loss's targets sit on the batch's labels: 0 (position t's label), 1 (shifted:
    position t+1's label, as a causal LM's loss takes them), None (not made from them)."""
    B, T = labels.shape
    if target.numel() == B * T:
        t = target.reshape(B, T)
        if torch.equal(t, labels):
            return 0
        return 1 if torch.equal(t[:, :-1], labels[:, 1:]) else None
    if target.numel() == B * (T - 1):
        t = target.reshape(B, T - 1)
        return 1 if torch.equal(t, labels[:, 1:]) else 0 if torch.equal(t, labels[:, :-1]) else None
    return None


def check_padding(ctx: Context) -> list[Finding]:
    """padding_in_loss: labels where the attention mask is 0 are not the loss's ignore index."""
    batch = ctx.batches[0]
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(mask, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return []
    if mask.shape != labels.shape or labels.dim() != 2 or labels.is_floating_point():
        return []
    for call in _first_calls(ctx):
        if call.target is None or call.reduction == "none":
            continue  # reduction="none": the user weights positions themselves
        offset = _offset(call.target, labels)
        if offset is None:
            continue
        bad = (mask == 0) & (labels != call.ignore_index)
        if offset == 1:
            bad[:, 0] = False  # position 0's label is no target once shifted
        n, pads = int(bad.sum()), int((mask == 0).sum())
        if not n:
            continue
        values = labels[bad].unique().tolist()
        sev: Severity = "error" if len(values) == 1 else "warning"
        shown = ", ".join(map(str, values[:4])) + (" ..." if len(values) > 4 else "")
        return [Finding(
            "padding_in_loss", sev, call.where,
            f"{n} of the {pads} positions where attention_mask is 0 have labels {shown}, not "
            f"ignore_index={call.ignore_index}; {_at(call)} (reduction={call.reduction!r}) "
            "counts them: pad tokens are trained on and averaged into the loss",
            "set labels to -100 where attention_mask == 0: labels.masked_fill(attention_mask "
            "== 0, -100) (DataCollatorForLanguageModeling and DataCollatorForSeq2Seq do it), "
            "or pass ignore_index=<the pad id> to the loss",
        )]  # fmt: skip
    return []


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


def check_loss_broadcast(ctx: Context) -> list[Finding]:
    """loss_broadcast: an elementwise loss's input and target differ in shape and broadcast."""
    tr = trace_ok(ctx)
    out: dict[tuple[str, str], Finding] = {}
    for call in _first_calls(ctx):
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
            f"{_at(call)}(input {a}, target {b}) broadcast to {shape}: {what}{torch_said}",
            "give input and target the same shape before the loss: pred.squeeze(-1) against "
            "a (N,) target, or target.view_as(pred) / target.unsqueeze(-1)",
        )  # fmt: skip
    return list(out.values())


def check_softmax(ctx: Context) -> list[Finding]:
    """softmax_before_loss: cross_entropy / nll_loss receive probabilities."""
    out = []
    for call in _first_calls(ctx):
        if call.probabilities is None:
            continue
        ce = call.name == "cross_entropy"
        where = call.softmax_at or call.where
        apart = call.softmax_at not in (None, call.where)
        made = f"the softmax at {call.softmax_at} made them; " if apart else ""
        why = (
            "cross_entropy applies log_softmax itself, so the softmax runs twice and squashes "
            "the gradient"
            if ce
            else "nll_loss takes log-probabilities, so its loss is -p, not -log p"
        )
        fix = (
            "pass the logits: drop the softmax before the loss (nn.Softmax as the last layer or "
            "F.softmax), and apply it only for predictions"
            if ce
            else "use F.log_softmax "
            "instead of F.softmax before nll_loss (or pass logits to F.cross_entropy)"
        )
        out.append(Finding(
            "softmax_before_loss", "error", where,
            f"{_at(call)} called at {call.where} received probabilities, not "
            f"{'logits' if ce else 'log-probabilities'}: {call.probabilities}; {made}{why}",
            fix,
        ))  # fmt: skip
    return list({f.where: f for f in out}.values())


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


PADDING_IN_LOSS = Check(
    "padding_in_loss",
    (
        Kind(
            "padding_in_loss",
            "labels where the attention mask is 0 are not the loss's ignore index",
        ),
    ),
    check_padding,
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


SOFTMAX_BEFORE_LOSS = Check(
    "softmax_before_loss",
    (Kind("softmax_before_loss", "cross_entropy or nll_loss receive probabilities, not logits"),),
    check_softmax,
)
