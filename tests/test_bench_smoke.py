"""The benchmarks: every script's --quick run (one subprocess for all), its output table and its
correctness checks; the statistics, the CPU-kind detector and run_all's collection logic."""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
HELPERS = ("cpu_kind", "stats", "figures", "run_all")  # what run_all imports (no torch)


@pytest.fixture(scope="module")
def bench() -> Iterator[dict[str, ModuleType]]:
    """benchmarks/ helper modules, imported from their directory and forgotten afterwards."""
    sys.path.insert(0, str(BENCH))
    try:
        yield {name: importlib.import_module(name) for name in ("cpu_kind", "stats", "run_all")}
    finally:
        sys.path.remove(str(BENCH))
        for name in HELPERS:
            sys.modules.pop(name, None)


# ------------------------------------------------------------------------------ cpu kind
AMD = "processor\t: 0\nmodel name\t: AMD EPYC 7B13 64-Core Processor\nflags\t\t: fpu sse avx avx2\n"
XEON = "model name\t: Intel(R) Xeon(R)\ncpu family\t: 6\nmodel\t\t: 207\nflags\t: avx2 avx512f {}\n"


def test_cpu_kind_from_flags(bench) -> None:
    ck = bench["cpu_kind"]
    assert ck.cpu_kind(AMD) == "avx2"
    assert ck.cpu_kind(XEON.format("avx512_bf16")) == "avx512-bf16"
    assert ck.cpu_kind(XEON.format("avx512_bf16 amx_bf16 amx_tile")) == "amx"
    assert ck.cpu_kind("flags\t: sse sse2\n") not in ("avx2", "avx512-bf16", "amx")
    d = ck.describe(XEON.format("avx512_bf16"))
    assert d["cpu"] == "Intel(R) Xeon(R)" and d["cpu_id"] == "family 6 model 207"
    assert d["bf16"].startswith("AVX512-BF16, no AMX")
    assert ck.cpu_model(AMD) == "AMD EPYC 7B13 64-Core Processor"


# ---------------------------------------------------------------------------------- stats
def _coverage(n: int, j: int) -> float:
    """Exact coverage of the order statistics (j, n+1-j) for the median, from math.comb."""
    return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n


@pytest.mark.parametrize("n", [6, 7, 10, 29, 30, 101, 400])
def test_median_ci_is_the_narrowest_95_percent_order_interval(bench, n: int) -> None:
    xs = list(range(n))
    random.Random(n).shuffle(xs)
    lo, hi, cov = bench["stats"].median_ci(xs)
    j = lo + 1  # xs is a permutation of 0..n-1: the value is the rank - 1
    assert hi == n - j  # symmetric ranks
    assert cov == pytest.approx(_coverage(n, j)) and cov >= 0.95
    assert _coverage(n, j + 1) < 0.95  # one rank narrower would not cover 95%


def test_median_ci_below_six_rounds_is_the_range_and_says_so(bench) -> None:
    st = bench["stats"]
    lo, hi, cov = st.median_ci([3.0, 1.0, 2.0])
    assert (lo, hi, cov) == (1.0, 3.0, 0.75)
    assert "(n=3: the range, 75%)" in st.fmt_ci(st.summarize([3.0, 1.0, 2.0]))
    assert "range" not in st.fmt_ci(st.summarize([float(i) for i in range(10)]))


def test_paired_ratios_and_differences_pair_rounds(bench) -> None:
    st = bench["stats"]
    times = {"plain": [1.0, 2.0], "x": [2.0, 2.0]}
    assert st.paired_ratios(times, "plain") == {"x": [0.5, 1.0]}  # speed: base / variant
    assert st.paired_ratios(times, "plain", speed=False) == {"x": [2.0, 1.0]}
    assert st.paired_diffs(times, "plain", scale=1e3) == {"x": [1000.0, 0.0]}


def test_stopper_stops_when_every_interval_is_narrow_or_at_the_limit(bench) -> None:
    st = bench["stats"]
    rng = random.Random(0)
    tight: list[float] = []
    stop = st.Stopper(lambda: {"r": tight}, min_rounds=10, max_rounds=500, check_every=5)
    r = 0
    while not stop(r):
        tight.append(1 + rng.gauss(0, 0.01))  # +-1% noise: narrow after a few checks
        r += 1
    assert r < 100 and stop.record(r)["met"] and "within" in stop.reason
    assert st.half_width(st.summarize(tight)) <= 0.02
    wide: list[float] = []
    stop = st.Stopper(lambda: {"r": wide}, min_rounds=10, max_rounds=40, check_every=5)
    r = 0
    while not stop(r):
        wide.append(1 + rng.gauss(0, 0.5))
        r += 1
    assert r == 40 and not stop.record(r)["met"] and "limit" in stop.reason


