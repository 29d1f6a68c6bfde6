"""Run every benchmark in benchmarks/ and collect their tables into results/summary.md.

Each benchmark runs as its own subprocess with its own flags (`--quick` is passed to all), one
after another (the machine is shared: never two at once). Then every results/*.md table is
gathered into summary.md with the command that made it and the machine it ran on, and
summary.json records what ran, how long it took and whether it failed.

    make bench                                   # = python benchmarks/run_all.py (~20 minutes)
    python benchmarks/run_all.py --quick         # seconds per benchmark; results in a temp dir
    python benchmarks/run_all.py --only trainer,overhead
    python benchmarks/run_all.py --collect-only  # rebuild summary.md from the existing files

With `--quick` (or `--out DIR`) the scripts run from a staged copy whose results/ points at the
output directory, so committed results are never overwritten by a smoke run. gpu_suite.py runs
when CUDA is available; otherwise `--quick` runs its CPU `--dry-run`, and a full run skips it.
This module imports no torch, so the collection logic is cheap to test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


@dataclass(frozen=True)
class Bench:
    """One benchmark script and the flags it takes."""

    name: str
    script: str
    flags: tuple[str, ...] = ()  # "{out}" becomes the results directory
    quick_flags: tuple[str, ...] = ("--quick",)
    cuda_only: bool = False


KNOWN = (
    Bench("autograd", "bench_autograd.py"),
    Bench("checkpointing", "bench_checkpointing.py", ("--out", "{out}")),
    Bench("compile", "bench_compile.py"),
    Bench("contexts", "bench_contexts.py"),
    Bench("guard", "bench_guard.py"),
    Bench("trainer", "bench_trainer.py", ("--out", "{out}")),
    Bench("overhead", "bench_overhead.py", ("--out", "{out}")),
    Bench("mfu", "bench_mfu.py", ("--out", "{out}")),
    Bench("gpu", "gpu_suite.py", ("--out", "{out}"), ("--dry-run",), cuda_only=True),
)


def discover(root: Path = HERE) -> tuple[Bench, ...]:
    """The known benchmarks, then any other bench_*.py in `root` (plain flags, --quick)."""
    known = {b.script for b in KNOWN}
    extra = [
        Bench(p.stem.removeprefix("bench_"), p.name)
        for p in sorted(root.glob("bench_*.py"))
        if p.name not in known
    ]
    return KNOWN + tuple(extra)


BENCHES = discover()


@dataclass
class RunRecord:
    name: str
    command: list[str]
    returncode: int | None = None
    seconds: float = 0.0
    skipped: str | None = None
    stderr_tail: str = ""
    outputs: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------ machine
def cpu_model(cpuinfo: str | None = None) -> str:
    """The `model name` of /proc/cpuinfo (or the platform's processor string)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, cores, torch version and load: what every number here depends on."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": package_version("torch"),
        "python": platform.python_version(),
        "lightning": package_version("lightning"),
        "accelerate": package_version("accelerate"),
        "load_avg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
    }


def cuda_available(python: str) -> bool:
    """Ask a subprocess (this module never imports torch)."""
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


# -------------------------------------------------------------------------------- running
def command(b: Bench, *, python: str, scripts: Path, out: Path, quick: bool) -> list[str]:
    flags = [f.replace("{out}", str(out)) for f in b.flags]
    if quick:
        flags += [f for f in b.quick_flags if f not in flags]
    return [python, str(scripts / b.script), *flags]


def stage(out: Path) -> Path:
    """A copy of the scripts whose results/ is `out`, for scripts that write to their own dir."""
    root = Path(tempfile.mkdtemp(prefix="isotrain-bench-stage-"))
    for f in HERE.glob("*.py"):
        shutil.copy2(f, root / f.name)
    (root / "results").symlink_to(out.resolve(), target_is_directory=True)
    return root


def run_one(b: Bench, cmd: list[str], timeout: float) -> RunRecord:
    rec = RunRecord(b.name, cmd)
    print(f"\n=== {b.name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, stdout=sys.stdout, stderr=subprocess.PIPE, text=True, timeout=timeout
        )
        rec.returncode = proc.returncode
        rec.stderr_tail = proc.stderr[-2000:]
        if proc.returncode:
            print(proc.stderr[-4000:], file=sys.stderr)
    except subprocess.TimeoutExpired:
        rec.returncode, rec.stderr_tail = -1, f"timed out after {timeout:.0f} s"
    rec.seconds = time.perf_counter() - t0
    print(f"=== {b.name}: exit {rec.returncode} in {rec.seconds:.0f} s", flush=True)
    return rec


