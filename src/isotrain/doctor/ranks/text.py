"""The findings of the cross-rank checks, in words: what differs, on which ranks, why, the fix."""

from __future__ import annotations

from typing import Any

from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ranks.link import split_ranks

__all__ = [
    "gradient_finding",
    "merge_findings",
    "mismatch_finding",
    "replica_finding",
    "same_data_finding",
    "sharded_finding",
]

_CAUSE = {
    "replaced": (
        "some parameters are not the tensors DistributedDataParallel wrapped: they were replaced "
        "after DDP(model) was built, so its hooks wait on the old ones and average nothing (with "
        "find_unused_parameters=True silently; without, DDP raises at the next step)",
        "build DistributedDataParallel(model) after the model's last change (a new or replaced "
        "layer, loaded weights assigned as new Parameters)",
    ),
    "bypassed": (
        "the step called the model without its DDP wrapper (model.module(...)), so backward "
        "averaged nothing",
        "call every training forward through the DDP wrapper, never through .module",
    ),
    "no_sync": (
        "the last backward before optimizer.step() ran under no_sync() (gradient sync off)",
        "enter no_sync() only for the micro-batches before the last one: the last backward "
        "must run with sync on",
    ),
    "retained": (
        "several backwards ran through one forward (retain_graph=True), and "
        "DistributedDataParallel averages the gradients of one backward per forward: the later "
        "backwards' gradients stay each rank's own",
        "sum the loss's parts and call backward once per forward (or run a forward for each "
        "backward)",
    ),
    "moved": (
        "DDP's hooks no longer see these gradients: the model was converted in place after "
        "wrapping (.to(dtype), .half()/.double() and back, .to(device)), which gives each "
        "parameter new gradient accumulators",
        "convert the model (dtype, device) before DistributedDataParallel(model), or wrap it "
        "again after the conversion",
    ),
    "plain": (
        "nothing averaged the gradients across ranks between the last backward and "
        "optimizer.step()",
        "wrap the model in DistributedDataParallel, or all_reduce each .grad after the last "
        "backward and divide it by the world size before optimizer.step()",
    ),
    "sharded": (
        "the model also holds parameters sharded across ranks (tensor or expert parallel), and "
        "these replicated ones got other gradients on each rank: the ranks computed other "
        "outputs (a row-parallel layer's partial sums not all-reduced in forward), or saw "
        "other data and their gradients were not all-reduced",
        "all_reduce each row-parallel output in forward; where the ranks see other data, "
        "all_reduce the replicated parameters' .grad after backward and divide it by the "
        "world size before optimizer.step()",
    ),
}


