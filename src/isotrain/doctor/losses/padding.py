"""padding_in_loss: pad positions the loss counts, found from the attention mask when the batch
has one, else from the pad id (the model's config) or the value that fills the rows' tails.

Reads the loss calls of the trace's first call of the step (`LossCall`) and the batch's labels
or token ids those calls' targets were made from.
"""

from __future__ import annotations

from typing import Any

import torch

from isotrain.doctor.ground.calls import LossCall
from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding, Severity
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.losses.targets import at, first_calls, token_ids

__all__ = ["PADDING_IN_LOSS", "check_padding"]

_FIX = (
    "set labels to -100 where attention_mask == 0: labels.masked_fill(attention_mask == 0, "
    "-100) (DataCollatorForLanguageModeling and DataCollatorForSeq2Seq do it), or pass "
    "ignore_index=<the pad id> to the loss"
)


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


def _counted(ctx: Context, rows: torch.Tensor) -> list[tuple[LossCall, int]]:
    """The loss calls whose targets are made from `rows` (B, T), with their offset on them;
    reduction="none" calls aside (the user weights positions themselves)."""
    out = []
    for call in first_calls(ctx):
        if call.target is None or call.reduction == "none":
            continue
        offset = _offset(call.target, rows)
        if offset is not None:
            out.append((call, offset))
    return out


def _masked(ctx: Context, mask: torch.Tensor, labels: torch.Tensor) -> list[Finding]:
    """Labels where the attention mask is 0 that the loss counts."""
    for call, offset in _counted(ctx, labels):
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
            f"ignore_index={call.ignore_index}; {at(call)} (reduction={call.reduction!r}) "
            "counts them: pad tokens are trained on and averaged into the loss",
            _FIX,
        )]  # fmt: skip
    return []


def _run(rows: torch.Tensor, value: int) -> torch.Tensor:
    """(B,) the length of each row's trailing run of `value`."""
    return (rows.flip(1) == value).int().cumprod(1).sum(1)


def _pad_value(ctx: Context, rows: torch.Tensor) -> tuple[int, str] | None:
    """The pad id and how it was found: the model config's pad_token_id where rows end in it,
    else the value that ends most rows in runs of different lengths (padding to the longest)
    and appears nowhere else in them (a token of the text, a space in characters, does)."""
    config = getattr(ctx.model, "config", None)
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    if isinstance(pad, int):
        runs = _run(rows, pad)
        longest = 2 if pad == eos else 1  # one eos at the end is a real target
        if int(runs.max()) >= longest:
            return pad, f"the model config's pad_token_id={pad}"
        return None
    last = rows[:, -1]
    value = int(last.mode().values)
    runs = _run(rows, value)
    ending = runs > 0
    lengths = runs[ending].unique()
    elsewhere = int((rows == value).sum()) - int(runs.sum())
    if int(ending.sum()) >= 2 and len(lengths) >= 2 and int(runs.max()) >= 2 and not elsewhere:
        shown = ", ".join(map(str, runs.tolist()[:8]))
        return value, f"{value} fills the tail of {int(ending.sum())} rows (runs of {shown})"
    return None


def _unmasked(ctx: Context, rows: torch.Tensor) -> list[Finding]:
    """Pad positions in batch rows without an attention mask that the loss counts."""
    found = _pad_value(ctx, rows)
    if found is None:
        return []
    pad, how = found
    tail = torch.arange(rows.shape[1]) >= rows.shape[1] - _run(rows, pad)[:, None]  # (B, T)
    for call, offset in _counted(ctx, rows):
        if pad == call.ignore_index:
            continue
        counted = tail.clone()
        if offset == 1:
            counted[:, 0] = False  # position 0's label is no target once shifted
        n = int(counted.sum())
        if not n:
            continue
        sev: Severity = "error" if how.startswith("the model") else "warning"
        return [Finding(
            "padding_in_loss", sev, call.where,
            f"the batch has no attention_mask; pad id {pad} ({how}) is the target at {n} "
            f"positions at the rows' ends, and {at(call)} (ignore_index={call.ignore_index}, "
            f"reduction={call.reduction!r}) counts them: the model is trained to predict "
            "padding and the loss is averaged over it",
            f"set the labels to -100 at the padding (labels[labels == {pad}] = -100, keeping "
            f"one eos per row when pad = eos), or pass ignore_index={pad} to the loss",
        )]  # fmt: skip
    return []


def _rows(ctx: Context, batch: Any) -> torch.Tensor | None:
    """The (B, T) integer rows the targets come from: the batch's labels, else its token ids."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if isinstance(labels, torch.Tensor) and labels.dim() == 2 and not labels.is_floating_point():
        return labels
    return token_ids(ctx, batch)


def check_padding(ctx: Context) -> list[Finding]:
    """padding_in_loss: pad positions (attention mask 0, or the pad id at the rows' ends when
    there is no mask) whose labels are not the loss's ignore index."""
    batch = ctx.batches[0]
    rows = _rows(ctx, batch)
    if rows is None:
        return []
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if isinstance(mask, torch.Tensor):
        return _masked(ctx, mask, rows) if mask.shape == rows.shape else []
    return _unmasked(ctx, rows)


PADDING_IN_LOSS = Check(
    "padding_in_loss",
    (
        Kind(
            "padding_in_loss",
            "pad positions (attention mask 0, or the pad id filling the rows' ends when the "
            "batch has no mask) are not the loss's ignore index",
        ),
    ),
    check_padding,
)
