"""What the model computes across the batch and across time, measured by perturbing inputs.

batch_mixing changes sample 0's input and looks at the other samples' outputs (a reshape
or transpose bug mixes them); causal_leak changes token t and looks at positions before t
(a wrong mask lets the future in). Both run forward passes only, on copies, RNG fixed.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from isotrain._shared import buffers_restored
from isotrain.doctor.ground.context import BATCH_NORMS, CannotRun, Context
from isotrain.doctor.ground.dispatch import WatchMode
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.inputs import swap_token
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.reading import AHEAD, UNALIGNED, last_read, token_inputs
from isotrain.doctor.ground.watch import user_site

__all__ = ["BATCH_MIXING", "CAUSAL_LEAK", "check_batch_mixing", "check_causal_leak"]


def _perturb_first(x: torch.Tensor) -> torch.Tensor:
    """`x` with sample 0 changed: its tokens rolled, or noise added to its values."""
    y = x.clone()
    if x.is_floating_point():
        g = torch.Generator(device=x.device).manual_seed(0)
        y[0] += torch.randn(x[0].shape, generator=g, device=x.device, dtype=x.dtype)
    else:
        y[0] = x[0].flatten().roll(1).view_as(x[0])
    return y


def _perturb_last(x: torch.Tensor) -> torch.Tensor:
    """`x` with its last row along dim 0 changed, as `_perturb_first` changes the first."""
    return _perturb_first(x.flip(0)).flip(0)


def _two_forwards(
    ctx: Context, model: nn.Module, batch: Any, change: Any, *, train: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits for `batch` and for the batch with its main input changed, with the
    same RNG draws for both (so dropout masks match)."""
    x, rebuild = ctx.main_input(batch)
    a, b = ctx.same_draws(model, [rebuild(x), rebuild(change(x))], train=train)
    return a, b


def _mixed(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest change in the outputs of samples 1.. (relative to their scale)."""
    scale = a[1:].abs().max().clamp_min(1e-6)
    return float(((a[1:] - b[1:]).abs().max() / scale).item())


def _mixed_before_last(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest change in the outputs of rows 0..B-2 (relative to their scale)."""
    scale = a[:-1].abs().max().clamp_min(1e-6)
    return float(((a[:-1] - b[:-1]).abs().max() / scale).item())


def check_batch_mixing(ctx: Context) -> list[Finding]:
    """batch_mixing: does sample 0's input change samples 1..B-1's outputs?"""
    batch = ctx.batches[0]
    x, _ = ctx.main_input(batch)
    small = x.dim() == 0 or x.shape[0] < 2
    ctx.refuse("needs a batch of at least 2 samples along dimension 0" if small else None)
    model, _ = ctx.fresh()
    a, b = _two_forwards(ctx, model, batch, _perturb_first, train=True)
    if a.shape[0] != x.shape[0]:
        raise CannotRun(f"the output's first dimension ({a.shape[0]}) is not the batch's")
    change = _mixed(a, b)
    if change <= 1e-5:
        return []
    if ctx.samples_interact:
        return [Finding(
            "batch_mixing", "info", "model forward",
            f"sample 0's input changes the others' outputs (by {change:.2g} relative), as "
            "declared: samples_interact=True",
            "nothing to fix",
        )]  # fmt: skip
    if _mixed_before_last(*_two_forwards(ctx, model, batch, _perturb_last, train=True)) <= 1e-5:
        return [Finding(
            "batch_mixing", "info", "model forward",
            f"row 0's input changes the later rows' outputs (by {change:.2g} relative) and the "
            "last row's changes no earlier one: dim 0 runs one way, like time (a time-major "
            "RNN's (T, B) input), not independent samples",
            "nothing to fix when dim 0 is time; where it holds samples, something runs along it",
        )]  # fmt: skip
    across = _cross_sample_op(ctx, model, batch, x.shape[0])
    if across is not None:
        op, where = across
        return [Finding(
            "batch_mixing", "info", where,
            f"sample 0's input changes the others' outputs (by {change:.2g} relative) through "
            f"{op} over dim 0: rows that exchange values (a graph's nodes passing messages)",
            "nothing to fix where dim 0 holds interacting items (declare samples_interact=True "
            "to say so); where it holds independent samples, that op mixes them",
        )]  # fmt: skip
    has_bn = any(isinstance(m, BATCH_NORMS) for m in model.modules())
    if has_bn:
        a, b = _two_forwards(ctx, model, batch, _perturb_first, train=False)
        if _mixed(a, b) <= 1e-5:
            return [Finding(
                "batch_mixing", "info", "BatchNorm",
                f"in training mode sample 0's input changes the others' outputs (by {change:.2g} "
                "relative): BatchNorm's batch statistics, by design; in eval mode they don't mix",
                "nothing to fix; per-sample work (per-sample gradients, tiny batches) wants "
                "GroupNorm/LayerNorm",
            )]  # fmt: skip
    return [Finding(
        "batch_mixing", "error", "model forward",
        f"changing sample 0's input changed the outputs of samples 1..{x.shape[0] - 1} (by "
        f"{change:.2g} relative to their scale): samples mix across the batch",
        "look for a view/reshape that should be a transpose/permute (x.view(B, T, C) of a "
        "(T, B, C) tensor), or a reduction over dim 0; .transpose(...) then .reshape(...)",
    )]  # fmt: skip


# ops that move values between rows of dim 0: (name, position of `dim`, None for index lists)
_ACROSS = {
    "index_add": 1, "index_add_": 1, "index_copy": 1, "index_copy_": 1, "index_reduce": 1,
    "index_reduce_": 1, "index_select": 1, "scatter": 1, "scatter_": 1, "scatter_add": 1,
    "scatter_add_": 1, "scatter_reduce": 1, "scatter_reduce_": 1, "gather": 1, "index": None,
}  # fmt: skip


_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8)


