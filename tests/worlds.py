"""Test aids for gloo worlds on 127.0.0.1: a free port, and a spawned rank's environment."""

from __future__ import annotations

import os
import socket

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
