"""Writes into the run directory that fail in one line: what was being written, why, and
what is still safe (the last good snapshot).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from isotrain.train.files import open_regular
from isotrain.train.rundir.integrity import read_pointer

__all__ = ["WriteError", "append_line", "write_error", "writing"]

# torch.save reports a failed write as a RuntimeError from its zip writer, without an errno.
_TORCH_WRITE_ERRORS = ("inline_container", "PytorchStreamWriter", "file write failed")


class WriteError(RuntimeError):
    """A write into the run directory failed (disk full, permissions, I/O); nothing that was
    complete before is lost."""


def _safe_note(run_dir: Path) -> str:
    latest = read_pointer(run_dir / "snapshots" / "LATEST")
    if latest is None:
        return "no snapshot had been written yet"
    return f"the last good snapshot ({latest}) is safe"


@contextlib.contextmanager
def writing(what: str | Path, run_dir: str | Path) -> Iterator[None]:
    """Turn an OSError (or torch's failed-write RuntimeError) in the block into a WriteError
    naming `what`, the reason, and the snapshot a rerun resumes from."""
    try:
        yield
    except OSError as e:
        reason = e.strerror or str(e)
        raise write_error(what, reason, run_dir, e.errno) from e
    except RuntimeError as e:
        if isinstance(e, WriteError) or not any(m in str(e) for m in _TORCH_WRITE_ERRORS):
            raise
        raise write_error(what, "the write failed (disk full?)", run_dir) from e


def write_error(
    what: str | Path, reason: str, run_dir: str | Path, code: int | None = None
) -> WriteError:
    """`could not write WHAT: REASON; the last good snapshot (...) is safe. Try ...`"""
    fix = "free some space" if code in (None, errno.ENOSPC, errno.EDQUOT) else "fix that"
    return WriteError(
        f"could not write {what}: {reason}; {_safe_note(Path(run_dir))}. Try to {fix}, then "
        "run the same command again to resume"
    )


def append_line(path: Path, line: str) -> None:
    """Append `line` and a newline in whole: a failed write is cut back off the file, so a
    full disk never leaves half a record. Never through a link, a FIFO or a directory."""
    data = memoryview((line + "\n").encode("utf-8"))
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)
