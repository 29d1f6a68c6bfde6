"""What every benchmark script shares: where results go, the machine, the files, the checks.

Results of a full run go to benchmarks/results/<cpu-kind>/ (see cpu_kind.py), so runs on
different kinds of CPU sit side by side; a `--quick` run goes to a temporary directory and
never touches results/. Each script writes <stem>.md and <stem>.json (and a PNG where a picture
helps) with the command, the machine (CPU model, kind, bf16 capability, threads, versions, load)
and its correctness checks; a failed check makes the script exit with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from cpu_kind import cpu_kind, describe

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
QUICK_ROOT = Path(tempfile.gettempdir()) / "isotrain-bench-quick"


def default_out(*, quick: bool) -> Path:
    """results/<cpu-kind>/ for a full run, a temporary directory for a quick one."""
    return (QUICK_ROOT if quick else RESULTS) / cpu_kind()


def add_common_args(p: argparse.ArgumentParser, *, threads: int | None = 1) -> None:
    """--quick, --out and (unless `threads` is None) --threads, the same in every script."""
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (temp dir)")
    p.add_argument(
        "--out", type=Path, default=None, help="results directory (default: results/<cpu-kind>)"
    )
    if threads is not None:
        p.add_argument(
            "--threads", type=int, default=threads, help="torch threads (1: a shared machine)"
        )


def out_dir(args: argparse.Namespace) -> Path:
    out = args.out or default_out(quick=args.quick)
    out.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Set torch's intra-op thread count for the block, then put the old count back."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# NOTE [steady malloc]: glibc returns a freed multi-MiB block to the kernel and maps fresh,
# zeroed pages for the next one, so a benchmark that frees large tensors every round also times
# page faults, whose number varies from round to round (bench_autograd's eager intervals stayed
# at +-5% after 200 rounds). Keeping freed memory in the heap, as a long training run's steady
# state does, times the kernels: the same run then met +-2% after 130 rounds.
STEADY_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),  # glibc's largest: blocks to 32 MiB stay in the heap
    "MALLOC_TRIM_THRESHOLD_": str(2**30),  # never hand the heap's free top back to the kernel
    "MALLOC_TOP_PAD_": str(256 * 2**20),  # grow the heap in large steps
}
IN_PROCESS = "ISOTRAIN_BENCH_IN_PROCESS"  # set by run_all.py --same-process: never re-exec


def _steady() -> bool:
    return all(os.environ.get(k) == v for k, v in STEADY_MALLOC.items())


def steady_malloc() -> None:
    """Re-run this script once under STEADY_MALLOC (Linux), unless run_all runs it in-process."""
    if sys.platform == "linux" and not os.environ.get(IN_PROCESS) and not _steady():
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **STEADY_MALLOC})


def allocator() -> str:
    """How this process's malloc treats freed memory, as the result files state it."""
    return "malloc keeps freed memory (NOTE [steady malloc])" if _steady() else "malloc defaults"


def clock(name: str) -> Callable[[], float]:
    """ "cpu": this process's CPU time (one thread on a shared machine); "wall": perf_counter."""
    return time.process_time if name == "cpu" else time.perf_counter


CLOCKS = {
    "cpu": "process CPU time (time.process_time): with one torch thread it equals wall time on an "
    "idle machine, and it leaves out the time a busy machine kept the process waiting",
    "wall": "wall time (time.perf_counter, after a device synchronize)",
}


def default_clock(device: str, threads: int) -> str:
    """CPU time on a CPU device with one thread (robust to a busy machine), else wall time."""
    return "cpu" if torch.device(device).type == "cpu" and threads == 1 else "wall"


# ---------------------------------------------------------------------------------- machine
def machine(device: torch.device | str = "cpu") -> dict[str, Any]:
    """What the numbers depend on: CPU model and kind, bf16 capability, threads, versions, load."""
    dev = torch.device(device)
    info: dict[str, Any] = {
        **describe(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "allocator": allocator(),
    }
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    for lib in ("lightning", "accelerate"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            info[lib] = version(lib)
    return info


def machine_line(meta: dict[str, Any]) -> str:
    """One line naming the machine: model, kind and bf16 capability, cores, threads, versions."""
    dev = f"GPU {meta['gpu']}, " if "gpu" in meta else ""
    libs = "".join(f", {k} {meta[k]}" for k in ("lightning", "accelerate") if k in meta)
    load = ""
    if "load_before" in meta:
        load = f"; load average {meta['load_before']} -> {meta.get('load_after')} (1 min)"
    kind = meta.get("cpu_kind", "?")
    return (
        f"{dev}{meta['cpu']} [{kind}: {meta.get('bf16', 'bf16 capability not recorded')}; torch "
        f"kernels {meta.get('torch_cpu_capability', '?')}], {meta['cores']} cores, "
        f"{meta['threads']} torch thread(s), torch {meta['torch']}{libs}"
        f"; {meta.get('allocator', 'malloc not recorded')}{load}"
    )


def run_meta(
    script: str, argv: list[str] | None, load_before: float, device: str = "cpu"
) -> dict[str, Any]:
    """The `meta` block of a result: machine, load before and after, the command."""
    meta = machine(device)
    meta.update(
        load_before=round(load_before, 2),
        load_after=meta.pop("load_avg_1m"),
        command=command_line(script, argv),
    )
    return meta


def command_line(script: str, argv: list[str] | None) -> str:
    flags = sys.argv[1:] if argv is None else argv
    return " ".join([f"python benchmarks/{script}", *flags])


# ---------------------------------------------------------------------------------- checks
def check(ok: bool, detail: str) -> dict[str, Any]:
    """One correctness check of a benchmark (equal losses, zero skips, ...)."""
    return {"ok": bool(ok), "detail": detail}


def checks_md(checks: dict[str, dict[str, Any]]) -> list[str]:
    """The checks as markdown lines, for the end of a result file."""
    if not checks:
        return []
    lines = ["Checks:", ""]
    for name, c in checks.items():
        lines.append(f"- {name}: {'passed' if c['ok'] else 'FAILED'} ({c['detail']})")
    return [*lines, ""]


def write_results(out: Path, stem: str, payload: dict[str, Any], md: str) -> int:
    """Write <stem>.json and <stem>.md; return 1 if a check in payload["checks"] failed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (out / f"{stem}.md").write_text(md if md.endswith("\n") else md + "\n")
    print(md)
    print(f"wrote {out / stem}.{{md,json}}")
    failed = [n for n, c in payload.get("checks", {}).items() if not c["ok"]]
    if failed:
        print(f"FAILED checks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
