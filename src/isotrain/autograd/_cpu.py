"""The CPU's flags and kind, read once here: what picks isotrain's bf16 paths on a CPU.

Three kinds of x86 CPU take three paths: `amx` (AMX tiles) and `avx512-bf16` (native bf16 dot
products) run bf16 matmuls through oneDNN, fast in every operand layout; `avx2` (no AVX-512)
multiplies bf16 in a portable kernel, so `Bf16Linear` lays the operands out itself and
`--precision auto` keeps fp32. ``ISOTRAIN_CPU_KIND`` forces a kind: NOTE [forcing the CPU kind].
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

__all__ = [
    "CPU_KINDS",
    "CPU_KIND_ENV",
    "cpu_flags",
    "cpu_model",
    "forced_cpu_kind",
    "native_bf16_matmul",
]

# NOTE [forcing the CPU kind]
# Each machine runs only its own kind's path, so a break in another kind's path waits for
# someone with that CPU. ``ISOTRAIN_CPU_KIND=avx2|avx512-bf16|amx`` makes every choice isotrain
# takes from the CPU take that kind's branch: `cpu_flags` answers the kind's flags,
# `native_bf16_matmul` its answer (so `bf16_linear_layers` converts or not), and the trainer's
# header says the kind was forced, with this CPU's own flags beside it. The kernels stay this
# machine's: oneDNN and MKL pick theirs from the hardware, and ATen picks its vectorized
# kernels once at start from ``ATEN_CPU_CAPABILITY`` (set it to `avx2` before Python starts
# for ATen's AVX2 reductions and elementwise kernels). Correctness follows the kind; timings
# stay the machine's.
CPU_KIND_ENV = "ISOTRAIN_CPU_KIND"
"""The environment variable that forces the CPU kind (one of `CPU_KINDS`) isotrain's bf16
paths are chosen for, e.g. ``ISOTRAIN_CPU_KIND=avx2 make test``."""
CPU_KINDS = ("avx2", "avx512-bf16", "amx")
"""The CPU kinds with a bf16 path of their own: Bf16Linear's layout op on AVX2, ATen's matmuls
on AVX512-BF16 and AMX; e.g. ``"avx2" in CPU_KINDS``."""
_BASE = {"fpu", "sse", "sse2", "avx", "avx2", "fma", "f16c"}
_AVX512 = _BASE | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
_KIND_FLAGS = {
    "avx2": frozenset(_BASE),
    "avx512-bf16": frozenset(_AVX512 | {"avx512_bf16"}),
    "amx": frozenset(_AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}),
}


def _read_cpuinfo() -> str:
    """The text of /proc/cpuinfo, or "" where there is none (macOS, Windows)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(cpuinfo: str, *names: str) -> str | None:
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return None


def forced_cpu_kind() -> str | None:
    """The kind ``ISOTRAIN_CPU_KIND`` forces, or None when unset (the CPU's own flags decide).

    An unknown value is a ValueError naming the accepted ones.

    Example:
        >>> forced_cpu_kind()  # "avx2" under ISOTRAIN_CPU_KIND=avx2
    """
    value = os.environ.get(CPU_KIND_ENV, "").strip()
    if not value:
        return None
    if value not in CPU_KINDS:
        raise ValueError(
            f"{CPU_KIND_ENV}={value!r} is not a CPU kind: use one of {', '.join(CPU_KINDS)}, "
            "or unset it to read this CPU's flags"
        )
    return value


def cpu_flags(*, forced: bool = True) -> set[str]:
    """The first processor's feature flags (`flags` on x86, `Features` on Arm); under
    ``ISOTRAIN_CPU_KIND`` the forced kind's flags (``forced=False``: this CPU's own).

    Example:
        >>> "avx512_bf16" in cpu_flags()
    """
    kind = forced_cpu_kind() if forced else None
    if kind is not None:
        return set(_KIND_FLAGS[kind])
    return set((_field(_read_cpuinfo(), "flags", "Features") or "").split())


def cpu_model() -> str:
    """The CPU's `model name` (or the platform's processor string).

    Example:
        >>> cpu_model()  # e.g. 'AMD EPYC 7B13'
    """
    return _field(_read_cpuinfo(), "model name") or platform.processor() or platform.machine()


def native_bf16_matmul() -> bool:
    """Whether this CPU's bf16 matmuls are fast in every operand layout (anything but AVX2 x86;
    ``ISOTRAIN_CPU_KIND`` forces the answer of its kind).

    Example::

        if not native_bf16_matmul():
            bf16_linear_layers(model)
    """
    kind = forced_cpu_kind()
    if kind is not None:
        return kind != "avx2"
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    return not (x86 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"))
