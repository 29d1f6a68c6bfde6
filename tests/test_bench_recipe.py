"""The speedrun recipe's benchmarks: bench_vs_nanogpt's `--recipe speedrun` and the ablation's
table, without training (the suite's quick runs cover the scripts end to end)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def mods() -> Iterator[dict[str, ModuleType]]:
    """bench_vs_nanogpt and ablate_recipe as modules, forgotten afterwards."""
    sys.path.insert(0, str(BENCH))
    try:
        yield {n: importlib.import_module(n) for n in ("bench_vs_nanogpt", "ablate_recipe")}
    finally:
        sys.path.remove(str(BENCH))
        for name in ("bench_vs_nanogpt", "ablate_recipe", "common", "cpu_kind", "stats"):
            sys.modules.pop(name, None)


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(zip(argv[::2], argv[1::2]))


def test_speedrun_side_keeps_the_presets_optimizer_and_its_own_steps(mods, tmp_path) -> None:
    vs = mods["bench_vs_nanogpt"]
    plain = _flags(vs.isotrain_flags(vs.Recipe(), 1, tmp_path)[:-1])
    assert plain["--preset"] == "tiny" and plain["--optim.lr"] == "0.004"
    assert plain["--steps"] == "1000"
    recipe = vs.Recipe(preset="speedrun", iso_steps=400)
    fast = _flags(vs.isotrain_flags(recipe, 1, tmp_path)[:-1])
    assert fast["--preset"] == "speedrun" and fast["--steps"] == "400"
    assert not [k for k in fast if k.startswith("--optim.")]  # the preset's own optimizer
    assert fast["--model.d-model"] == "128" and fast["--data.batch-size"] == "16"


def test_time_to_nanogpts_val_and_the_reached_check(mods) -> None:
    vs = mods["bench_vs_nanogpt"]
    recipe = vs.Recipe(preset="speedrun", iso_steps=400)
    nano = [{"steps": 1000, "ms_per_step": 200.0, "cpu_s": 210.0, "val": 1.61, "round": i}
            for i in range(2)]  # fmt: skip
    iso = [{"steps": 400, "ms_per_step": 220.0, "cpu_s": 100.0, "val": v, "round": i,
            "config": {}} for i, v in enumerate((1.59, 1.62))]  # fmt: skip
    assert vs.train_seconds(iso[0]) == pytest.approx(88.0)  # 400 steps x 220 ms
    runs = {"nanogpt": nano, "isotrain": iso}
    summary = {
        "time_to_val": vs.paired_ratio([88.0, 88.0], [200.0, 200.0]),
        "cpu_to_val": vs.paired_ratio([100.0, 100.0], [210.0, 210.0]),
    }
    rows = vs.speedrun_rows(recipe, runs, summary)
    assert rows[0].startswith("| time to nanoGPT's 1000-step val: training s (1000 against 400")
    assert "| 200 (200, 200) | 88 (88, 88) | 0.4400 [0.4400, 0.4400]" in rows[0]
    assert vs.speedrun_rows(vs.Recipe(), runs, {}) == []
    iso_cfg = {"model": {"n_layer": 4, "d_model": 128, "block_size": 128, "dropout": 0.0,
               "bias": True}, "data": {"batch_size": 16}, "precision": "fp32",
               "optim": {"name": "muon"}}  # fmt: skip
    for r in iso:
        r["config"] = iso_cfg
    for r in nano + iso:
        r["own_val"] = r["val"]
    checks = vs.recipe_checks(recipe, runs)
    assert checks["reached nanoGPT's val"] == {
        "ok": True,
        "detail": "isotrain 1.6050 <= nanoGPT 1.6100 (means over seeds)",
    }
    assert checks["finished every step"]["ok"] and checks["same recipe"]["ok"]
    iso[1]["val"] = 1.64
    assert not vs.recipe_checks(recipe, runs)["reached nanoGPT's val"]["ok"]
    assert "reached nanoGPT's val" not in vs.recipe_checks(recipe, runs, quick=True)


def test_ablation_table_compares_each_change_at_equal_steps(mods, tmp_path) -> None:
    ab = mods["ablate_recipe"]
    first, muon = list(ab.VARIANTS)[:2]
    argv = ab.flags(ab.VARIANTS[muon], 400, 7, tmp_path, quick=False)
    assert argv[:4] == ["--preset", "tiny", "--optim.name", "muon"]
    assert _flags(argv[4:])["--steps"] == "400"
    speedrun = ab.flags(ab.VARIANTS[ab.RECIPE], 400, 7, tmp_path, False)
    assert speedrun[:2] == ["--preset", "speedrun"] and "tiny" not in speedrun
    runs = [
        {"variant": first, "steps": 400, "val": 2.08, "cpu_s": 190.0},
        {"variant": muon, "steps": 400, "val": 1.86, "cpu_s": 220.0},
        {"variant": muon, "steps": 400, "val": 1.88, "cpu_s": 218.0},
    ]
    rows = ab.table(runs, {first: 0.40, muon: 0.48}, taken_back=False)
    assert rows[2] == f"| {first} | 400 | 2.0800 (2.0800) | +0.0000 | 0.400 | 1.000 | 190 |"
    assert rows[3] == f"| {muon} | 400 | 1.8700 (1.8600, 1.8800) | -0.2100 | 0.480 | 1.200 | 219 |"


def test_a_change_taken_back_is_the_recipe_less_it_and_compared_with_the_recipe(mods) -> None:
    ab = mods["ablate_recipe"]
    name = "recipe without QK-norm"
    assert ab.VARIANTS[name] == ["--preset", "speedrun", "--model.no-qk-norm"]
    runs = [
        {"variant": ab.RECIPE, "steps": 300, "val": 1.55, "cpu_s": 190.0},
        {"variant": ab.RECIPE, "steps": 300, "val": 1.57, "cpu_s": 192.0},
        {"variant": name, "steps": 300, "val": 1.60, "cpu_s": 180.0},
        {"variant": ab.RECIPE, "steps": 400, "val": 1.45, "cpu_s": 234.0},  # nothing taken back
    ]
    rows = ab.table(runs, {ab.RECIPE: 0.50, name: 0.45}, taken_back=True)
    assert rows[0].startswith("| the recipe, one change taken back | steps |")
    assert rows[2:] == [
        f"| {ab.RECIPE} | 300 | 1.5600 (1.5500, 1.5700) | +0.0000 | 0.500 | 1.000 | 191 |",
        f"| {name} | 300 | 1.6000 (1.6000) | +0.0400 | 0.450 | 0.900 | 180 |",
    ]
    assert all(n not in "".join(ab.table(runs, {}, taken_back=False)) for n in ab.WITHOUT)
