"""benchmarks/run_all.py: the collection logic on fake result files (no benchmark runs here)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

RUN_ALL = Path(__file__).resolve().parents[1] / "benchmarks" / "run_all.py"


@pytest.fixture(scope="module")
def run_all():
    spec = importlib.util.spec_from_file_location("isotrain_bench_run_all", RUN_ALL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


TABLE_A = "| a | b |\n|---|---|\n| 1 | 2 |"
TABLE_B = "| variant | ms |\n|---|---|\n| plain | 3.0 |"


def _fake_results(d: Path) -> None:
    (d / "alpha.md").write_text(
        "# Alpha bench\n\nCommand: `python benchmarks/bench_alpha.py --rounds 3`  \n"
        f"Machine: Fake CPU 9000, 2 cores\n\n{TABLE_A}\n\ntext after\n\n{TABLE_B}\n"
    )
    (d / "beta.md").write_text(f"# Beta\n\nNo command line in this file.\n\n{TABLE_B}\n")
    meta = {"command": "python benchmarks/bench_beta.py --quick", "torch": "9.9", "threads": 1}
    (d / "beta.json").write_text(json.dumps({"meta": meta, "rows": []}))
    (d / "summary.md").write_text("# old summary\n\n| stale | table |\n")


def test_tables_splits_every_markdown_table(run_all) -> None:
    md = f"# t\n\n{TABLE_A}\nprose\n{TABLE_B}"
    assert run_all.tables(md) == [TABLE_A, TABLE_B]
    assert run_all.tables("no tables here") == []


def test_cpu_model_reads_proc_cpuinfo_format(run_all) -> None:
    info = "processor\t: 0\nmodel name\t: AMD EPYC 7B13 64-Core Processor\nflags\t: avx2\n"
    assert run_all.cpu_model(info) == "AMD EPYC 7B13 64-Core Processor"


def test_summary_collects_tables_commands_and_machine(run_all, tmp_path: Path) -> None:
    _fake_results(tmp_path)
    rec = run_all.RunRecord("alpha", ["python", "bench_alpha.py"], returncode=0, seconds=1.5)
    bad = run_all.RunRecord(
        "beta",
        ["python", "bench_beta.py"],
        returncode=3,
        seconds=0.5,
        stderr_tail="Traceback\nValueError: boom",
    )
    path = run_all.write_summary(tmp_path, [rec, bad], invocation="python benchmarks/run_all.py")
    text = path.read_text()
    machine = run_all.machine_info()
    assert f"Machine: {machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}" in text
    assert text.count(TABLE_A) == 1 and text.count(TABLE_B) == 2  # alpha's second table too
    assert "Command: `python benchmarks/bench_alpha.py --rounds 3`" in text
    assert "Command: `python benchmarks/bench_beta.py --quick`" in text  # from beta.json's meta
    assert "Machine: Fake CPU 9000, 2 cores" in text
    assert "| beta | 3 | 0 | ValueError: boom |" in text  # a failure names its last error line
    assert "| stale | table |" not in text  # the previous summary is not collected
    payload = json.loads((tmp_path / "summary.json").read_text())
    assert payload["files"] == ["alpha.md", "beta.md"]
    assert [r["returncode"] for r in payload["runs"]] == [0, 3]


def test_summary_marks_files_this_run_did_not_make(run_all, tmp_path: Path) -> None:
    _fake_results(tmp_path)
    os.utime(tmp_path / "beta.md", (1_000_000, 1_000_000))  # made long before the run started
    text = run_all.summary_markdown(
        tmp_path, run_all.machine_info(), [], invocation="x", started=2_000_000
    )
    assert "From `beta.md` (not rerun by this command)." in text
    assert "From `alpha.md`." in text


def test_quick_passes_quick_everywhere_and_gpu_dry_run(run_all, tmp_path: Path) -> None:
    scripts = Path("/s")
    cmds = {
        b.name: run_all.command(b, python="py", scripts=scripts, out=tmp_path, quick=True)
        for b in run_all.BENCHES
    }
    assert cmds["trainer"] == ["py", "/s/bench_trainer.py", "--out", str(tmp_path), "--quick"]
    assert cmds["gpu"][-1] == "--dry-run" and "--quick" not in cmds["gpu"]
    assert all(c[-1] == "--quick" for n, c in cmds.items() if n != "gpu")
    full = run_all.command(
        run_all.BENCHES[0], python="py", scripts=scripts, out=tmp_path, quick=False
    )
    assert "--quick" not in full


def test_selection_rejects_unknown_names(run_all) -> None:
    args = run_all.parse(["--only", "trainer,overhead", "--skip", "overhead"])
    assert [b.name for b in run_all.selected(args)] == ["trainer"]
    with pytest.raises(SystemExit, match=r"unknown benchmark\(s\) \['nope'\]"):
        run_all.selected(run_all.parse(["--only", "nope"]))


def test_discover_adds_unknown_bench_scripts(run_all, tmp_path: Path) -> None:
    (tmp_path / "bench_newthing.py").write_text("")
    (tmp_path / "bench_trainer.py").write_text("")  # known: keeps its own flags
    (tmp_path / "helper.py").write_text("")  # not a benchmark
    benches = run_all.discover(tmp_path)
    assert benches[: len(run_all.KNOWN)] == run_all.KNOWN
    assert [(b.name, b.script) for b in benches[len(run_all.KNOWN) :]] == [
        ("newthing", "bench_newthing.py")
    ]
