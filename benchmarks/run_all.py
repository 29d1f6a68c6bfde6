"""Run every benchmark in benchmarks/ and collect their tables into results/<cpu-kind>/summary.md.

Each benchmark runs as its own subprocess (one after another: never two at once), with
`--out results/<cpu-kind>/`, so results from different kinds of CPU (cpu_kind.py: "avx2",
"avx512-bf16", "amx") sit side by side and a run never overwrites another kind's. Then every
table of that directory is gathered into summary.md with the command that made it and the
machine it ran on, machine.json records the machine, and summary.json records what ran, how
long it took and whether it failed (a benchmark whose correctness checks fail exits with 1).

    python benchmarks/run_all.py                 # the whole suite (~1-2 hours on 2 cores)
    python benchmarks/run_all.py --quick         # seconds per benchmark, into a temp dir
    python benchmarks/run_all.py --only trainer,overhead
    python benchmarks/run_all.py --collect-only --out benchmarks/results/avx2   # re-summarise

`--quick` writes to a temporary directory, never into results/. gpu_suite.py runs when CUDA is
available (into results/cuda-<gpu>/); otherwise `--quick` runs its CPU `--dry-run` and a full
run skips it. `--same-process` runs the scripts in this interpreter (one torch import for all:
the test suite's smoke run). This module imports no torch, so the collection logic is cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import platform
import re
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # cpu_kind, figures (no torch)
from cpu_kind import describe  # noqa: E402
from figures import dot_plot, pyplot  # noqa: E402

RESULTS = HERE / "results"
EARLIER_REFERENCE = "`plain` of that run (a nanoGPT-style loop)"  # as in loops.py (no torch here)
QUICK_ROOT = Path(tempfile.gettempdir()) / "isotrain-bench-quick"


@dataclass(frozen=True)
class Bench:
    """One benchmark script and the flags it takes."""

    name: str
    script: str
    quick_flags: tuple[str, ...] = ("--quick",)
    cuda_only: bool = False


KNOWN = (
    Bench("autograd", "bench_autograd.py"),
    Bench("checkpointing", "bench_checkpointing.py"),
    Bench("compile", "bench_compile.py"),
    Bench("contexts", "bench_contexts.py"),
    Bench("doctor", "bench_doctor.py"),
    Bench("monitor", "bench_monitor.py"),
    Bench("guard", "bench_guard.py"),
    Bench("qat", "bench_qat.py"),
    Bench("trainer", "bench_trainer.py"),
    Bench("overhead", "bench_overhead.py"),
    Bench("mfu", "bench_mfu.py"),
    Bench("profile", "bench_profile.py"),
    Bench("integrations", "bench_integrations.py"),
    Bench("gpu", "gpu_suite.py", ("--dry-run",), cuda_only=True),
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
def package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """CPU model, kind and bf16 capability, cores, versions and load: what the numbers need."""
    return {
        **describe(),
        "cores": os.cpu_count(),
        "torch": package_version("torch"),
        "python": platform.python_version(),
        "lightning": package_version("lightning"),
        "accelerate": package_version("accelerate"),
        "load_avg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
    }


def machine_line(m: dict[str, Any]) -> str:
    return (
        f"{m.get('cpu', '?')} [{m.get('cpu_kind', '?')}: {m.get('bf16', '?')}], "
        f"{m.get('cores', '?')} cores, torch {m.get('torch', '?')}, Python {m.get('python', '?')}"
    )


def cuda_available(python: str) -> bool:
    """Ask a subprocess (this module never imports torch)."""
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([python, "-c", code], capture_output=True).returncode == 0


# -------------------------------------------------------------------------------- running
def command(b: Bench, *, python: str, out: Path | None, quick: bool) -> list[str]:
    """The command line of one benchmark (`out` None: the script's own default)."""
    flags = ["--out", str(out)] if out is not None else []
    if quick:
        flags += list(b.quick_flags)
    return [python, str(HERE / b.script), *flags]


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


def run_here(b: Bench, cmd: list[str]) -> RunRecord:
    """Run one script in this interpreter (as __main__, with its argv); record how it ended."""
    from common import IN_PROCESS  # imports torch, which the scripts run here need anyway

    rec = RunRecord(b.name, cmd)
    argv, err = sys.argv, io.StringIO()
    t0 = time.perf_counter()
    sys.argv = cmd[1:]
    os.environ[IN_PROCESS] = "1"
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_path(cmd[1], run_name="__main__")
        rec.returncode = 0
    except SystemExit as e:
        rec.returncode = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        rec.returncode = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv = argv
        del os.environ[IN_PROCESS]
    rec.seconds, rec.stderr_tail = time.perf_counter() - t0, err.getvalue()[-2000:]
    print(f"=== {b.name}: exit {rec.returncode} in {rec.seconds:.1f} s", flush=True)
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


def describe_file(md_path: Path) -> dict[str, Any]:
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
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Machine:")),
        None,
    )
    if machine is None and meta:
        keys = ("cpu", "gpu", "device", "cores", "cpus", "threads", "torch", "load_before")
        machine = ", ".join(f"{k} {meta[k]}" for k in keys if k in meta) or None
    return {
        "stem": md_path.stem,
        "title": title,
        "command": cmd,
        "machine": machine,
        "tables": tables(text),
        "mtime": md_path.stat().st_mtime,
    }