# -------------------------------------------------------------------------------- run_all
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
    machine = {"cpu": "Fake CPU 9000", "cpu_kind": "avx2", "bf16": "AVX2 only", "cores": 2}
    (d / "machine.json").write_text(json.dumps(machine))


def test_tables_splits_every_markdown_table(bench) -> None:
    ra = bench["run_all"]
    assert ra.tables(f"# t\n\n{TABLE_A}\nprose\n{TABLE_B}") == [TABLE_A, TABLE_B]
    assert ra.tables("no tables here") == []


def test_summary_names_the_directory_machine_not_this_one(bench, tmp_path: Path) -> None:
    ra = bench["run_all"]
    _fake_results(tmp_path)
    ok = ra.RunRecord("alpha", ["python", "bench_alpha.py"], returncode=0, seconds=1.5)
    bad = ra.RunRecord("beta", ["python", "b.py"], returncode=3, stderr_tail="x\nValueError: boom")
    text = ra.write_summary(tmp_path, [ok, bad], invocation="python benchmarks/run_all.py")
    text = text.read_text()
    assert "Machine: Fake CPU 9000 [avx2: AVX2 only], 2 cores" in text  # from machine.json
    assert text.count(TABLE_A) == 1 and text.count(TABLE_B) == 2  # alpha's second table too
    assert "Command: `python benchmarks/bench_alpha.py --rounds 3`" in text
    assert "Command: `python benchmarks/bench_beta.py --quick`" in text  # from beta.json's meta
    assert "| beta | 3 | 0 | ValueError: boom |" in text  # a failure names its last error line
    assert "| stale | table |" not in text  # the previous summary is not collected
    payload = json.loads((tmp_path / "summary.json").read_text())
    assert payload["files"] == ["alpha.md", "beta.md"]
    assert payload["machine"]["cpu_kind"] == "avx2"
    os.utime(tmp_path / "beta.md", (1_000_000, 1_000_000))  # made long before the run started
    text = ra.summary_markdown(tmp_path, [], invocation="x", started=2_000_000)
    assert "From `beta.md` (not rerun by this command)." in text and "From `alpha.md`." in text


def test_commands_pass_out_and_quick_and_gpu_dry_run(bench, tmp_path: Path) -> None:
    ra = bench["run_all"]
    cmds = {b.name: ra.command(b, python="py", out=tmp_path, quick=True) for b in ra.BENCHES}
    trainer = ["py", str(BENCH / "bench_trainer.py"), "--out", str(tmp_path), "--quick"]
    assert cmds["trainer"] == trainer
    assert cmds["gpu"][-1] == "--dry-run" and "--quick" not in cmds["gpu"]
    assert all(c[-1] == "--quick" and str(tmp_path) in c for n, c in cmds.items() if n != "gpu")
    assert {p.stem.removeprefix("bench_") for p in BENCH.glob("bench_*.py")} <= set(cmds)
    assert "--quick" not in ra.command(ra.BENCHES[0], python="py", out=tmp_path, quick=False)


def test_selection_rejects_unknown_names(bench) -> None:
    ra = bench["run_all"]
    args = ra.parse(["--only", "trainer,overhead", "--skip", "overhead"])
    assert [b.name for b in ra.selected(args)] == ["trainer"]
    with pytest.raises(SystemExit, match=r"unknown benchmark\(s\) \['nope'\]"):
        ra.selected(ra.parse(["--only", "nope"]))