class _AcrossRows(WatchMode):
    """Finds the first op that reads or writes rows of a (rows, ...) tensor by an index."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.rows = rows
        self.found: tuple[str, str] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if self.found is None and name in _ACROSS and args and isinstance(args[0], torch.Tensor):
            x, pos = args[0], _ACROSS[name]
            if pos is None:  # x[idx]: an integer index tensor on dim 0
                idx = args[1][0] if len(args) > 1 and args[1] else None
                hit = isinstance(idx, torch.Tensor) and idx.dtype in _INTEGER
            else:
                hit = len(args) > pos and args[pos] == 0
            if hit and x.dim() > 0 and x.shape[0] == self.rows:
                what = "x[idx] (integer indexing)" if name == "index" else name
                self.found = (what, user_site().where)
        return func(*args, **(kwargs or {}))


def _cross_sample_op(
    ctx: Context, model: nn.Module, batch: Any, rows: int
) -> tuple[str, str] | None:
    """(op, file:line) of the first op of the forward that indexes across dim 0, or None."""
    call = ctx.call(batch)
    mode = _AcrossRows(rows)
    with torch.no_grad(), buffers_restored([model]), mode:
        ctx.run_model(model, call)
    return mode.found


def _decoder_input(ctx: Context) -> tuple[str, torch.Tensor, Any] | None:
    """(name, ids, path) of the token input a seq2seq model predicts from, when its main
    input is an encoder's (read ahead by design, or of another length than the output) and
    another one lines up with the output's positions; None for a model with one token input
    (its main input is the one to judge)."""
    try:
        inputs = token_inputs(ctx)
    except CannotRun:
        return None
    if len(inputs) < 2 or last_read(ctx, inputs[0][2], inputs[0][1]) not in (AHEAD, UNALIGNED):
        return None
    return next((i for i in inputs[1:] if last_read(ctx, i[2], i[1]) in (0, 1, AHEAD)), None)


def check_causal_leak(ctx: Context) -> list[Finding]:
    """causal_leak (task="lm"): does changing token t change the logits before t? Judged on
    the input the model predicts from: a decoder's, beside an encoder's read both ways."""
    if ctx.task != "lm":
        raise CannotRun('needs task="lm" (a language model whose position t sees tokens <= t)')
    batch = ctx.batches[0]
    x, rebuild = ctx.main_input(batch)
    decoder = _decoder_input(ctx)
    if decoder is not None:
        x, call = decoder[1], ctx.call(batch)
        rebuild = functools.partial(call.with_at, decoder[2])
    shaped = not x.is_floating_point() and x.dim() == 2 and x.shape[1] >= 3
    ctx.refuse(None if shaped else f"needs token ids of shape (batch, time>=3), got {x.shape}")
    t = x.shape[1] // 2
    changed = swap_token(x, t)
    if changed is None:
        raise CannotRun("every token of the batch is the same: nothing to change")
    model, _ = ctx.fresh()
    a, b = ctx.same_draws(model, [rebuild(x), rebuild(changed)], train=False)
    if a.dim() < 2 or a.shape[1] != x.shape[1]:
        raise CannotRun(f"the logits' shape {tuple(a.shape)} has no time axis like the input's")
    before = (a[:, :t] - b[:, :t]).abs().amax(dim=tuple(i for i in range(a.dim()) if i != 1))
    scale = a[:, :t].abs().max().clamp_min(1e-6)
    leaked = (before / scale > 1e-5).nonzero().flatten().tolist()
    if not leaked:
        return []
    of = f" of {decoder[0]} (the decoder's input)" if decoder is not None else ""
    return [Finding(
        "causal_leak", "error", "model forward",
        f"changing token {t}{of} changed the logits at {len(leaked)} earlier position(s) "
        f"({', '.join(map(str, leaked[:5]))}{'...' if len(leaked) > 5 else ''}): the model "
        "sees the future, so its training loss lies",
        "mask with torch.tril (position i attends to j <= i): masked_fill(tril == 0, -inf), "
        "or F.scaled_dot_product_attention(..., is_causal=True)",
    )]  # fmt: skip


BATCH_MIXING = Check(
    "batch_mixing",
    (Kind("batch_mixing", "one sample's input changes another sample's output"),),
    check_batch_mixing,
)


CAUSAL_LEAK = Check(
    "causal_leak",
    (Kind("causal_leak", "changing token t changes the logits at positions before t"),),
    check_causal_leak,
)