# ----------------------------------------------------------------------------- collecting
_COMMAND = re.compile(r"`([^`]*(?:python|\.py)[^`]*)`")


def tables(md: str) -> list[str]:
    """Every markdown table in `md` (consecutive lines starting with '|'), in order."""
    out, cur = [], []
    for line in md.splitlines():
        if line.lstrip().startswith("|"):
            cur.append(line.strip())
        elif cur:
            out.append("\n".join(cur))
            cur = []
    if cur:
        out.append("\n".join(cur))
    return out


def _meta(json_path: Path) -> dict[str, Any]:
    """The run facts a results JSON records (under "meta" or "env"; scripts differ)."""
    try:
        data = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    meta: dict[str, Any] = {k: data[k] for k in ("command",) if isinstance(data.get(k), str)}
    for key in ("env", "meta"):
        if isinstance(data.get(key), dict):
            meta.update(data[key])
    return meta


def describe(md_path: Path) -> dict[str, Any]:
    """Title, command, machine and tables of one results file (its JSON's `meta` fills gaps)."""
    text = md_path.read_text()
    meta = _meta(md_path.with_suffix(".json"))
    title = next(
        (ln.lstrip("# ").strip() for ln in text.splitlines() if ln.startswith("#")), md_path.stem
    )
    cmd = meta.get("command")
    if not cmd:
        m = _COMMAND.search(text)
        cmd = m.group(1) if m else None
    machine = next(
        (
            ln.split(":", 1)[1].strip().rstrip()
            for ln in text.splitlines()
            if ln.startswith("Machine:")
        ),
        None,
    )
    if machine is None and meta:
        keys = (
            "cpu",
            "gpu",
            "device",
            "cores",
            "cpus",
            "threads",
            "torch",
            "load_before",
            "load_after",
            "load_avg",
            "loadavg",
        )
        machine = ", ".join(f"{k} {meta[k]}" for k in keys if k in meta) or None
    return {
        "stem": md_path.stem,
        "title": title,
        "command": cmd,
        "machine": machine,
        "tables": tables(text),
        "mtime": md_path.stat().st_mtime,
    }


def summary_markdown(
    out: Path,
    machine: dict[str, Any],
    runs: list[RunRecord],
    *,
    invocation: str,
    started: float | None = None,
) -> str:
    """summary.md: the machine, what ran, then every results/*.md table with its command."""
    loads = machine.get("load_avg_1m_5m_15m")
    lines = [
        "# Benchmark summary",
        "",
        f"Made by `{invocation}` on {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}.  ",
        f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, "
        f"Python {machine['python']}"
        + (f", load average {loads[0]} / {loads[1]} / {loads[2]} (1/5/15 min)" if loads else ""),
        "",
    ]
    if runs:
        lines += ["| benchmark | exit | seconds | note |", "|---|---|---|---|"]
        for r in runs:
            note = r.skipped or (r.stderr_tail.strip().splitlines() or [""])[-1][:120]
            code = "skipped" if r.skipped else str(r.returncode)
            note = note.replace("|", "/") if (r.skipped or r.returncode) else ""
            lines.append(f"| {r.name} | {code} | {r.seconds:.0f} | {note} |")
        lines.append("")
    for md in sorted(p for p in out.glob("*.md") if p.stem != "summary"):
        d = describe(md)
        fresh = started is not None and d["mtime"] >= started
        stale = started is not None and not fresh
        lines += [f"## {d['title']}", ""]
        note = " (not rerun by this command)" if stale else ""
        lines.append(f"From `{md.name}`{note}.  ")
        lines.append(f"Command: `{d['command']}`  " if d["command"] else "Command: not recorded  ")
        recorded = d["machine"]
        if fresh and (recorded is None or machine["cpu"] not in recorded):
            here = f"{machine['cpu']}, {machine['cores']} cores"
            recorded = here if recorded is None else f"{here}; {recorded}"
        lines.append(f"Machine: {recorded or 'not recorded (see the file)'}")
        lines.append("")
        for t in d["tables"]:
            lines += [t, ""]
    return "\n".join(lines)


