"""labels_not_shifted, labels_shifted_twice: a language model's targets against what it reads.

NOTE [the next token after the last one seen]
The invariant: the target at position j is the token right after the last token position j
sees. So the check measures both sides. From the model: which token of each of its token
inputs the output at position t reads last (ground.reading, NOTE [the last token read]); an
input it reads ahead (an encoder's) or not at all (nanoGPT's `targets` argument) has no
alignment to judge. From the loss calls: at which offset k the targets equal that input
(target j == input j + k). A causal LM reading t wants k = 1; a model shifting inside wants
k = 0. A smaller k lets position j see its own answer (it learns to copy); a larger one trains
it to predict a token further on (the shift applied twice).
"""

from __future__ import annotations

from typing import Any

import torch

from isotrain.doctor.ground.calls import LossCall
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.reading import last_read, token_inputs
from isotrain.doctor.losses.targets import at, first_calls, token_ids

__all__ = ["LABELS_ALIGNED", "check_labels"]

_MIN_TARGETS = 8  # fewer targets than this say nothing about their alignment
_OFFSETS = (0, 1, 2)  # target j against input token j + k


def _agreement(target: torch.Tensor, ids: torch.Tensor, ignore: int) -> tuple[list[float], int]:
    """For each of _OFFSETS the fraction of targets equal to the input token that many
    positions on (targets laid out over all T positions or the first T-1), and the targets
    counted (all 0.0 when too few to say)."""
    B, T = ids.shape
    if target.numel() not in (B * T, B * (T - 1)):
        return [0.0] * len(_OFFSETS), 0
    t = target.reshape(B, -1)
    valid = t != ignore
    n = int(valid.sum())
    rates = []
    for k in _OFFSETS:
        L = min(t.shape[1], T - k)
        v = valid[:, :L]
        eq = t[:, :L] == ids[:, k : k + L]
        rates.append(float(eq[v].float().mean()) if int(v.sum()) else 0.0)
    return (rates, n) if n >= _MIN_TARGETS else ([0.0] * len(_OFFSETS), n)


def check_labels(ctx: Context) -> list[Finding]:
    """labels_not_shifted, labels_shifted_twice (task="lm"): each loss's targets against the
    tokens the model reads, NOTE [the next token after the last one seen]."""
    if ctx.task != "lm":
        raise CannotRun('needs task="lm" (targets are the next tokens of the input)')
    calls = [c for c in first_calls(ctx) if c.target is not None]
    out: list[Finding] = []
    for i, (name, ids, path) in enumerate(_inputs(ctx) if calls else []):
        rates = [(c, *_agreement(c.target, ids, c.ignore_index)) for c in calls]  # type: ignore[arg-type]
        if not any(max(r) >= 0.9 for _, r, _ in rates):
            continue  # the targets are not this input's tokens at any offset
        lag = last_read(ctx, path, ids) if path else None
        if lag is None and i > 0:
            continue  # an argument whose reading cannot be measured: say nothing
        lag = 0 if lag is None else lag  # the main input (listed first), unmeasured: an LM's
        if isinstance(lag, str):
            continue  # an encoder's input, or not read (targets handed to the model)
        want = 1 - lag
        predicts = any(r[want] >= 0.9 for _, r, _ in rates)  # a multi-token head's others
        for call, r, n in rates:
            k = next((k for k in _OFFSETS if r[k] >= 0.9), None)
            if k is None or k == want or r[want] > 0.5 or (k > want and predicts):
                continue
            out.append(_misaligned(call, r, n, name, k, want))
    return out


def _inputs(ctx: Context) -> list[tuple[str, torch.Tensor, Any]]:
    """The call's token inputs; the batch's ids (path ()) when no call was recorded."""
    try:
        return token_inputs(ctx)
    except CannotRun:
        ids = token_ids(ctx, ctx.batches[0])
        return [] if ids is None else [("the batch", ids, ())]


_WHERE = ("at the same position", "one position on", "two positions on")


def _misaligned(call: LossCall, r: list[float], n: int, name: str, k: int, want: int) -> Finding:
    """The finding for one loss call whose targets sit k tokens on from `name` (want wanted)."""
    seen = f"{at(call)}: {r[k]:.0%} of its {n} targets equal the input token {_WHERE[k]} in "
    seen += f"{name} ({r[want]:.0%} equal the token {_WHERE[want]}"
    seen += ", which the model reads shifted right)" if want == 0 else ")"
    if k < want:
        return Finding(
            "labels_not_shifted", "error", call.where,
            seen + ": each position sees the token it is scored against, so the model learns "
            "to copy its input and the loss falls toward 0 without learning to predict",
            "predict the next token: cross_entropy(logits[:, :-1].reshape(-1, V), "
            "ids[:, 1:].reshape(-1)), or targets = ids[:, 1:] of a window of T+1 tokens; a "
            "decoder's input is the target shifted right (tgt[:, :-1], loss on tgt[:, 1:]); "
            "Hugging Face *ForCausalLM models shift labels=input_ids themselves, a head that "
            "does not (MBartForCausalLM) needs them shifted before the call",
        )  # fmt: skip
    return Finding(
        "labels_shifted_twice", "error", call.where,
        seen + ": each position is trained to predict a token beyond the next one, so the "
        "shift was applied twice",
        "shift once: a Hugging Face *ForCausalLM shifts labels itself, so pass labels=input_ids "
        "(not the next-token window y); with y = x shifted by the data, take "
        "cross_entropy(logits.reshape(-1, V), y.reshape(-1)) without slicing again; a model "
        "that shifts its decoder's input right inside takes the targets unshifted",
    )  # fmt: skip


LABELS_ALIGNED = Check(
    "labels_not_shifted",
    (
        Kind(
            "labels_not_shifted",
            "a language model's targets are tokens it already sees at their position (unshifted)",
        ),
        Kind(
            "labels_shifted_twice",
            "a language model's targets are tokens beyond the next one (shifted twice)",
        ),
    ),
    check_labels,
)