# ------------------------------------------------------------------------ the quick runs
# Every script's table header (the README quotes these tables) and its correctness checks.
EXPECTED = {
    "trainer": (
        "| variant | tokens/s (median) | ms/step | speed vs plain, paired per round [95% CI] "
        "| CI half-width | wall tokens/s |",
        {"equal losses", "no skipped steps"},
    ),
    "overhead": (
        "| variant | ms/step (median) | extra ms/step vs plain, paired [95% CI] | ATen ops/step "
        "| Python calls/step | wall ms/step |",
        {"equal losses", "no skipped steps"},
    ),
    "mfu": (
        "| precision | loop | ms/step [95% CI] | tokens/s | model GFLOP/step | achieved GFLOP/s "
        "| MFU % of the core peak [95% CI] | this dtype's best matmul, GFLOP/s "
        "| speed vs plain, same precision [95% CI] |",
        {
            "equal losses, fp32",
            "equal losses, bf16",
            "equal losses, bf16-matmul",
            "no skipped steps",
        },
    ),
    "profile": (
        "| variant | ms/step (profiled) | matmul | attention | norms & elementwise "
        "| casts & copies | compiled kernels | optimizer | Python & framework |",
        {"no skipped steps", "profile categories"},
    ),
    "guard": (
        "| d_model | params | optimizer | skip mode | plain step ms | guarded step ms "
        "| step time guarded / plain [95% CI] | CI half-width | update ms, plain -> guarded |",
        {"no skipped steps", "equal losses"},
    ),
    "guard_buffers": (
        "| channels | buffer KB | skip mode | off: step ms | default (protected): step ms "
        "| step time protected / off [95% CI] | CI half-width | extra ms per step [95% CI] |",
        {
            "no skipped steps",
            "equal losses",
            "protected by default",
            "a NaN image leaves the statistics",
        },
    ),
    "checkpointing": (
        "| T | policy | ckpt blocks | saved MB | bytes cut | step s | step time x [95% CI] "
        "| FLOPs x |",
        {"same loss and gradients as unwrapped"},
    ),
    "autograd": (
        "| STE | variant | mode | median ms | time vs idiom [95% CI] | CI half-width "
        "| saved (eager) |",
        {"outputs and gradients equal the idiom's"},
    ),
    "compile": (
        "| d_model x layers | params | variant | step ms | speedup [95% CI] | compile s "
        "| first step s | graphs | cache |",
        {"equal losses", "no compile after the bucket warm-up"},
    ),
    "contexts": (
        "| context | isotrain (µs) | % of a tiny step | reference | reference (µs) | ratio |",
        {"state restored"},
    ),
    "integrations": (
        "| framework | variant | ms/step (median) | step time vs plain, paired [95% CI] "
        "| CI half-width | skipped |",
        {"equal weights", "no skipped steps"},
    ),
    "doctor": (
        "| model | checks | cold wall s | wall s (median) | CPU s (median) | target "
        "| findings (error/warning/info) |",
        {"no error or warning", "state restored"},
    ),
    "monitor": (
        "| monitor | checks in the run | ms/step (median) | extra ms/step vs off, paired [95% CI] "
        "| one check, ms (median) | between checks, µs/step | cost per step at this period |",
        {
            "no finding on the sound copies",
            "same losses with and without the monitor",
            "a drift on rank 1 is found at the next check",
        },
    ),
    "qat": (
        "| weights | val loss (nats/byte) | vs fp32 | unigram baseline | wall s |",
        {"finished, finite"},
    ),
    "vs_nanogpt": (
        "|  | nanoGPT train.py | isotrain train | isotrain / nanoGPT [95% CI] |",
        {"finished every step", "same recipe", "one evaluator agrees with each run's own"},
    ),
}


