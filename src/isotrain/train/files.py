"""Every file isotrain writes goes through here: created fresh, then renamed into place.

A run directory (or a `prepare --out` folder) is untrusted: anyone may have planted a link to
a file elsewhere, a FIFO (whose `open` blocks forever) or a directory where a file goes. So
a file is never opened by its final name for writing: `new_file` creates a new temporary
(`tempfile`, `O_EXCL | O_NOFOLLOW`) beside it and `os.replace`s it into place, after checking
that what it replaces is a regular file; `open_regular` opens a file that must exist
(appends, the lock) without following a link and without blocking, and refuses anything
that is not a regular file. Each refusal is one line naming the path and the fix.

NOTE [temporaries]: every temporary is named `.<name>.isotrain-tmp.<space>.<pid>.<start>.<random>`:
`<space>` tags the boot and PID namespace of its writer (a pid names one process only within
them), `<pid>` and `<start>` (clock ticks since boot, from /proc/PID/stat; `x` where there is
no /proc) name the writer itself. A writer killed mid-way leaves its temporary behind; the next
command that writes the folder calls `remove_stale`, which removes a temporary only when it can
tell its writer is gone: same space, same owner, a regular file or directory, and no live
process with that pid and start time (a reused pid has another start time, a zombie writes
nothing). Anything else (a live writer's temporary, another machine's or container's, a link,
a FIFO, a file that merely looks like a temporary) is left where it is.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import shutil
import socket
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
    "new_dir",
    "new_file",
    "new_path",
    "open_regular",
    "remove_stale",
    "replace_file",
    "sweep",
    "temp_name",
]

log = logging.getLogger(__name__)

_MARK = ".isotrain-tmp."
_NAME_KEPT = 120  # of a final name, in its temporary's: room for the rest within 255 bytes
_TEMP = re.compile(
    r"\.(?P<name>.+)\.isotrain-tmp\.(?P<space>[0-9a-f]{8})\.(?P<pid>[1-9][0-9]{0,9})"
    r"\.(?P<start>[0-9]{1,20}|x)\.[a-z0-9_]{8}"  # the last part: tempfile's random letters
)


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


@functools.cache
def _space() -> str:
    """A tag of the boot and PID namespace this process runs in (NOTE [temporaries])."""
    parts = []
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(os.readlink("/proc/self/ns/pid"))
    return hashlib.sha256("\0".join(parts or [socket.gethostname()]).encode()).hexdigest()[:8]


def _start_of(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot; `x` where there is no /proc to
    tell), or None when no such process lives (a zombie does not: it writes nothing)."""
    if not os.path.exists("/proc/self/stat"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's
            pass
        return "x"
    try:
        text = Path(f"/proc/{pid}/stat").read_bytes().decode("ascii", errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # after the command name, which may hold ")"
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def temp_name(name: str) -> str:
    """The start of the name of a temporary for the final name `name`, written by this
    process: `.<name>.isotrain-tmp.<space>.<pid>.<start>.`; random letters follow."""
    pid = os.getpid()
    return f".{name[:_NAME_KEPT]}{_MARK}{_space()}.{pid}.{_start_of(pid) or 'x'}."


def _writer_gone(name: str) -> bool:
    """True when `name` is a temporary whose writer surely no longer runs."""
    found = _TEMP.fullmatch(name)
    if found is None or found["space"] != _space():
        return False
    now = _start_of(int(found["pid"]))
    return now is None or ("x" not in (now, found["start"]) and now != found["start"])


def _bytes(path: str, st: os.stat_result) -> int:
    """Bytes of a file, or of the files under a directory (links not followed)."""
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size
    total = 0
    for top, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(top, name)).st_size
    return total


def sweep(folder: str | Path) -> tuple[int, int]:
    """Remove the temporaries in `folder` whose writer is gone (NOTE [temporaries]); returns
    how many were removed and their bytes. Never follows a link; a missing folder is empty."""
    try:
        entries = list(os.scandir(folder))
    except OSError:  # missing, not a directory, unreadable: nothing to remove
        return 0, 0
    count = size = 0
    for entry in entries:
        if not _writer_gone(entry.name):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:  # gone already
            continue
        if st.st_uid != os.geteuid() or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            continue  # isotrain makes neither links nor FIFOs, nor files of other users
        n = _bytes(entry.path, st)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        if not os.path.lexists(entry.path):  # gone (another sweeper may have been first)
            count, size = count + 1, size + n
    return count, size


def _amount(n: int) -> str:
    """Bytes as a person reads them: `512 bytes`, `12.3 kB`, `120.4 MB`."""
    if n < 1000:
        return f"{n} byte{'' if n == 1 else 's'}"
    value = float(n)
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000 or unit == "TB":
            break
    return f"{value:.1f} {unit}"


def remove_stale(folder: str | Path, *inside: str) -> tuple[int, int]:
    """Sweep `folder` and its subfolders `inside`, saying in one line what was removed (a
    killed writer's temporaries are garbage nothing else names); returns (count, bytes)."""
    found = [sweep(Path(folder, sub)) for sub in ("", *inside)]
    count, size = sum(c for c, _ in found), sum(b for _, b in found)
    if count:
        what = "temporary" if count == 1 else "temporaries"
        where = "the current folder" if Path(folder) == Path() else folder
        log.info(
            "removed %d stale %s (%s) left by an interrupted run in %s",
            count, what, _amount(size), where,
        )  # fmt: skip
    return count, size


@contextlib.contextmanager
def _fresh(path: Path, sync: bool) -> Iterator[tuple[int, Path]]:
    """A new temporary beside `path` (open fd, its name), renamed onto `path` on success."""
    check_regular(path)
    try:
        fd, name = tempfile.mkstemp(prefix=temp_name(path.name), dir=path.parent)
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


def new_dir(path: str | Path) -> Path:
    """A fresh, empty temporary directory beside `path` (mode 0777 less the umask), for a
    writer that fills it and then renames it onto `path`."""
    path = Path(path)
    tmp = Path(tempfile.mkdtemp(prefix=temp_name(path.name), dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


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
