"""The model's own states at padded positions: found, and moved with the ids kept.

NOTE [the ids kept]
Setting a padded position to a real token is a fair test only while the model learns its
padding from a mask it is given. A model that takes its mask from the ids (`log_seqs == 0`,
`src != pad`) sees a real token there and rightly attends to it, so its output moves as a
leaking one's does. The second measurement keeps the ids and moves what the model computes at
the padded positions instead: the embedding of those ids (unless they are the embedding's
`padding_idx`, a state the model fixed on purpose), the output of a layer norm, and the query,
key and value inputs of an attention (`F.multi_head_attention_forward`, which
nn.MultiheadAttention and nn.Transformer* call, and `F.scaled_dot_product_attention`), where
their positions are the argument's: they changed only at its padded positions when the ids did
(`aligned`). A layer past the first mixing of positions, or a cross-attention over another
sequence, is never touched. A correct model keeps its real outputs; one whose real queries
attend to padded keys (even zeroed ones, as SASRec's) or whose pooling reads them does not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["PadStates", "aligned"]

# attention -> (batch dim, position dim) of its query, key and value inputs
_ATTENTION: dict[Any, tuple[int, int]] = {
    F.multi_head_attention_forward: (1, 0),  # (L, N, E)
    F.scaled_dot_product_attention: (0, -2),  # (N, ..., L, E)
}
_NORMS = (F.layer_norm, F.rms_norm)  # their output: the hidden state, (B, T, E) batch first
_QKV = ("query", "key", "value")
Site = tuple[int, int]  # (watched call, 0/1/2: a norm's output, an attention's query/key/value)


class PadStates(TorchFunctionMode):
    """Records a per-position summary of every norm's output and attention's inputs; given
    `ids` and `pads`, adds noise at the padded positions to the embeddings of `ids` and to the
    states at `sites`, counting what it moved (`embeddings`, `states`)."""

    def __init__(
        self,
        ids: torch.Tensor | None = None,
        pads: torch.Tensor | None = None,
        sites: frozenset[Site] = frozenset(),
    ) -> None:
        super().__init__()
        self.ids, self.pads, self.sites = ids, pads, sites
        self.summaries: list[list[torch.Tensor | None]] = []
        self.embeddings = 0  # embedding outputs moved
        self.states = 0  # norm outputs and attention inputs moved
        self._gen = torch.Generator().manual_seed(0)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding:
            return self._embedding(func(*args, **kwargs), args, kwargs)
        if func in _NORMS:
            return self._norm(func(*args, **kwargs))
        layout = _ATTENTION.get(func)
        if layout is None:
            return func(*args, **kwargs)
        args, kwargs = list(args), dict(kwargs)
        slots = [(args, j) if j < len(args) else (kwargs, _QKV[j]) for j in range(3)]
        qkv = [box[key] for box, key in slots]
        self.summaries.append([_summary(t, layout) for t in qkv])
        call, noisy = len(self.summaries) - 1, {}  # id -> the noisy copy: q, k, v may be one
        for j, (box, key) in enumerate(slots):
            if (call, j) in self.sites and self.pads is not None:
                t = qkv[j]
                if id(t) not in noisy:
                    noisy[id(t)] = self._noisy(t, self.pads, layout)
                    self.states += 1
                box[key] = noisy[id(t)]
        return func(*args, **kwargs)

    def _norm(self, out: Any) -> Any:
        """A norm's output, with noise at the padded positions where it is a site."""
        self.summaries.append([_summary(out, (0, 1))])
        if (len(self.summaries) - 1, 0) not in self.sites or self.pads is None:
            return out
        self.states += 1
        return self._noisy(out, self.pads, (0, 1))

    def _embedding(self, out: torch.Tensor, args: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        """`out` with noise at the padded positions when it embeds `ids` (not at padding_idx)."""
        ids = args[0] if args else kwargs.get("input")
        if self.ids is None or self.pads is None or not isinstance(ids, torch.Tensor):
            return out
        if ids.shape != self.ids.shape or not torch.equal(ids, self.ids.to(ids.device)):
            return out
        weight = args[1] if len(args) > 1 else kwargs["weight"]
        padding_idx = args[2] if len(args) > 2 else kwargs.get("padding_idx")
        where = self.pads.to(ids.device)
        if padding_idx is not None:  # negative counts from the end, as F.embedding reads it
            where = where & (ids != padding_idx % weight.shape[0])
        if not bool(where.any()):
            return out
        self.embeddings += 1
        return self._noisy(out, where, (0, 1))

    def _noisy(self, t: torch.Tensor, where: torch.Tensor, layout: tuple[int, int]) -> torch.Tensor:
        """A copy of `t` with noise at the (B, T) positions `where` (t's own scale)."""
        y = t.detach().clone()
        view = y.movedim((layout[0], layout[1]), (0, 1))  # (B, T, ...), a view into y
        scale = t.detach().float().std().clamp_min(1e-3)
        shape = view[where.to(t.device)].shape
        noise = torch.randn(shape, generator=self._gen).to(t.device, t.dtype) * scale
        view[where.to(t.device)] += noise
        return y


def _summary(t: Any, layout: tuple[int, int]) -> torch.Tensor | None:
    """(B, T, 3): each position's sum, sum of squares and a weighted sum over its features
    (a change anywhere in a position's features shows), or None for an unbatched input."""
    if not isinstance(t, torch.Tensor) or t.dim() < 3 or not t.is_floating_point():
        return None
    f = t.detach().movedim((layout[0], layout[1]), (0, 1)).flatten(2).float()
    w = torch.linspace(0.5, 1.5, f.shape[-1], device=f.device)
    return torch.stack([f.sum(-1), (f * f).sum(-1), (f * w).sum(-1)], -1).cpu()


def aligned(before: PadStates, after: PadStates, pads: torch.Tensor) -> frozenset[Site]:
    """The watched states whose positions are the argument's: in `after` (the ids changed at
    `pads`) they changed at padded positions only, and at some."""
    sites = set()
    for call, (xs, ys) in enumerate(zip(before.summaries, after.summaries, strict=False)):
        for j, (a, b) in enumerate(zip(xs, ys, strict=True)):
            if a is None or b is None or a.shape != b.shape or a.shape[:2] != pads.shape:
                continue
            scale = a.abs().amax(-1, keepdim=True).clamp_min(1e-6)
            changed = ((a - b).abs() / scale).amax(-1) > 1e-5
            if bool(changed.any()) and not bool((changed & ~pads.cpu()).any()):
                sites.add((call, j))
    return frozenset(sites)
