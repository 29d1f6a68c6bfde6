"""What this device offers bf16, in words for the header: from the CPU's own flags, or the GPU.

A CPU's bf16 speed depends on its instructions: AMX tiles (bf16 matmuls several times faster
than fp32), AVX512-BF16 (native dot products, no tiles), or neither (bf16 converted in
software). torch reports "AVX512" for the first two alike, so the header reads the flags.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from isotrain.autograd import native_bf16_matmul

__all__ = ["bf16_native", "cpu_bf16", "cpu_flags", "device_name", "read_cpuinfo"]


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


def cpu_flags() -> set[str]:
    """The first processor's feature flags (`flags` on x86, `Features` on Arm)."""
    return set((_field(read_cpuinfo(), "flags", "Features") or "").split())


def cpu_bf16(flags: set[str]) -> str:
    """What the flags say of bf16, after "this CPU": `has AMX tiles (...)`, `has AVX512-BF16
    but no AMX tiles`, `has neither AMX tiles nor AVX512-BF16`, ..."""
    if {"amx_bf16", "amx_tile"} <= flags:
        return "has AMX tiles (amx_bf16, amx_tile)"
    if "avx512_bf16" in flags:
        return "has AVX512-BF16 but no AMX tiles"
    if "bf16" in flags:  # Arm's BF16 extension (Features: ... bf16 ...)
        return "has Arm BF16 instructions"
    if not flags:
        return "shows no flags (no /proc/cpuinfo)"
    return "has neither AMX tiles nor AVX512-BF16"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's `model name`."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return _field(read_cpuinfo(), "model name") or platform.processor() or platform.machine()


def bf16_native(device: torch.device) -> tuple[bool, str]:
    """Whether bf16 is worth timing on `device` (False: fp32 without a probe), and why."""
    if device.type == "cuda":
        has = torch.cuda.is_bf16_supported()
        return has, f"{device_name(device)} {'has' if has else 'has no'} bf16"
    if device.type != "cpu":
        return False, f"bf16 is not probed on {device.type}"
    words = f"this CPU {cpu_bf16(cpu_flags())}"
    if native_bf16_matmul():
        return True, words
    return False, f"{words}: bf16 is emulated (AVX2), so fp32 is faster"
