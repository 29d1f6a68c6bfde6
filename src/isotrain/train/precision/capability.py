"""What this device offers bf16, in words for the header: from the CPU's own flags, or the GPU.

A CPU's bf16 speed depends on its instructions: AMX tiles (bf16 matmuls several times faster
than fp32), AVX512-BF16 (native dot products, no tiles), or neither (bf16 converted in
software). torch reports "AVX512" for the first two alike, so the header reads the flags.
Under ``ISOTRAIN_CPU_KIND`` the words are the forced kind's, and say so (NOTE [forcing the CPU
kind] in isotrain.autograd).
"""

from __future__ import annotations

import platform

import torch

from isotrain.autograd import (
    CPU_KIND_ENV,
    cpu_flags,
    cpu_model,
    forced_cpu_kind,
    native_bf16_matmul,
)

__all__ = ["bf16_native", "cpu_bf16", "device_name", "forced_kind_note"]


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


def forced_kind_note() -> str:
    """The header's words for a kind ISOTRAIN_CPU_KIND forces (empty when none is): `avx2,
    forced by ISOTRAIN_CPU_KIND: this CPU has AVX512-BF16 but no AMX tiles, ATen's kernels AVX2`.
    """
    kind = forced_cpu_kind()
    if kind is None:
        return ""
    own = cpu_bf16(cpu_flags(forced=False))
    aten = torch.backends.cpu.get_cpu_capability()
    return f"{kind}, forced by {CPU_KIND_ENV}: this CPU {own}, ATen's kernels {aten}"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's `model name` (with the forced kind, if one is)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    kind = forced_cpu_kind()
    name = cpu_model() or platform.machine()
    return name if kind is None else f"{name} as {kind} ({CPU_KIND_ENV})"


def bf16_native(device: torch.device) -> tuple[bool, str]:
    """Whether bf16 is worth timing on `device` (False: fp32 without a probe), and why."""
    if device.type == "cuda":
        has = torch.cuda.is_bf16_supported()
        return has, f"{device_name(device)} {'has' if has else 'has no'} bf16"
    if device.type != "cpu":
        return False, f"bf16 is not probed on {device.type}"
    kind = forced_cpu_kind()
    words = f"this CPU {cpu_bf16(cpu_flags())}" + (f" ({CPU_KIND_ENV}={kind})" if kind else "")
    if native_bf16_matmul():
        return True, words
    return False, f"{words}: bf16 is emulated (AVX2), so fp32 is faster"
