"""The run directory as a shared resource: one writer at a time.

    RUN/.lock    PID of the process training into RUN (an advisory flock held while it runs)

The lock is `fcntl.flock` on that file: the kernel drops it when the holder dies, so a lock
file left by a killed run is stale by construction and simply taken over. Under torchrun
only rank 0 locks; the ranks agree on the outcome so that none trains alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from isotrain.train.config import ConfigError
from isotrain.train.files import PlantedPathError, open_regular, remove_stale
from isotrain.train.parallel import DistInfo, any_rank
from isotrain.train.rundir.writes import WriteError, writing

__all__ = ["LOCK_FILE", "RunLockedError", "lock_run"]

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class RunLockedError(ConfigError):
    """Another live process holds the run directory."""


def _holder(fd: int) -> int | None:
    """The PID written in an open lock file, if it holds one."""
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    return int(text) if text.isdigit() else None


def _acquire(run_dir: Path) -> int:
    """Take the lock of `run_dir` (creating both); returns the open, locked file."""
    path = run_dir / LOCK_FILE
    for _ in range(5):  # the holder may remove the file between our open and our flock
        with writing(path, run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            fd = open_regular(path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise RunLockedError(
                f"{run_dir} is in use by another isotrain process (PID {holder}); wait for it "
                "to finish, or try another --out-dir"
            ) from None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                _claim(fd, path, run_dir)
                return fd
        os.close(fd)
    raise RunLockedError(f"{run_dir}: its lock file keeps changing; try again")


def _claim(fd: int, path: Path, run_dir: Path) -> None:
    """Write our PID into the lock we hold, noting a stale holder we replace."""
    stale = _holder(fd)
    if stale is not None and stale != os.getpid():
        log.warning(
            "%s: taking over the lock of process %d, which no longer holds it", run_dir, stale
        )
    with writing(path, run_dir):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _release(run_dir: Path, fd: int) -> None:
    """Remove the lock file, then drop the lock (a waiter then sees a new file, not ours)."""
    with contextlib.suppress(OSError):
        os.unlink(run_dir / LOCK_FILE)
    os.close(fd)


@contextlib.contextmanager
def lock_run(run_dir: str | Path, info: DistInfo) -> Iterator[None]:
    """Hold `run_dir`'s lock for the block (rank 0 takes it; every rank learns the outcome),
    after removing the temporaries a killed run left in it and in its snapshots."""
    run_dir, fd, error = Path(run_dir), None, None
    created = not run_dir.exists()  # removed again if the run stops before writing anything
    if info.is_main:
        try:
            fd = _acquire(run_dir)
        except (RunLockedError, WriteError, PlantedPathError) as e:
            error = e
    if info.distributed and any_rank(error is not None, info.device):  # sync: once, at start
        error = error or RunLockedError(f"rank 0 could not lock {run_dir}; see its error")
    try:
        if error is not None:
            raise error
        if fd is not None:
            remove_stale(run_dir, "snapshots")
        yield
    finally:
        if fd is not None:
            _release(run_dir, fd)
            if created:
                with contextlib.suppress(OSError):  # only succeeds while it is empty
                    run_dir.rmdir()
