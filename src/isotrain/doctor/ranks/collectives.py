"""collective_mismatch: the user's own collectives, compared across ranks before they run.

While the doctor runs under a process group, each `torch.distributed` collective that code
outside torch calls on the whole world (`dist.all_reduce(t)`, `dist.all_gather(...)`, ...)
first sends its name, shapes and dtypes to every rank over the doctor's link. If they differ,
every rank raises `CollectiveMismatch` at that call, so none of them enters gloo/NCCL with a
tensor that does not fit: those fail deep inside, or hang, with no word of which call it was.
torch's own calls (DDP, FSDP) are consistent by construction and pass straight through; so do
calls on sub-groups, which only some ranks make.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from isotrain._torch_private import tree_leaves
from isotrain.doctor.ground.watch import DOCTOR_DIR, TORCH_DIR, user_site
from isotrain.doctor.ranks.link import Ranks

__all__ = ["CollectiveMismatch", "Collectives", "checking_collectives"]

_NAMES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "reduce", "all_to_all_single", "all_to_all",
    "gather", "scatter",
)  # fmt: skip
# What each rank sends to and receives from each peer, where that may differ by rank: the
# argument it sends, the one it receives into, and how the parts are laid out ("rows":
# split along dim 0 by split sizes or evenly; "list": one tensor per peer; "chunks": a flat
# tensor of world-size equal parts; "one": the whole tensor to every peer).
_PAIRED = {
    "all_to_all_single": ("input", "rows", "output", "rows"),
    "all_to_all": ("input_tensor_list", "list", "output_tensor_list", "list"),
    "all_gather": ("tensor", "one", "tensor_list", "list"),
    "all_gather_into_tensor": ("input_tensor", "one", "output_tensor", "chunks"),
    "reduce_scatter": ("input_list", "list", "output", "one"),
    "reduce_scatter_tensor": ("input", "chunks", "output", "one"),
}
_SPLITS = {"input": "input_split_sizes", "output": "output_split_sizes"}
_ROOT_LISTS = ("gather_list", "scatter_list")  # on the root rank only


class CollectiveMismatch(RuntimeError):
    """Ranks call one collective with tensors that do not fit together (raised on every rank)."""

    def __init__(self, where: str, evidence: str) -> None:
        super().__init__(f"a collective at {where} gets tensors that differ across ranks")
        self.where, self.evidence = where, evidence


@dataclass
class Collectives:
    """What the check saw: calls compared, the first mismatch (where, evidence), and the
    gathers any code but the doctor's made (torch.distributed.nn's differentiable ones too)."""

    ranks: Ranks
    calls: int = 0
    gathers: int = 0
    mismatch: tuple[str, str] | None = None


@dataclass(frozen=True)
class _Call:
    """One rank's collective call: what every rank must agree on (`same`), and for the paired
    collectives what it sends to and expects from each peer (a shape per peer)."""

    name: str
    same: tuple[Any, ...]
    shown: str
    sends: tuple[tuple[int, ...], ...] = ()
    recvs: tuple[tuple[int, ...], ...] = ()


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _parts(
    bound: inspect.BoundArguments, arg: str, layout: str, world: int
) -> tuple[tuple[int, ...], ...]:
    """The shape of each peer's part of argument `arg`, laid out as `layout`."""
    value: Any = bound.arguments.get(arg)
    if layout == "list":
        return tuple(tuple(t.shape) for t in value)
    if layout == "one":
        return (tuple(value.shape),) * world
    if layout == "chunks":
        return ((value.numel() // world,) if value.numel() % world == 0 else (-1,),) * world
    splits = bound.arguments.get(_SPLITS[arg])
    rows = list(splits) if splits else [value.shape[0] // world] * world
    return tuple((int(n), *value.shape[1:]) for n in rows)


def _describe(name: str, bound: inspect.BoundArguments) -> _Call:
    """The parts of a call every rank must agree on: tensors' dtypes and shapes (what goes to
    each peer, for collectives whose parts may differ by rank), op, root."""
    world = dist.get_world_size()
    paired = _PAIRED.get(name)
    same: list[Any] = []
    shown: list[str] = []
    for arg, value in bound.arguments.items():
        if arg in ("group", "async_op", "group_src", "group_dst"):
            continue
        tensors = _tensors(value)
        if tensors:
            shown.append(f"{arg} " + ", ".join(f"{tuple(t.shape)} {_dtype(t)}" for t in tensors))
        if tensors and arg not in _ROOT_LISTS:
            exact = paired is None
            same.append((arg, [(_dtype(t), tuple(t.shape) if exact else None) for t in tensors]))
        elif arg in ("op", "src", "dst") and value is not None:
            same.append((arg, str(value)))
            shown.append(f"{arg}={value}")
        elif arg in _SPLITS.values() and value is not None:
            shown.append(f"{arg}={list(value)}")
    if paired is None:
        return _Call(name, tuple(same), "; ".join(shown))
    send_arg, send_layout, recv_arg, recv_layout = paired
    sends = _parts(bound, send_arg, send_layout, world)
    recvs = _parts(bound, recv_arg, recv_layout, world)
    return _Call(name, tuple(same), "; ".join(shown), sends, recvs)


def _unpaired(calls: list[_Call]) -> str | None:
    """'rank 0 sends rank 1 (5, 8), rank 1 expects (3, 8)' for the first pair that does not fit."""
    for r, call in enumerate(calls):
        for s, other in enumerate(calls):
            if not (len(call.sends) == len(other.recvs) == len(calls)):
                return f"rank {r} sends {len(call.sends)} parts to {len(calls)} ranks"
            if call.sends[s] != other.recvs[r]:
                return f"rank {r} sends rank {s} {call.sends[s]}, rank {s} expects {other.recvs[r]}"
    return None


def _compare(state: Collectives, call: _Call, site: str) -> None:
    """Exchange this call's description; raise CollectiveMismatch on every rank if they differ."""
    state.calls += 1
    got = state.ranks.gather("a collective call", (call, site), note=f"{call.name} at {site}")
    calls = [c for c, _ in got]
    same = all((c.name, c.same) == (calls[0].name, calls[0].same) for c in calls)
    unpaired = _unpaired(calls) if same and calls[0].name in _PAIRED else None
    if same and unpaired is None:
        return
    sites = sorted({s for _, s in got})
    names = sorted({c.name for c in calls})
    per_rank = "; ".join(f"rank {r}: {c.name}({c.shown})" for r, c in enumerate(calls))
    what = names[0] if len(names) == 1 else " / ".join(names)
    pair = f"; {unpaired}" if unpaired else ""
    evidence = (
        f"{what} gets tensors that do not fit across ranks ({per_rank}{pair}): run for real, "
        "gloo or NCCL fails or hangs inside it with no message"
    )
    where = ", ".join(sites)
    state.mismatch = state.mismatch or (where, evidence)
    raise CollectiveMismatch(where, evidence)


def _whole_world(bound: inspect.BoundArguments) -> bool:
    group = bound.arguments.get("group")
    return (
        group is None
        or group is dist.group.WORLD
        or dist.get_world_size(group) == (dist.get_world_size())
    )


def _checked(fn: Callable[..., Any], name: str, state: Collectives) -> Callable[..., Any]:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_code.co_filename
        if name.startswith(("all_gather", "all_to_all")) and not caller.startswith(DOCTOR_DIR):
            state.gathers += 1
        if caller.startswith((TORCH_DIR, DOCTOR_DIR)):
            return fn(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # torch says what is wrong with the call itself
        if _whole_world(bound):
            try:
                call = _describe(name, bound)
            except Exception:  # arguments torch will refuse itself: the ranks still meet here
                call = _Call(name, ("not described",), "")
            _compare(state, call, user_site().where)
        return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def checking_collectives(ranks: Ranks) -> Iterator[Collectives]:
    """Inside the block, `torch.distributed`'s collectives are compared across ranks first."""
    state = Collectives(ranks)
    saved = {n: getattr(dist, n) for n in _NAMES if callable(getattr(dist, n, None))}
    for name, fn in saved.items():
        setattr(dist, name, _checked(fn, name, state))
    try:
        yield state
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
