"""Across ranks: replicas that differ, gradients never averaged, the same data on every rank.

Runs two of the user's steps on the user's own (DDP / FSDP2 / plain) model and optimizer
(`ctx.fresh()`, put back after the check): a deep copy of a DDP model builds a new reducer
on the copy's parameters, which hides exactly the bugs looked for here. Each rank records
checksums (of its batches, of the replicated parameters before and after each step, of their
gradients after the last backward and at `optimizer.step()`); one exchange per step compares
them, and only a parameter found to differ is exchanged whole, once, for its largest difference.

What is replicated: every parameter of a DDP / FSDP2 model (FSDP2's shards left out); for a
model no framework wraps (manual data parallel, tensor or expert parallel written by hand), the
parameters every rank holds alike before the first step. Those that differ are each rank's own
shard: not compared, said once as info. The gradients judged are the ones `optimizer.step()`
receives, so a loop that all-reduces each `.grad` by hand after backward is correct.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from isotrain._torch_private import ddp_wrapped_params, tensor_version, tree_leaves
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ranks.backwards import Backwards, Summary, summarize
from isotrain.doctor.ranks.link import Ranks, checksum
from isotrain.doctor.ranks.scale import grad_sums, scale_finding
from isotrain.doctor.ranks.text import (
    gradient_finding,
    mismatch_finding,
    replica_finding,
    same_data_finding,
    sharded_finding,
)

__all__ = ["RANKS", "check_ranks", "replicated"]

STEPS = 2  # the second step catches a wrapper used on some calls only


def replicated(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters every data-parallel rank holds in full (FSDP shards left out)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        placements = getattr(p, "placements", None)
        if placements is not None and not all(pl.is_replicate() for pl in placements):
            continue  # one shard per rank: nothing to compare
        out[name] = p
    return out


def _sums(tensors: list[torch.Tensor]) -> list[int]:
    return torch.stack([checksum(t) for t in tensors]).tolist() if tensors else []


def _batch_hash(batch: Any) -> str:
    """sha1 of every tensor's shape, dtype and bytes in a batch (order-sensitive)."""
    h = hashlib.sha1()
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            c = t.detach().cpu().contiguous()
            h.update(f"{tuple(c.shape)}{c.dtype}".encode())
            h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.hexdigest()[:12]


def _is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _base(model: nn.Module) -> nn.Module:
    """The module whose parameter names the user knows (a DDP wrapper's `.module`)."""
    inner = model.module if _is_ddp(model) else model
    return inner if isinstance(inner, nn.Module) else model


def _wrapped_by_framework(model: nn.Module) -> bool:
    """DDP, or FSDP2 (its modules gain set_requires_gradient_sync)."""
    return _is_ddp(model) or callable(getattr(model, "set_requires_gradient_sync", None))


@dataclass
class _Record:
    """One step on one rank: grads after its last backward before optimizer.step, at the step
    (after the user's own all-reduce, if any)."""

    backs: Backwards = field(default_factory=Backwards)  # what each backward ran on
    after_backward: dict[str, torch.Tensor] = field(default_factory=dict)  # clones, for spreads
    at_step_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # clones, for spreads
    synced: list[int] | None = None
    at_step: list[int] | None = None
    wrapper_called: bool = False
    inner_called: bool = False
    sync_off: bool = False
    stepped: bool = False


@contextlib.contextmanager
def _recording(model: nn.Module, opts: list[Any], names: list[str]) -> Iterator[_Record]:
    """Record one step: torch.autograd.backward wrapped, a step pre-hook, forward pre-hooks."""
    rec, params = _Record(), [dict(_base(model).named_parameters())[n] for n in names]
    backward = torch.autograd.backward

    def grads() -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]

    def watched(*args: Any, **kwargs: Any) -> Any:
        out = backward(*args, **kwargs)
        if not rec.stepped:  # the gradients optimizer.step() will use
            rec.sync_off = not getattr(model, "require_backward_grad_sync", True)
            rec.backs.backward(args[0] if args else kwargs.get("tensors"), synced=not rec.sync_off)
            rec.after_backward = {n: g.detach().clone() for n, g in zip(names, grads())}
            rec.synced = _sums(list(rec.after_backward.values()))
        return out

    def pre_step(*_: Any) -> None:
        if not rec.stepped:
            rec.at_step_grads = {n: g.detach().clone() for n, g in zip(names, grads())}
            rec.stepped, rec.at_step = True, _sums(list(rec.at_step_grads.values()))

    def mark(attr: str) -> Any:
        return lambda *_: setattr(rec, attr, True)

    handles = [o.register_step_pre_hook(pre_step) for o in opts]
    handles.append(model.register_forward_pre_hook(mark("wrapper_called")))
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and _is_ddp(model):
        handles.append(inner.register_forward_pre_hook(mark("inner_called")))
    torch.autograd.backward = watched
    try:
        with rec.backs.watching(model):
            yield rec
    finally:
        torch.autograd.backward = backward
        for h in handles:
            h.remove()


