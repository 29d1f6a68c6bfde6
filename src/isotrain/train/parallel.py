"""torchrun process group, DDP / FSDP2 wrapping, and rank helpers.

Processes come from torchrun (`torchrun -m isotrain train`, or `isotrain train
--nproc-per-node N`, which runs torchrun's launcher): it sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT, and this module reads them. NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from isotrain import BlockSpec, find_blocks
from isotrain.train.config import ConfigError

T = TypeVar("T")

__all__ = [
    "DistInfo",
    "LauncherWatch",
    "all_reduce_mean",
    "any_rank",
    "from_main",
    "full_value",
    "init_distributed",
    "no_grad_sync",
    "process_group_scope",
    "wrap_model",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LauncherWatch:
    """Whether the process that launched this one (torchrun's agent) has died: its workers
    are then reparented, and must stop with a snapshot rather than train on unsupervised
    with the run's lock held. Only under torchrun (TORCHELASTIC_RUN_ID set)."""

    def __init__(self) -> None:
        launched = "TORCHELASTIC_RUN_ID" in os.environ
        self.parent = os.getppid() if launched else None

    def gone(self) -> bool:
        """True once the launcher is no longer this process's parent (one cheap syscall)."""
        return self.parent is not None and os.getppid() != self.parent


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its rank, the world size, its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files and talks to the terminal."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when there are other ranks to agree with."""
        return self.world_size > 1


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`auto` is this rank's CUDA device when there is one, else the CPU."""
    if name == "auto":
        name = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"--device {name!r} is not a device: use auto, cpu, cuda, cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name!r}: this machine has no CUDA device; use --device cpu")
    return device


def _env_ints() -> tuple[int, int, int]:
    """RANK, WORLD_SIZE, LOCAL_RANK as ints, with a clear error when one is not a number."""
    try:
        rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError as e:
        raise ConfigError(f"a torchrun variable is not an integer ({e}); use torchrun") from e
    return rank, world, local


def init_distributed(mode: str, device_name: str) -> DistInfo:
    """Join the torchrun process group when launched by torchrun; else a world of one.

    Ranks other than 0 log errors only, so INFO and WARNING lines appear once (from rank 0).
    """
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present:
        if mode != "none":
            raise ConfigError(
                f"--parallel.mode {mode} needs several processes: isotrain train "
                f"--nproc-per-node 2 --parallel.mode {mode} (or torchrun -m isotrain train)"
            )
        return DistInfo(0, 1, 0, resolve_device(device_name))
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ConfigError(
            f"the distributed environment is half set: {', '.join(present)} present but "
            f"{', '.join(missing)} missing; launch with torchrun, or unset them all"
        )
    rank, world, local = _env_ints()
    if world > 1 and mode == "none":
        raise ConfigError(
            f"torchrun started {world} processes but --parallel.mode is none, so each would "
            "train its own copy; pass --parallel.mode ddp or --parallel.mode fsdp"
        )
    device = resolve_device(device_name, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if device.type == "cuda":  # device_id binds this rank's GPU to the NCCL communicator
            dist.init_process_group(backend="nccl", device_id=device)
        else:
            dist.init_process_group(backend="gloo")
    if rank != 0:
        logging.getLogger("isotrain").setLevel(logging.ERROR)
    return DistInfo(rank, world, local, device)


@contextlib.contextmanager
def process_group_scope() -> Iterator[None]:
    """Destroy the process group on exit if it was created inside the block.

    Wrap a run with it so every exit path (end, error, signal) tears the group down; a group
    that already existed on entry (a caller's own) is left alone. Also restores log levels.

    Example::

        with process_group_scope():
            train(cfg)  # init_distributed() inside joins the torchrun group
    """
    owned = not (dist.is_available() and dist.is_initialized())
    logger = logging.getLogger("isotrain")
    level = logger.level
    try:
        yield
    finally:
        logger.setLevel(level)
        if owned and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def wrap_model(
    model: nn.Module, mode: str, info: DistInfo, *, blocks: BlockSpec = None
) -> nn.Module:
    """DDP wraps the whole model; FSDP2 shards each block, then the root (torch's own engine).

    `blocks` picks the blocks as checkpointing and compile do (default: ModuleList children).

    Apply activation checkpointing and per-block compile (in place) first: FSDP2 keeps an
    instance-level `forward` override and a block's `_compiled_call_impl`, and keys stay clean.
    FSDP2 shards in place, so the returned module is `model` itself (now holding DTensors).
    """
    if mode == "ddp":
        ids = [info.device.index] if info.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for _, block in find_blocks(model, blocks, purpose="blocks to shard"):
            fully_shard(block)
        fully_shard(model)
        return model
    return model


@contextlib.contextmanager
def no_grad_sync(model: nn.Module, *, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce / reduce-scatter for micro-batches before the last one.

    DDP: `no_sync()`. FSDP2: `set_requires_gradient_sync(False)` (recursive; grads accumulate
    unsharded until the last micro-batch reduces them). Otherwise a no-op.
    """
    if sync:
        yield
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        toggle: Any = model.set_requires_gradient_sync
        toggle(False)
        try:
            yield
        finally:
            toggle(True)
    else:
        yield


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of `t` over ranks (identity in a world of one); stays on device."""
    t = full_value(t)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG if t.is_cuda else dist.ReduceOp.SUM)
        if not t.is_cuda:
            t /= dist.get_world_size()
    return t


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the full value of an FSDP2 DTensor (e.g. a clip_grad_norm_ result)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any rank (e.g. a stop signal seen by one).

    A collective and a host sync: call it on every rank at the same steps (log steps).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())  # sync: the agreed decision


def from_main(obj: T) -> T:
    """Rank 0's `obj` on every rank (itself in a world of one): one decision for all ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
