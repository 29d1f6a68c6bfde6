"""Snapshots of distributed runs: per-rank RNG states, and FSDP2 shards through DCP.

DDP keeps one copy of model and optimizer (rank 0 writes it through `snapshot.py`), but each
rank has its own RNG stream, so every rank's state is gathered to rank 0 and stored as a list.
FSDP2 state is sharded: every rank writes its shards with `torch.distributed.checkpoint` into
the same temporary directory, then rank 0 adds `state.pt` (the rest), `meta.json`, renames the
directory and moves LATEST, exactly as `snapshot.py` does for one process::

    RUN/snapshots/step_0000400/shards/     DCP files: .metadata, __0_0.distcp, __1_0.distcp, ...
    RUN/snapshots/step_0000400/state.pt    counters, updater, per-rank RNG, config (no weights)
    RUN/snapshots/step_0000400/meta.json   as snapshot.py: the sha256 of every file, shards too

All ranks must see the run directory (one node, or a shared filesystem across nodes).
Loading verifies every shard against the manifest and reads DCP's metadata and non-tensor
items without running code (`safe_dcp.py`).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from isotrain.train.config import ConfigError
from isotrain.train.files import new_dir
from isotrain.train.rundir.integrity import SnapshotError, one_line
from isotrain.train.rundir.snapshot import SHARDS, open_shards, publish, snapshots_dir
from isotrain.train.rundir.writes import write_error, writing

__all__ = [
    "SHARDS",
    "barrier",
    "check_layout",
    "gather_to_main",
    "load_full_model",
    "load_sharded",
    "rank_rng_state",
    "save_sharded",
]


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_to_main(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere). A collective call."""
    rank, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def rank_rng_state(payload: dict[str, Any], rank: int) -> dict[str, Any]:
    """The RNG state that `rank` saved; rank 0's for snapshots without per-rank states."""
    per_rank = payload.get("rng_per_rank") or []
    return per_rank[rank] if rank < len(per_rank) else payload["rng"]


def check_layout(payload: dict[str, Any], path: Path, *, mode: str, world_size: int) -> None:
    """Refuse a resume that cannot continue the snapshot: sharded vs not, world size of FSDP."""
    saved_world = int(payload.get("world_size", 1))
    relaunch = (
        f"{saved_world} processes in total (torchrun --nproc-per-node {saved_world} on one "
        f"node, or nnodes x nproc-per-node = {saved_world})"
    )
    if payload.get("sharded"):
        if mode != "fsdp":
            raise ConfigError(
                f"cannot resume: {path} holds FSDP shards from {saved_world} ranks but "
                f"--parallel.mode is {mode}; relaunch with {relaunch} and --parallel.mode fsdp"
            )
        if saved_world != world_size:
            raise ConfigError(
                f"cannot resume: {path} was written by {saved_world} FSDP ranks but this run "
                f"has {world_size}. A different world size changes every rank's shard of the "
                "data, the global batch (tokens per step) and the per-rank random streams, so "
                f"the run would not continue as it was. Relaunch with {relaunch}, or start a "
                "new --out-dir"
            )
    elif mode == "fsdp":
        raise ConfigError(
            f"cannot resume: {path} is a single-copy snapshot (--parallel.mode ddp or none), but "
            "--parallel.mode is fsdp; resume it in the mode that wrote it"
        )


def save_sharded(
    run_dir: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    payload: dict[str, Any],
    *,
    step: int,
    val_loss: float | None = None,
    keep: int = 2,
) -> Path:
    """Write an FSDP2 snapshot of `step` (a collective: every rank calls it); returns its path.

    `payload` is what rank 0 stores beside the shards (model and optimizer go to the shards).
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    rank, world = _world()
    root = snapshots_dir(run_dir)
    made = [""]  # rank 0 makes the temporary directory that every rank writes into
    if rank == 0:
        with writing(f"the snapshot of step {step}", run_dir):
            root.mkdir(parents=True, exist_ok=True)
            made[0] = new_dir(root / f"step_{step:07d}").name
    if world > 1:
        dist.broadcast_object_list(made, src=0)
    tmp = root / made[0]
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:  # DCP agrees on failures across ranks: every rank raises if one could not write
        save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp / SHARDS)
    except CheckpointException as e:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(
            f"the shards of step {step} ({tmp / SHARDS})", one_line(e), run_dir
        ) from None
    barrier()  # every rank's shards are on disk before rank 0 publishes the directory
    if rank == 0:
        publish(tmp, payload, step=step, val_loss=val_loss, keep=keep)
    barrier()  # nobody moves on (or exits) before the snapshot is complete
    return root / f"step_{step:07d}"


def barrier() -> None:
    """Wait for every rank (nothing to wait for in a world of one)."""
    if _world()[1] > 1:
        dist.barrier()


def _load_dcp(path: str | Path, state: dict[str, Any], *, no_dist: bool = False) -> None:
    """Fill `state` from the verified shards of snapshot `path`; SnapshotError if they do not
    fit (DCP gathers failures, so every rank raises together)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    from isotrain.train.rundir.safe_dcp import SafeLoadPlanner, SafeReader

    shards, metadata = open_shards(path)
    reader = SafeReader(shards, metadata)
    try:
        load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:
        raise SnapshotError(f"{path}: its shards do not load ({one_line(e)})") from None


def load_sharded(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load an FSDP2 snapshot's shards into the sharded `model` and `optimizer` (collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)  # templates with this run's sharding
    state: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
    _load_dcp(path, state)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def load_full_model(path: str | Path, model: nn.Module) -> nn.Module:
    """Fill a plain (unsharded) `model` from an FSDP2 snapshot, in one process; returns it.

    Example::

        model = load_full_model("runs/x/snapshots/step_0000400", build_model(cfg))
    """
    sd = model.state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        _load_dcp(path, {"model": sd}, no_dist=True)  # reads every rank's shards
    model.load_state_dict(sd)
    return model