def _cause(model: nn.Module, names: list[str], recs: list[_Record]) -> str:
    """Why a DDP model's gradients were not averaged: replaced, bypassed, no_sync, retained (a
    backward through a graph an earlier one used) or moved."""
    if not _is_ddp(model):
        return "plain"
    wrapped = ddp_wrapped_params(model)
    if wrapped is not None:
        ids = {id(p) for p in wrapped}
        if any(id(p) not in ids for p in model.parameters()):
            return "replaced"
    if any(r.inner_called and not r.wrapper_called for r in recs):
        return "bypassed"
    if any(r.sync_off for r in recs):
        return "no_sync"
    if any(not all(r.backs.own) for r in recs):
        return "retained"
    return "moved"


def check_ranks(ctx: Context) -> list[Finding]:
    """replica_divergence, gradient_not_synchronized, same_data_on_ranks and
    gradient_scaled_by_world over two steps."""
    ranks: Ranks | None = getattr(ctx, "ranks", None)
    if ranks is None:
        raise CannotRun("needs a process group of 2 or more ranks (torchrun --nproc-per-node N)")
    if _mismatch(ctx):
        return _mismatch(ctx)
    model, opt = ctx.fresh()  # the caller's own objects: examine puts them back afterwards
    reps = replicated(_base(model))
    start = ranks.gather("replicas before the first step", (list(reps), _sums([*reps.values()])))
    framework = _wrapped_by_framework(model)
    if framework and len({tuple(n) for n, _ in start}) > 1:
        return [replica_finding("models", start, None, [])]
    names = list(reps) if framework else _alike(start)
    sharded = [n for n in reps if n not in names]
    out = [sharded_finding(sharded, len(reps))] if sharded else []
    mine = [_batch_hash(b) for b in ctx.batches[:STEPS]]
    hashes = ranks.gather("the batches' checksums", mine)
    same = same_data_finding(hashes, sharded=bool(sharded))
    ctx.cache["same data on ranks"] = bool(same)  # said once: the data split need not say it
    out += same
    buffers = _buffer_marks(_base(model))
    sums = [[dict(zip(*got))[n] for n in names] for got in start]
    out += _stepped(ctx, ranks, model, opt, names, sums, sharded=bool(sharded))
    if sharded:  # buffers may be shards too: nothing tells them from replicas
        return out
    return out + _constant_buffers(ranks, _base(model), buffers)


def _alike(start: list[tuple[list[str], list[int]]]) -> list[str]:
    """The parameters of a model no framework wraps that every rank holds alike before the
    first step: the replicated ones (tensor and expert parallel shards differ by design)."""
    per_rank = [dict(zip(names, sums)) for names, sums in start]
    return [n for n, s in per_rank[0].items() if all(r.get(n) == s for r in per_rank[1:])]


