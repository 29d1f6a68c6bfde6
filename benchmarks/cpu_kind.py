"""What kind of CPU the benchmarks run on, read from /proc/cpuinfo (no torch import).

bf16 speed on a CPU depends on its instructions far more than on its clock: with AMX tiles a
bf16 matmul runs several times faster than fp32, with AVX512-BF16 it is native but without
tiles, and with AVX2 only it is emulated (slower than fp32). Results are kept per kind, in
benchmarks/results/<kind>/, and every result file names the kind.

    python benchmarks/cpu_kind.py        # prints e.g. "avx512-bf16"
"""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["CAPABILITY", "cpu_flags", "cpu_kind", "cpu_model", "describe", "read_cpuinfo"]

CAPABILITY = {
    "amx": "AMX (bf16 tiles: bf16 matmuls far above fp32)",
    "avx512-bf16": "AVX512-BF16, no AMX (native bf16 dot products, no tiles)",
    "avx2": "AVX2 only (bf16 emulated: slower than fp32)",
}


def read_cpuinfo() -> str:
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


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first processor's feature flags (`flags` on x86, `Features` on ARM)."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return set((_field(text, "flags", "Features") or "").split())


def cpu_kind(cpuinfo: str | None = None) -> str:
    """ "amx", "avx512-bf16" or "avx2" on x86; otherwise the architecture (e.g. "aarch64")."""
    flags = cpu_flags(cpuinfo)
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512-bf16"
    if "avx2" in flags:
        return "avx2"
    return (platform.machine() or "unknown").lower()


def cpu_model(cpuinfo: str | None = None) -> str:
    """The `model name` line of /proc/cpuinfo (or the platform's processor string)."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return _field(text, "model name") or platform.processor() or platform.machine()


def describe(cpuinfo: str | None = None) -> dict[str, str]:
    """Model, kind and bf16 capability: what every benchmark result records."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    kind = cpu_kind(text)
    family, model = _field(text, "cpu family"), _field(text, "model")
    return {
        "cpu": cpu_model(text),
        "cpu_id": f"family {family} model {model}" if family and model else "",
        "cpu_kind": kind,
        "bf16": CAPABILITY.get(kind, "unknown (not x86)"),
    }


if __name__ == "__main__":
    print(cpu_kind())
