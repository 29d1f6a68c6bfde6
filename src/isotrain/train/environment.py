"""What the machine must offer a run: the device, a usable run directory, optional packages,
and enough memory.

Checked before anything is built or written, so a run that cannot work fails in one line; an
allocation that fails later (building the model, or in a step) is one line too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from isotrain.train.fields import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = [
    "LAUNCHER",
    "OutOfMemory",
    "available_memory",
    "check_cpu_kind",
    "check_device",
    "check_directory",
    "check_extra",
    "gib",
    "install_hint",
    "memory_for",
    "relative",
    "require_memory",
]

# Set by `isotrain train --nproc-per-node` for its torchrun workers: the program the user ran
# (for next-step hints), and the sign that the launcher prints the workers' user errors.
LAUNCHER = "ISOTRAIN_LAUNCHER"

# torch's CPU allocator: "... you tried to allocate 123 bytes"; CUDA: "Tried to allocate 2.00 GiB"
_SIZE = re.compile(r"tried to allocate\s+([0-9.]+\s*(?:bytes|[KMGTP]i?B))", re.IGNORECASE)
_OOM = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory")


class OutOfMemory(ConfigError):
    """An allocation failed; the message names its size and the settings that shrink it."""


def _size(text: str) -> str:
    """The size an allocation failure names, as `117.7 MiB`, or `an unknown amount`."""
    found = _SIZE.search(text)
    if found is None:
        return "an unknown amount"
    value = found.group(1)
    if not value.endswith("bytes"):
        return value
    n = float(value.split()[0])
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return value


@contextlib.contextmanager
def memory_for(what: str, *, lower: str) -> Iterator[None]:
    """Turn an allocation failure in the block into one line: what ran out, the size it
    asked for, and the settings (`lower`) that need less memory."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        import torch  # imported by then: the block ran torch

        text = str(e)
        oom = isinstance(e, (torch.OutOfMemoryError, MemoryError))
        if not oom and not any(m in text.lower() for m in _OOM):
            raise
        raise OutOfMemory(
            f"out of memory {what}: tried to allocate {_size(text)}; lower {lower}"
        ) from None


def available_memory(device: torch.device) -> int | None:
    """Bytes this process may still allocate on `device`, or None where it cannot be read: on
    a CPU MemAvailable plus free swap (shared by the local ranks), on CUDA what is free plus
    what torch holds unused."""
    if device.type == "cuda":
        import torch  # imported by then: `device` is a torch.device

        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    fields = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) * 1024  # "MemAvailable:  123 kB"
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in fields:
        return None
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    return (fields["MemAvailable"] + fields.get("SwapFree", 0)) // local


def gib(n: int) -> str:
    """`n` bytes as `12.5 MiB`, `1.5 GiB` or `3.2 TiB`."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**20:.1f} MiB"


def require_memory(needed: int, device: torch.device, *, what: str, lower: str) -> None:
    """Refuse, before anything is built, a run whose least memory (`needed` bytes: `what`)
    exceeds what `device` has available; `lower` names the settings that need less."""
    have = available_memory(device)
    if have is not None and needed > have:
        raise OutOfMemory(
            f"a training step of this shape needs at least {gib(needed)} ({what}) and "
            f"{device} has {gib(have)} available; lower {lower}"
        )


def check_device(name: str) -> None:
    """Refuse a device this machine does not have, before anything is built."""
    if name == "auto":
        return
    import torch  # not at the top: the CLI parses its flags before torch is imported

    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ConfigError(
            f"--device {name!r} is not a device; try --device auto (or cpu, cuda, cuda:N)"
        ) from None
    if dev.type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        ok = have > (dev.index or 0)
    elif dev.type == "meta":
        ok = False
    else:
        backend = getattr(torch.backends, dev.type, None) or getattr(torch, dev.type, None)
        ok = dev.type == "cpu" or bool(getattr(backend, "is_available", lambda: False)())
    if not ok:
        raise ConfigError(f"--device {name!r}: this machine has no such device; try --device cpu")


def check_cpu_kind() -> None:
    """Refuse an unknown ISOTRAIN_CPU_KIND before anything is built (it picks the bf16 paths)."""
    from isotrain.autograd import forced_cpu_kind  # imports torch: after the flags are parsed

    try:
        forced_cpu_kind()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_directory(option: str, path: str | None) -> None:
    """A run directory must be a directory, or creatable: not a file, not under a file."""
    if path is None:
        return
    p = Path(path).expanduser()
    for at in (p, *p.parents):
        if at.exists():
            if not at.is_dir():
                where = "is a file" if at == p else f"lies under the file {at}"
                raise ConfigError(f"{option} {path} {where}; try another {option}")
            return


def check_extra(module: str, option: str, extra: str) -> None:
    """Refuse `option` when the optional package `module` (from isotrain[extra]) is missing."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{option} needs the {module} package, which is not installed; "
            f"try {install_hint(extra)}"
        )


def relative(path: Path) -> str:
    """`path` as a user types it here: relative to the working directory when inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def install_hint(extra: str) -> str:
    """The command that installs isotrain's `extra` into the running environment: in a source
    checkout (a clone, installed editable) `.venv/bin/pip install -e '.[data]'`, else
    `pip install 'isotrain[data]'`."""
    root = Path(__file__).resolve().parents[3]  # src/isotrain/train/environment.py -> root
    pip = Path(sys.executable).with_name("pip")
    if not (root / "pyproject.toml").is_file() or not pip.is_file():
        return f"pip install 'isotrain[{extra}]'"
    target = "." if root == Path.cwd().resolve() else relative(root)
    where = (
        pip if pip.parent.resolve() != Path(shutil.which("pip") or "/").resolve().parent else "pip"
    )
    return f"{relative(where) if isinstance(where, Path) else where} install -e '{target}[{extra}]'"
