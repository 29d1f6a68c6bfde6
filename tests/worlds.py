"""Test aids for gloo worlds on 127.0.0.1: a free port, a spawned rank's environment, and a
whole spawned world whose ranks each write their results as JSON."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_env(rank: int, world: int, port: int) -> None:
    """What torchrun would set for `rank` of a `world` on this machine; one torch thread."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)


def spawn_world(worker: Callable[[int, int, str], None], out: Path, world: int) -> list[Any]:
    """Run `worker(rank, port, out)` on `world` spawned ranks (none of torchrun's variables
    inherited) and return what each rank wrote to `out/rank{r}.json`, in rank order."""
    import torch.multiprocessing as mp

    saved = {v: os.environ.pop(v) for v in ENV if v in os.environ}
    try:
        mp.spawn(worker, args=(free_port(), str(out)), nprocs=world, join=True)
    finally:
        os.environ.update(saved)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