def summary_plot(out: Path, path: Path) -> bool:
    """Throughput ratios (trainer) and per-step overheads (overhead), where those files exist."""
    panels = []
    for stem, key, label in (
        ("trainer", "ratio", "tokens/s vs plain (paired)"),
        ("overhead", "overhead_ms", "ms/step over plain"),
    ):
        with contextlib.suppress(OSError, ValueError, KeyError):
            data = json.loads((out / f"{stem}.json").read_text())["variants"]
            rows = {n: v[key] for n, v in data.items() if v.get(key)}
            if rows:
                panels.append((label, rows))
    if not panels:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.2), squeeze=False)
    for ax, (label, rows) in zip(axes[0], panels):
        names = list(rows)
        med = [rows[n]["median"] for n in names]
        err = [
            [m - rows[n]["q1"] for n, m in zip(names, med)],
            [rows[n]["q3"] - m for n, m in zip(names, med)],
        ]
        ax.bar(names, med, yerr=err, capsize=4, color="#5a8")
        ax.axhline(1.0 if "vs" in label else 0.0, color="grey", lw=0.8, ls="--")
        ax.set_title(label + " (median, IQR)", fontsize=9)
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_summary(
    out: Path, runs: list[RunRecord], *, invocation: str, started: float | None = None
) -> Path:
    machine = machine_info()
    md = summary_markdown(out, machine, runs, invocation=invocation, started=started)
    (out / "summary.md").write_text(md + "\n")
    payload = {
        "invocation": invocation,
        "machine": machine,
        "runs": [asdict(r) for r in runs],
        "files": sorted(p.name for p in out.glob("*.md") if p.stem != "summary"),
    }
    (out / "summary.json").write_text(json.dumps(payload, indent=2) + "\n")
    summary_plot(out, out / "summary.png")
    return out / "summary.md"


# ------------------------------------------------------------------------------------ main
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    ap.add_argument(
        "--only", default="", help="comma-separated names: " + ",".join(b.name for b in BENCHES)
    )
    ap.add_argument("--skip", default="", help="comma-separated names to leave out")
    ap.add_argument("--out", type=Path, default=None, help="default: results/ (quick: temp dir)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per benchmark")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--collect-only", action="store_true", help="only rebuild summary.md")
    return ap.parse_args(argv)


def selected(args: argparse.Namespace) -> list[Bench]:
    names = {b.name for b in BENCHES}
    only = [n for n in args.only.split(",") if n]
    skip = [n for n in args.skip.split(",") if n]
    bad = [n for n in only + skip if n not in names]
    if bad:
        raise SystemExit(f"unknown benchmark(s) {bad}: choose from {', '.join(sorted(names))}")
    return [b for b in BENCHES if (not only or b.name in only) and b.name not in skip]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    flags = sys.argv[1:] if argv is None else argv
    invocation = " ".join(["python benchmarks/run_all.py", *flags])
    quick_tmp = Path(tempfile.gettempdir()) / "isotrain-bench-quick"
    out = (args.out or (quick_tmp if args.quick else RESULTS)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: list[RunRecord] = []
    started = time.time()
    if not args.collect_only:
        scripts = HERE if out == RESULTS.resolve() else stage(out)
        has_cuda = cuda_available(args.python)
        for b in selected(args):
            cmd = command(b, python=args.python, scripts=scripts, out=out, quick=args.quick)
            if b.cuda_only and has_cuda:  # the real suite: no --dry-run, --quick if asked
                cmd = [c for c in cmd if c != "--dry-run"] + (["--quick"] if args.quick else [])
            elif b.cuda_only and not args.quick:
                runs.append(
                    RunRecord(
                        b.name, cmd, skipped="no CUDA device (run gpu_suite.py on a GPU machine)"
                    )
                )
                continue
            runs.append(run_one(b, cmd, args.timeout))
        if scripts != HERE:
            shutil.rmtree(scripts, ignore_errors=True)  # the copies; results/ is only a link
    path = write_summary(
        out, runs, invocation=invocation, started=None if args.collect_only else started
    )
    print(f"\nwrote {path}")
    failed = [r.name for r in runs if r.returncode not in (0, None)]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
