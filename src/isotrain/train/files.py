"""Every file isotrain writes goes through here: created fresh, then renamed into place.

A run directory (or a `prepare --out` folder) is untrusted: anyone may have planted a link to
a file elsewhere, a FIFO (whose `open` blocks forever) or a directory where a file goes. So
a file is never opened by its final name for writing: `new_file` creates a new temporary
(`tempfile`, `O_EXCL | O_NOFOLLOW`) beside it and `os.replace`s it into place, after checking
that what it replaces is a regular file; `open_regular` opens a file that must exist
(appends, the lock) without following a link and without blocking, and refuses anything
that is not a regular file. Each refusal is one line naming the path and the fix.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from isotrain.train.fields import ConfigError

__all__ = [
    "PlantedPathError",
    "check_regular",
    "make_dir",
    "new_file",
    "new_path",
    "open_regular",
    "remove_leftover",
    "replace_file",
]


class PlantedPathError(ConfigError):
    """A path isotrain writes (or must read) is a link, FIFO, directory or device."""


def _kind(mode: int) -> str:
    kinds = [
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ]
    return next((name for test, name in kinds if test(mode)), "a device")


def _refuse(path: Path, mode: int) -> PlantedPathError:
    return PlantedPathError(
        f"{path} is {_kind(mode)}, not a regular file: isotrain never writes or reads through "
        "one (it may lead out of the run or block forever); remove it, then try again"
    )


def check_regular(path: str | Path) -> bool:
    """True when `path` is a regular file, False when nothing is there; anything else (a
    link, FIFO, directory, device) raises PlantedPathError. Never follows a link."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(mode):
        raise _refuse(Path(path), mode)
    return True


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (else set and restore)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    old = os.umask(0o022)
    os.umask(old)
    return old


@contextlib.contextmanager
def _fresh(path: Path, sync: bool) -> Iterator[tuple[int, Path]]:
    """A new temporary beside `path` (open fd, its name), renamed onto `path` on success."""
    check_regular(path)
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.tmp", dir=path.parent)
    except OSError as e:  # name the file the user asked for, not our temporary
        raise OSError(e.errno, e.strerror, str(path)) from e
    tmp, closed = Path(name), False
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        yield fd, tmp
        if sync:
            os.fsync(fd)
        os.close(fd)
        closed = True
        _ordinary(tmp)
        check_regular(path)
        os.replace(tmp, path)
        if sync:
            _fsync_dir(path.parent)
    finally:
        if not closed:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _ordinary(tmp: Path) -> None:
    """Give the temporary, which a library may have replaced by its own (safetensors writes
    0600 files), a plain file's mode, through a descriptor: never through a link."""
    fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise _refuse(tmp, st_mode)
        if stat.S_IMODE(st_mode) != 0o666 & ~_umask():
            os.fchmod(fd, 0o666 & ~_umask())
    finally:
        os.close(fd)


def remove_leftover(path: Path) -> None:
    """Remove a leftover (or planted) temporary: a directory with what it holds, anything
    else (a link, a FIFO) by its name alone, never what a link points to."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def new_path(path: str | Path, *, sync: bool = False) -> Iterator[Path]:
    """A fresh, empty temporary file beside `path` (mode 0666 less the umask), for a library
    that writes by file name; renamed onto `path` when the block succeeds, removed otherwise."""
    with _fresh(Path(path), sync) as (_, tmp):
        yield tmp


@contextlib.contextmanager
def new_file(path: str | Path, *, sync: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write `path` through: a fresh temporary, renamed onto `path` when the
    block succeeds (a regular file there is replaced; anything else is refused)."""
    with _fresh(Path(path), sync) as (fd, _), open(fd, "wb", closefd=False) as f:
        yield f


def replace_file(path: str | Path, data: bytes | str, *, sync: bool = False) -> Path:
    """Write `path` whole (text as UTF-8) through a fresh temporary and a rename."""
    with new_file(path, sync=sync) as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def open_regular(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` for a file that may exist (an append, the lock): never through a link, never
    blocking on a FIFO; anything but a regular file raises PlantedPathError."""
    check_regular(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError:  # swapped for something else since the check: say what it is
        with contextlib.suppress(FileNotFoundError):
            check_regular(path)
        raise
    st_mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(st_mode):
        os.close(fd)
        raise _refuse(Path(path), st_mode)
    os.set_blocking(fd, True)
    return fd


def make_dir(path: str | Path, *, follow: bool = False) -> Path:
    """`mkdir -p path`, refusing a final component that is not a directory: a FIFO, a file,
    or (unless `follow`, for a folder the user named) a link, even to a directory."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        path.mkdir(parents=True, exist_ok=False)
    mode = os.lstat(path).st_mode
    if follow and stat.S_ISLNK(mode):
        with contextlib.suppress(OSError):
            mode = os.stat(path).st_mode
    if not stat.S_ISDIR(mode):
        raise PlantedPathError(
            f"{path} is {_kind(mode)}, not a directory: isotrain never writes through one "
            "(it may lead elsewhere); remove it, or choose another output"
        )
    return path