def _snapshot(d: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in d.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """`run_all.py --quick --same-process` once: every script in one interpreter, a temp dir."""
    out = tmp_path_factory.mktemp("bench-quick")
    before = _snapshot(BENCH / "results")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MPLBACKEND": "Agg"}
    cmd = [sys.executable, str(BENCH / "run_all.py"), "--quick", "--same-process", "--out"]
    proc = subprocess.run([*cmd, str(out)], capture_output=True, text=True, env=env, timeout=400)
    summary = json.loads((out / "summary.json").read_text())
    return {
        "out": out,
        "proc": proc,
        "runs": {r["name"]: r for r in summary["runs"]},
        "results_untouched": before == _snapshot(BENCH / "results"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_quick_run_writes_its_table_and_passes_its_checks(quick_run, name: str) -> None:
    run = quick_run["runs"][name]
    assert run["returncode"] == 0, run["stderr_tail"]
    out: Path = quick_run["out"]  # type: ignore[assignment]
    header, checks = EXPECTED[name]
    assert header in (out / f"{name}.md").read_text().splitlines()
    result = json.loads((out / f"{name}.json").read_text())
    assert set(result["checks"]) == checks
    assert all(c["ok"] for c in result["checks"].values()), result["checks"]
    meta = result["meta"]
    assert meta["cpu_kind"] and meta["bf16"] and meta["cpu"]  # every file names its machine
    assert meta["allocator"] == "malloc defaults"  # in-process: never re-executed


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="glibc malloc settings")
def test_a_script_run_as_a_program_times_under_steady_malloc(tmp_path: Path) -> None:
    """NOTE [steady malloc]: the script re-runs itself once with the settings and records them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(PYTHONPATH=str(ROOT / "src"), MPLBACKEND="Agg")
    cmd = [sys.executable, str(BENCH / "bench_contexts.py"), "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((tmp_path / "contexts.json").read_text())["meta"]
    assert meta["allocator"] == "malloc keeps freed memory (NOTE [steady malloc])"
    assert "malloc keeps freed memory" in (tmp_path / "contexts.md").read_text()


@pytest.mark.slow
def test_quick_run_compares_against_both_plain_loops(quick_run) -> None:
    out: Path = quick_run["out"]  # type: ignore[assignment]
    trainer = json.loads((out / "trainer.json").read_text())["variants"]
    assert {"plain", "nanogpt", "isotrain"} <= set(trainer)
    assert "ratio" not in trainer["plain"] and "ratio" in trainer["nanogpt"]  # plain: reference
    mfu = json.loads((out / "mfu.json").read_text())
    core = max(r["gflops"] for r in mfu["peaks"] if r["gflops"])
    assert mfu["core_peak"]["gflops"] == core  # the MFU denominator: the best of every dtype
    assert {r["dtype"] for r in mfu["peaks"]} == {"fp32", "bf16", "fp16"}
    assert "Subnormals: flushed to zero in every loop" in (out / "mfu.md").read_text()
    assert {"isotrain bf16-matmul vs fp32", "isotrain bf16 vs fp32"} <= set(mfu["ratios"])


@pytest.mark.slow
def test_quick_run_profiles_three_precisions_and_times_the_ops_one_by_one(quick_run) -> None:
    out: Path = quick_run["out"]  # type: ignore[assignment]
    profile = json.loads((out / "profile.json").read_text())
    assert {"bf16-matmul eager vs fp32 eager", "bf16 eager vs fp32 eager"} <= set(profile["ratios"])
    ops = [r["op"].split(" (")[0] for r in profile["ops"]["rows"]]
    assert ops == [
        "qkv projection", "attention out projection", "MLP fc1", "MLP fc2", "LM head",
        "SDPA causal",
    ]  # fmt: skip
    assert all(r["forward + backward"]["median"] > 0 for r in profile["ops"]["rows"])
    text = (out / "profile.md").read_text()
    assert (
        "| op | bf16 / fp32 time, forward [95% CI] | bf16 / fp32 time, forward + backward" in text
    )


@pytest.mark.slow
def test_quick_run_gpu_dry_run_and_summary(quick_run) -> None:
    assert quick_run["runs"]["gpu"]["returncode"] == 0, quick_run["runs"]["gpu"]["stderr_tail"]
    out: Path = quick_run["out"]  # type: ignore[assignment]
    assert (out / "gpu_mfu_dry_run.md").exists() and (out / "summary.png").exists()
    assert json.loads((out / "machine.json").read_text())["cpu_kind"]
    assert quick_run["results_untouched"]  # a smoke run never writes into benchmarks/results


# ------------------------------------------------------------------- against nanoGPT
@pytest.fixture(scope="module")
def vs_nanogpt() -> Iterator[ModuleType]:
    """benchmarks/bench_vs_nanogpt.py as a module (it imports torch and isotrain)."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("bench_vs_nanogpt")
    finally:
        sys.path.remove(str(BENCH))
        for name in ("bench_vs_nanogpt", "common", *HELPERS):
            sys.modules.pop(name, None)


@pytest.mark.parametrize(("df", "q"), [(1, 12.7062), (2, 4.3027), (4, 2.7764), (30, 2.0423)])
def test_vs_nanogpt_t_quantile_matches_the_table(vs_nanogpt, df: int, q: float) -> None:
    assert vs_nanogpt.t_quantile(0.975, df) == pytest.approx(q, abs=2e-4)


def test_vs_nanogpt_intervals_pair_rounds_and_cover_the_ratio(vs_nanogpt) -> None:
    exact = vs_nanogpt.paired_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 3.0])
    assert exact["ratio"] == pytest.approx(2.0) and exact["lo"] == pytest.approx(exact["hi"])
    noisy = vs_nanogpt.paired_ratio([2.2, 3.6, 6.3], [1.0, 2.0, 3.0])
    assert noisy["lo"] < noisy["ratio"] < noisy["hi"]
    w = vs_nanogpt.welch_ratio([1.62, 1.64, 1.63], [1.60, 1.61, 1.59])
    assert w["ratio"] == pytest.approx(1.63 / 1.60, rel=1e-4)
    assert 1.0 < w["lo"] < w["ratio"] < w["hi"]  # resolved: the seeds' spread is small
    one = vs_nanogpt.welch_ratio([1.62], [1.60])  # --seeds 1 (the quick run): no interval
    assert (one["ratio"], one["lo"], one["hi"]) == (pytest.approx(1.62 / 1.60), 0.0, math.inf)
    assert vs_nanogpt.paired_ratio([2.0], [1.0])["hi"] == math.inf


