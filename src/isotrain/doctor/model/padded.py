"""Which arguments of the model's call are padded, and where: the inputs padding_leak judges.

A call may carry several (B, T) sequences: token ids with their token types or position ids,
a recommender's item sequences, a seq2seq model's source and target. Each is judged on its
own padding: the mask named for it (`attention_mask` for `input_ids` and `token_type_ids`,
`decoder_attention_mask` for `decoder_input_ids`, `src_key_padding_mask` for `src`), else
the pad id filling its rows' ends. NOTE [whose padding] says why a mask is never lent to an
argument it does not name.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from isotrain.doctor.ground.context import Context, inner
from isotrain.doctor.ground.inputs import ModelCall, main_path, replaced

__all__ = ["MAX_ARGS", "Padded", "padded_arguments"]

MAX_ARGS = 4  # padded arguments judged per call (each costs one or two forwards)
_TARGETS = ("labels", "label", "targets", "target", "y")  # they reach the loss, not the output
# words that say what a sequence or a mask is, not whose: `decoder_attention_mask` -> decoder
_ROLE = frozenset({
    "input", "inputs", "ids", "id", "token", "tokens", "type", "types", "position", "positions",
    "segment", "segments", "seq", "seqs", "attention", "mask", "masks", "padding", "pad", "key",
})  # fmt: skip

Path = tuple[Any, ...]


@dataclass(frozen=True)
class Padded:
    """One padded argument: where it sits in the call, its (B, T) padded positions, and how
    they were found: from a mask the call passes, or from a pad id (`value`)."""

    label: str  # as the user wrote it: `log_seqs`, `batch['input_ids']`
    path: Path
    tensor: torch.Tensor
    pads: torch.Tensor  # (B, T) bool, True at padding
    how: str
    value: int | None  # the pad id it was inferred from; None when a mask says where

    @property
    def masked(self) -> bool:
        return self.value is None

    def with_tensor(self, call: ModelCall, x: torch.Tensor) -> ModelCall:
        """The same call with this argument replaced by `x` (the caller's containers kept)."""
        args, kwargs = replaced((call.args, call.kwargs), self.path, x)
        return ModelCall(args, kwargs, call.forward)

    def longer(self, call: ModelCall) -> ModelCall | None:
        """The call with one more pad id at the end of every row, where the padding is a pad
        id at the rows' ends (real tokens keep their positions); None otherwise."""
        suffix = self.pads.int().flip(1).cumprod(1).flip(1).bool()
        if self.value is None or not bool((suffix == self.pads).all()):
            return None
        x = self.tensor
        return self.with_tensor(call, torch.cat([x, torch.full_like(x[:, :1], self.value)], 1))


@dataclass(frozen=True)
class _Leaf:
    label: str
    name: str  # the last name on its path: a keyword, a key, or the parameter it binds to
    path: Path
    tensor: torch.Tensor


def padded_arguments(ctx: Context, call: ModelCall) -> tuple[list[Padded], list[str]]:
    """The call's padded arguments (its main input first, then every integer (B, T) tensor
    not named like a mask or a target, at most MAX_ARGS), and why any was left unjudged (the
    notes surface only when nothing is named)."""
    leaves = list(_leaves(ctx, call))
    try:
        main = main_path(call.args, call.kwargs)
    except ValueError:
        return [], []
    order = sorted(leaves, key=lambda leaf: leaf.path != main)
    found, notes = [], []
    for leaf in order:
        first = leaf.path == main
        if not (first and leaf.tensor.dim() >= 2) and not _is_sequence(leaf):
            continue
        pads = _mask_for(leaf, leaves, first) or _from_pad_id(ctx, leaf.tensor, first)
        if pads is None or not bool(pads[0].any()):
            continue  # no padding in this argument: nothing can leak from it
        if bool(pads[0].all()):
            notes.append(f"every position of {leaf.label} is padding ({pads[1]})")
            continue
        found.append(Padded(leaf.label, leaf.path, leaf.tensor, *pads))
    if len(found) > MAX_ARGS:
        past = ", ".join(p.label for p in found[MAX_ARGS:])
        notes.append(f"{past}: past the first {MAX_ARGS} padded arguments, not judged")
    return found[:MAX_ARGS], notes


def _is_sequence(leaf: _Leaf) -> bool:
    """An integer (B, T) tensor, T > 1, that is neither a mask nor a target."""
    t, low = leaf.tensor, leaf.name.lower()
    if t.dim() != 2 or t.shape[1] < 2 or t.is_floating_point() or t.dtype == torch.bool:
        return False
    return "mask" not in low and low not in _TARGETS and not low.endswith("_labels")


def _leaves(ctx: Context, call: ModelCall) -> Iterator[_Leaf]:
    """Every tensor of the call, labelled as the user wrote it."""
    names = _parameter_names(ctx, call)
    for i, arg in enumerate(call.args):
        yield from _walk(arg, (0, i), names[i], names[i] if call.forward is None else "")
    for key, arg in call.kwargs.items():
        yield from _walk(arg, (1, key), str(key), str(key))


def _parameter_names(ctx: Context, call: ModelCall) -> list[str]:
    """The name each positional argument binds to in the model's forward (`batch` under the
    user's forward(model, batch))."""
    if call.forward is not None:
        return ["batch"] * len(call.args)
    try:
        params = list(inspect.signature(inner(ctx.model).forward).parameters.values())
    except (TypeError, ValueError):
        params = []  # a forward without a signature: its arguments are numbered
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = [p.name for p in params if p.kind in kinds]
    return [named[i] if i < len(named) else f"argument {i + 1}" for i in range(len(call.args))]


def _walk(obj: Any, path: Path, label: str, name: str) -> Iterator[_Leaf]:
    if isinstance(obj, torch.Tensor):
        yield _Leaf(label, name, path, obj)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _walk(v, (*path, k), f"{label}[{k!r}]", str(k))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _walk(v, (*path, i), f"{label}[{i}]", name)


def _stem(name: str) -> frozenset[str]:
    """Whose sequence or mask a name says: `decoder_attention_mask` -> {decoder}."""
    return frozenset(w for w in name.lower().split("_") if w and w not in _ROLE)


# NOTE [whose padding]
# A seq2seq call holds the source's mask and the target's, often of one length. Lent to the
# wrong sequence, a mask marks real target tokens as padding, and changing them moves the
# output: a false alarm. So a mask serves the argument whose name it shares (`src` and
# `src_key_padding_mask`, `decoder_input_ids` and `decoder_attention_mask`); an unqualified
# `attention_mask` / `mask` serves the unqualified ones (`input_ids`, `token_type_ids`) and the
# main input; the main input also takes the only mask of its shape, as the check always did.
def _mask_for(
    leaf: _Leaf, leaves: list[_Leaf], first: bool
) -> tuple[torch.Tensor, str, None] | None:
    """(pads, how, None) from the 0/1 mask of the call that belongs to `leaf`, or None."""
    masks = [m for m in leaves if _is_mask(m, leaf.tensor)]
    own = _stem(leaf.name)
    ranked = [m for m in masks if _stem(m.name) == own]
    ranked += [m for m in masks if not _stem(m.name) and first]
    ranked += masks if first and len(masks) == 1 else []
    if not ranked:
        return None
    m, low = ranked[0], ranked[0].name.lower()
    pad = m.tensor.bool() if "pad" in low else ~m.tensor.bool()
    return pad, f"{m.label} {'True' if 'pad' in low else '0'}", None


def _is_mask(m: _Leaf, x: torch.Tensor) -> bool:
    t = m.tensor
    if "mask" not in m.name.lower() or t.dim() != 2 or t.shape != x.shape[:2]:
        return False
    return not t.is_floating_point() and bool(((t == 0) | (t == 1)).all())


def _end_runs(rows: torch.Tensor, value: int, side: str) -> torch.Tensor:
    """(B, T) bool: each row's run of `value` at its start (`head`), its end (`tail`), or both."""
    tail = (rows.flip(1) == value).int().cumprod(1).flip(1).bool()
    head = (rows == value).int().cumprod(1).bool()
    return {"head": head, "tail": tail, "both": head | tail}[side]


def _from_pad_id(
    ctx: Context, x: torch.Tensor, first: bool
) -> tuple[torch.Tensor, str, int] | None:
    """(pads, how, pad id) for (B, T) ids without a mask: the config's pad id (main input
    only: it is a token id), or a value filling one end of the rows in runs of different
    lengths, never inside the text; for other arguments one row unpadded too (padding to the
    longest), since a segment's ids start every row with a run of one value."""
    if x.is_floating_point() or x.dim() != 2:
        return None
    config = getattr(inner(ctx.model), "config", None)
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    if first and isinstance(pad, int):
        runs = _end_runs(x, pad, "both")
        inside = bool(runs.all(1).any()) or bool((x[~runs] == pad).any())
        if not inside and int(runs.sum(1).max()) >= (2 if pad == eos else 1):
            return runs, f"the config's pad_token_id={pad}", pad
        return None
    for value in [int(v) for v in x[:, [0, -1]].unique()]:
        for side, end in (("head", "starts"), ("tail", "ends")):
            runs = _end_runs(x, value, side)
            lengths = runs.sum(1)
            if bool(runs.all(1).any()) or bool((x[~runs] == value).any()):
                continue  # a row all of it, or the value inside the text: not padding
            padded = int((lengths > 0).sum())
            if not first and not bool((lengths == 0).any()):
                continue
            if padded >= 2 and len(lengths.unique()) >= 2 and int(lengths.max()) >= 2:
                return runs, f"{value}, filling the {end} of {padded} rows", value
    return None