def _buffer_marks(model: nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (write counter, checksum) of each buffer: BatchNorm's kernels write their
    statistics without counting, so a changed value counts as a write too."""
    named = dict(model.named_buffers())
    return {n: (tensor_version(b), c) for (n, b), c in zip(named.items(), _sums([*named.values()]))}


def _constant_buffers(
    ranks: Ranks, model: nn.Module, before: dict[str, tuple[int, int]]
) -> list[Finding]:
    """replica_divergence of buffers no step wrote (a mask, a table): every rank should hold
    the same; written ones (BatchNorm statistics, DDP's broadcast) may differ between syncs."""
    now = _buffer_marks(model)
    kept = {n: b for n, b in model.named_buffers() if before.get(n) == now[n]}
    names = sorted(kept)
    got = ranks.gather("the unwritten buffers' checksums", (names, _sums([kept[n] for n in names])))
    if len({tuple(n) for n, _ in got}) > 1:
        return []  # other buffers written per rank: nothing the ranks share to compare
    sums = [s for _, s in got]
    if all(s == sums[0] for s in sums):
        return []
    spread = _spread(ranks, names, sums, kept, "buffer")
    return [replica_finding("buffers", sums, spread, names)]


def _stepped(
    ctx: Context, ranks: Ranks, model: nn.Module, opt: Any, names: list[str],
    start: list[list[int]], *, sharded: bool,
) -> list[Finding]:  # fmt: skip
    """Two steps, one exchange after each; the first difference found is reported."""
    out: list[Finding] = []
    if any(s != start[0] for s in start):
        spread = _spread(ranks, names, start, dict(_base(model).named_parameters()), "before")
        out.append(replica_finding("start", start, spread, names))
    recs: list[_Record] = []
    calls = ctx.cache.get("collectives")
    first: list[Any] = []  # each rank's scale summary of step 1
    for i in range(STEPS):
        gathers = getattr(calls, "gathers", 0)
        with _recording(model, ctx.optimizers, names) as rec:
            error, returned = _run(ctx, model, opt, ctx.batches[i % len(ctx.batches)])
        recs.append(rec)
        after = _sums([dict(_base(model).named_parameters())[n] for n in names])
        scale = _scale_summary(rec, returned, getattr(calls, "gathers", 0) - gathers)
        got = ranks.gather(
            f"replicas after step {i + 1}", (error, rec.synced, rec.at_step, after, scale)
        )
        first = first or [g[4] for g in got]
        failed = [(r, e) for r, (e, *_) in enumerate(got) if e is not None]
        if failed and _mismatch(ctx):
            return out + _mismatch(ctx)
        if failed:
            r, e = failed[0]
            raise CannotRun(f"your step raised on rank {r}: {e}")
        found = _judge(ranks, model, names, got, recs, out, i + 1, sharded=sharded)
        if found:
            return out + found
    if out or sharded:
        return out
    adaptive = bool(ctx.optimizers) and all("Adam" in type(o).__name__ for o in ctx.optimizers)
    return scale_finding(first, ranks.world, adaptive=adaptive)


def _scale_summary(rec: _Record, returned: Any, gathers: int) -> Summary:
    """What gradient_scaled_by_world compares across ranks, from one recorded step (nothing
    to compare where the step did not step, or its values cannot be read: every rank still
    reaches the exchange)."""
    try:
        if rec.at_step is not None:
            after, at_step = grad_sums(rec.after_backward), grad_sums(rec.at_step_grads)
            return summarize(rec.backs, returned, after, at_step, gathers)
    except Exception:  # a value the doctor cannot read is not the user's bug
        pass
    return Summary([], [], gathers)


def _mismatch(ctx: Context) -> list[Finding]:
    """The collective mismatch the user's step met under the doctor, if it met one."""
    calls = ctx.cache.get("collectives")
    mismatch = getattr(calls, "mismatch", None)
    return [mismatch_finding(*mismatch)] if mismatch else []


def _run(ctx: Context, model: nn.Module, opt: Any, batch: Any) -> tuple[str | None, Any]:
    """(the step's error, else None; what the step returned)."""
    try:
        return None, ctx.run_step(model, opt, batch)
    except Exception as e:
        if type(e).__name__ == "RankError":
            raise
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}", None


def _judge(
    ranks: Ranks, model: nn.Module, names: list[str], got: list[Any], recs: list[_Record],
    already: list[Finding], step: int, *, sharded: bool,
) -> list[Finding]:  # fmt: skip
    """Findings from one step's exchange (the same on every rank: they share `got`). The
    gradients judged are those optimizer.step() received, after the user's own all-reduce."""
    synced = [g[1] for g in got]
    at_step = [g[2] for g in got]
    after = [g[3] for g in got]
    judged = at_step if all(s is not None for s in at_step) else synced
    differ = [_differs(s) for s in (synced, judged)]
    if all(s is not None for s in judged) and differ[1] and (differ[0] or judged is synced):
        grads = recs[-1].at_step_grads if judged is at_step else recs[-1].after_backward
        spread = _spread(ranks, names, judged, grads, "gradients")
        cause = "sharded" if sharded else _cause(model, names, recs)
        return [gradient_finding(judged, spread, names, cause, step, at_step=judged is at_step)]
    if already or all(a == after[0] for a in after):
        return []
    spread = _spread(ranks, names, after, dict(_base(model).named_parameters()), "after")
    stage = "between" if judged is at_step and differ[1] else "update"
    return [replica_finding(stage, after, spread, names, step=step)]


def _differs(sums: list[list[int] | None]) -> bool:
    """Whether the per-rank checksums differ (None: not recorded on some rank)."""
    return all(s is not None for s in sums) and any(s != sums[0] for s in sums)


def _spread(
    ranks: Ranks, names: list[str], sums: list[list[int]], tensors: dict[str, torch.Tensor],
    what: str,
) -> tuple[str, float]:  # fmt: skip
    """(name, largest difference across ranks) of the first parameter whose sums differ."""
    first = next(i for i in range(len(names)) if len({s[i] for s in sums}) > 1)
    return names[first], ranks.spread(tensors[names[first]], f"the {what} of {names[first]}")


RANKS = Check(
    "ranks",
    (
        Kind(
            "replica_divergence",
            "a replicated parameter, or a buffer no step writes, differs across data-parallel "
            "ranks (which one, which ranks, the largest difference)",
        ),
        Kind(
            "gradient_not_synchronized",
            "at optimizer.step(), a replicated parameter's gradients differ across ranks (DDP "
            "hooks on replaced parameters, the wrapper bypassed, no_sync left on, a manual "
            "all_reduce forgotten)",
        ),
        Kind(
            "same_data_on_ranks",
            "ranks got byte-identical batches (no DistributedSampler, data not split by rank)",
        ),
        Kind(
            "gradient_scaled_by_world",
            "the gradients optimizer.step() applies are world_size (or 1/world_size) times the "
            "one-process gradient of the global batch (a loss scaled by the world size under "
            "DDP, an all_reduce SUM of .grad on top of it), over one backward or several "
            "(micro-batches, the parts of one loss: their number's factor too)",
        ),
        Kind(
            "collective_mismatch",
            "ranks call a collective with tensors of other shapes or dtypes, or reach collectives "
            "in another order (compared before the collective runs)",
        ),
    ),
    check_ranks,
    ranks=True,
)