def test_vs_nanogpt_blocks_leave_out_the_first(vs_nanogpt) -> None:
    assert vs_nanogpt.blocks([100.0, 1, 1, 2, 2, 3, 3], 2) == [1.5, 2.5, 3.0]


def test_vs_nanogpt_loads_nanogpt_names_and_layouts(vs_nanogpt) -> None:
    """nanoGPT's tensors are nn.Linear (out, in), named transformer.h.i.attn.c_attn, ..."""
    import torch

    recipe = vs_nanogpt.QUICK
    torch.manual_seed(0)
    ours = vs_nanogpt.GPT(vs_nanogpt.model_config(recipe))
    names = [("ln1", "ln_1"), ("ln2", "ln_2"), ("attn.qkv", "attn.c_attn")]
    names += [("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")]
    state = {}
    for k, v in ours.state_dict().items():
        k = k.replace("blocks.", "h.")
        for a, b in names:
            k = k.replace(f".{a}.", f".{b}.")
        state[k if k == "lm_head.weight" else f"transformer.{k}"] = v.clone()
    state["transformer.h.0.attn.bias"] = torch.ones(1)  # nanoGPT's causal mask without flash
    loaded = vs_nanogpt.nanogpt_model(state, recipe)
    x = torch.randint(0, 256, (2, recipe.block_size))
    assert torch.equal(loaded(x), ours(x))


def test_vs_nanogpt_exact_loss_counts_every_window_once(vs_nanogpt) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    recipe = vs_nanogpt.QUICK
    model = vs_nanogpt.GPT(vs_nanogpt.model_config(recipe))
    T = recipe.block_size
    val = np.random.default_rng(0).integers(0, 256, size=7 * T + 5).astype(np.uint16)
    tokens = torch.from_numpy(val[: 7 * T + 1].astype(np.int64))
    with torch.no_grad():
        logits = model(tokens[:-1].view(7, T))
        ref = F.cross_entropy(logits.flatten(0, 1), tokens[1:]).item()
    assert vs_nanogpt.exact_val_loss(model, val, T, batch=3) == pytest.approx(ref, rel=1e-5)


def test_vs_nanogpt_seeds_a_copy_and_refuses_another_script(
    vs_nanogpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = vs_nanogpt.patched_copy(vs_nanogpt.STANDIN, tmp_path / "copy", 7)
    text = (code / "train.py").read_text()
    assert "torch.manual_seed(7)" in text and vs_nanogpt.SEED_LINE not in text
    assert vs_nanogpt.SEED_LINE in (vs_nanogpt.STANDIN / "train.py").read_text()  # untouched
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "train.py").write_text("print('not nanoGPT')\n")
    with pytest.raises(SystemExit, match="no line"):
        vs_nanogpt.patched_copy(tmp_path / "other", tmp_path / "copy2", 7)
    monkeypatch.delenv("NANOGPT", raising=False)
    with pytest.raises(SystemExit, match="--nanogpt PATH"):
        vs_nanogpt.main(["--out", str(tmp_path / "out")])  # a full run needs a real checkout
    with pytest.raises(SystemExit, match="--seeds 0: run at least 1 seed per side"):
        vs_nanogpt.main(["--quick", "--seeds", "0", "--out", str(tmp_path / "out")])