def _list(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def _differing(names: list[str], sums: list[list[int]]) -> list[str]:
    return [n for i, n in enumerate(names) if len({s[i] for s in sums}) > 1]


def _which(sums: list[list[int]]) -> str:
    return split_ranks([tuple(s) for s in sums])


def gradient_finding(
    synced: list[list[int]], spread: tuple[str, float], names: list[str], cause: str, step: int,
    *, at_step: bool = True,
) -> Finding:  # fmt: skip
    """gradient_not_synchronized: the gradients optimizer.step() used differ across ranks
    (`at_step`: as it received them; else as the last backward left them)."""
    bad = _differing(names, synced)
    why, fix = _CAUSE[cause]
    when = "at optimizer.step()" if at_step else "after backward"
    return Finding(
        "gradient_not_synchronized", "error", _list(bad),
        f"{when} (step {step}), the gradients of {len(bad)} of {len(names)} replicated "
        f"parameters differ across ranks ({_which(synced)}; max |difference| {spread[1]:.3g} in "
        f"{spread[0]}): each rank trains on its own gradients and the replicas drift apart; "
        f"{why}",
        fix,
    )  # fmt: skip


_STAGE = {
    "start": (
        "before any step",
        "the replicas were changed on some ranks after DistributedDataParallel broadcast them "
        "(parameters replaced or initialised per rank, weights loaded on one rank)",
        "finish the model (layers, loaded weights) before DistributedDataParallel(model), or "
        "broadcast every parameter from rank 0 (torch.distributed.broadcast(p, src=0))",
    ),
    "between": (
        "after the step",
        "their gradients were equal after backward but differed at optimizer.step(): something "
        "between backward and the update acted on some ranks only (clipping under `if rank == "
        "0`, a rank-dependent scale or hook)",
        "do the same on every rank between backward and optimizer.step(): clip with "
        "clip_grad_norm_ on every rank, never under a rank condition",
    ),
    "buffers": (
        "after the steps",
        "no step writes these buffers (constants the model reads), yet the ranks hold different "
        "ones: built from a per-rank seed or loaded on some ranks, and DistributedDataParallel"
        "(broadcast_buffers=False) never broadcast them",
        "build them alike on every rank (seed before building the model, not with the rank), "
        "or keep broadcast_buffers=True so DDP broadcasts them from rank 0",
    ),
    "update": (
        "after the step",
        "their gradients were equal at optimizer.step(): the update itself differs (optimizer "
        "state or learning rate differs by rank, a step taken on some ranks only)",
        "give every rank the same optimizer state and schedule (load the optimizer's state "
        "on every rank, step the scheduler on every rank)",
    ),
}


def replica_finding(
    stage: str, sums: list[Any], spread: tuple[str, float] | None, names: list[str], *,
    step: int = 0,
) -> Finding:  # fmt: skip
    """replica_divergence: parameters that differ across ranks, with when and why."""
    if stage == "models":
        counts = ", ".join(f"rank {r}: {len(n)}" for r, (n, _) in enumerate(sums))
        return Finding(
            "replica_divergence", "error", "the model",
            f"the ranks hold different parameter lists ({counts} replicated tensors, or other "
            "names): they are not replicas of one model",
            "build the same model on every rank (no rank-dependent layers or sizes)",
        )  # fmt: skip
    when, why, fix = _STAGE[stage]
    if stage not in ("start", "buffers"):
        when = f"after step {step}"
    bad = _differing(names, sums)
    name, largest = spread if spread is not None else (bad[0], float("nan"))
    what = "unwritten buffers" if stage == "buffers" else "replicated parameters"
    return Finding(
        "replica_divergence", "error", _list(bad),
        f"{when}, {len(bad)} of {len(names)} {what} differ across ranks "
        f"({_which(sums)}; max |difference| {largest:.3g} in {name}): {why}",
        fix,
    )  # fmt: skip


def sharded_finding(sharded: list[str], total: int) -> Finding:
    """replica_divergence, info: parameters that differ before any step in a model no
    framework wraps, taken as each rank's own shard and left out of every comparison."""
    return Finding(
        "replica_divergence", "info", _list(sharded),
        f"{len(sharded)} of {total} parameters differ across ranks before the first step and no "
        "DDP/FSDP wrapper holds the model: taken as shards (tensor or expert parallel), each "
        "rank's own, and not compared; the others are compared as replicas (their buffers and "
        "batches not: shards and shared data are by design here)",
        "-",
    )  # fmt: skip


def same_data_finding(hashes: list[list[str]], *, sharded: bool = False) -> list[Finding]:
    """same_data_on_ranks: ranks that got byte-identical batches (not judged for a model with
    shards: tensor-parallel ranks share their batches by design)."""
    n = min(len(h) for h in hashes)
    shared = [i for i in range(n) if len({h[i] for h in hashes}) < len(hashes)]
    if not shared or sharded:
        return []
    groups: dict[tuple[str, ...], list[int]] = {}
    for r, h in enumerate(hashes):
        groups.setdefault(tuple(h[i] for i in shared), []).append(r)
    same = [rs for rs in groups.values() if len(rs) > 1]
    ranks = "; ".join("ranks " + ", ".join(map(str, rs)) for rs in same)
    batches = ", ".join(f"batches[{i}]" for i in shared)
    return [Finding(
        "same_data_on_ranks", "error", "batches",
        f"{ranks} got byte-identical {batches} (sha1 {hashes[same[0][0]][shared[0]]}): the "
        "ranks train on the same samples, so the world does the work of one rank",
        "give each rank its own shard: DataLoader(dataset, sampler=DistributedSampler(dataset)) "
        "with sampler.set_epoch(epoch) at each epoch (without it every epoch repeats the first "
        "one's order), or slice a stream by rank (data[rank::world_size])",
    )]  # fmt: skip


def merge_findings(per_rank: list[list[Finding]]) -> list[Finding]:
    """One list from every rank's findings: rank 0's wording for what every rank found, and
    "on rank(s) R:" before what only some did."""
    seen: dict[tuple[str, str, str], tuple[Finding, list[int]]] = {}
    for r, found in enumerate(per_rank):
        for f in found:
            key = (f.kind, f.severity, f.where)
            _, rs = seen.setdefault(key, (f, []))
            if r not in rs:
                rs.append(r)
    out = []
    for f, rs in seen.values():
        if len(rs) < len(per_rank):
            on = f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))
            f = Finding(f.kind, f.severity, f.where, f"on {on} only: {f.evidence}", f.fix)
        out.append(f)
    return out


def mismatch_finding(where: str, evidence: str) -> Finding:
    """collective_mismatch: a collective whose tensors differ across ranks, caught before it ran."""
    return Finding(
        "collective_mismatch", "error", where, evidence,
        "give the tensor the same shape and dtype on every rank before the collective (e.g. "
        "torch.bincount(y, minlength=num_classes), pad to a fixed length, cast to one dtype), "
        "or send data whose size varies by rank with all_gather_object",
    )  # fmt: skip