def load_machine(out: Path) -> dict[str, Any] | None:
    """The machine a results directory was measured on (its machine.json), if recorded."""
    with contextlib.suppress(OSError, ValueError):
        data = json.loads((out / "machine.json").read_text())
        return data if isinstance(data, dict) else None
    return None


def result_files(out: Path) -> list[Path]:
    return sorted(p for p in out.glob("*.md") if p.stem not in ("summary", "README"))


def summary_markdown(
    out: Path, runs: list[RunRecord], *, invocation: str, started: float | None = None
) -> str:
    """summary.md: the machine, what ran, then every table of `out` with its command."""
    m = load_machine(out)
    lines = [
        f"# Benchmark summary: {out.name}",
        "",
        f"Made by `{invocation}` on {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}.  ",
        f"Machine: {machine_line(m) if m else 'not recorded (see each file)'}",
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
    for md in result_files(out):
        d = describe_file(md)
        stale = started is not None and d["mtime"] < started
        lines += [f"## {d['title']}", ""]
        lines.append(f"From `{md.name}`{' (not rerun by this command)' if stale else ''}.  ")
        lines.append(f"Command: `{d['command']}`  " if d["command"] else "Command: not recorded  ")
        lines += [f"Machine: {d['machine'] or 'not recorded (see the file)'}", ""]
        for t in d["tables"]:
            lines += [t, ""]
    return "\n".join(lines)


def summary_plot(out: Path, path: Path) -> bool:
    """Paired throughput ratios (trainer) and per-step overheads (overhead), with 95% CIs."""
    panels = []
    for stem, key, ref, label in (
        ("trainer", "ratio", 1.0, "tokens/s relative to {}"),
        ("overhead", "overhead_ms", 0.0, "extra ms per step vs {}"),
    ):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            data = json.loads((out / f"{stem}.json").read_text())
            base = data.get("reference", EARLIER_REFERENCE)
            rows = {n: v[key] for n, v in data["variants"].items() if isinstance(v.get(key), dict)}
            if rows:
                panels.append((label.format(base), ref, rows))
    plt = pyplot() if panels else None
    if plt is None:
        return False
    height = max(len(rows) for _, _, rows in panels) * 0.7 + 1.4
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), height), squeeze=False)
    for ax, (label, ref, rows) in zip(axes[0], panels):
        dot_plot(ax, rows, ref=ref, xlabel=label)
        ax.set_title(f"{label}\nmedian and 95% CI of paired rounds", fontsize=9)
    fig.suptitle(f"results/{out.name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_summary(
    out: Path, runs: list[RunRecord], *, invocation: str, started: float | None = None
) -> Path:
    md = summary_markdown(out, runs, invocation=invocation, started=started)
    (out / "summary.md").write_text(md + "\n")
    payload = {
        "invocation": invocation,
        "machine": load_machine(out),
        "runs": [asdict(r) for r in runs],
        "files": [p.name for p in result_files(out)],
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
    ap.add_argument(
        "--out", type=Path, default=None, help="default: results/<cpu-kind> (quick: temp dir)"
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--collect-only", action="store_true", help="only rebuild summary.md")
    ap.add_argument("--same-process", action="store_true", help="run scripts in this process")
    return ap.parse_args(argv)


def selected(args: argparse.Namespace) -> list[Bench]:
    names = {b.name for b in BENCHES}
    only = [n for n in args.only.split(",") if n]
    skip = [n for n in args.skip.split(",") if n]
    bad = [n for n in only + skip if n not in names]
    if bad:
        raise SystemExit(f"unknown benchmark(s) {bad}: choose from {', '.join(sorted(names))}")
    return [b for b in BENCHES if (not only or b.name in only) and b.name not in skip]


def run_selected(args: argparse.Namespace, out: Path) -> list[RunRecord]:
    runs: list[RunRecord] = []
    has_cuda = not args.quick and cuda_available(args.python)
    for b in selected(args):
        cmd = command(b, python=args.python, out=out, quick=args.quick)
        if b.cuda_only and has_cuda:  # the real GPU suite: its own results/cuda-<gpu>/
            cmd = command(b, python=args.python, out=args.out, quick=False)
        elif b.cuda_only and not args.quick:
            runs.append(RunRecord(b.name, cmd, skipped="no CUDA device (run it on a GPU machine)"))
            continue
        runs.append(run_here(b, cmd) if args.same_process else run_one(b, cmd, args.timeout))
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    flags = sys.argv[1:] if argv is None else argv
    invocation = " ".join(["python benchmarks/run_all.py", *flags])
    kind = describe()["cpu_kind"]
    out = (args.out or (QUICK_ROOT if args.quick else RESULTS) / kind).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs: list[RunRecord] = []
    started = time.time()
    if not args.collect_only:
        (out / "machine.json").write_text(json.dumps(machine_info(), indent=2) + "\n")
        runs = run_selected(args, out)
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
