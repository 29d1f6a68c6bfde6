"""`--precision auto`: capability from the CPU's flags, then a cached, dated probe that times
fp32, bf16 and bf16-matmul steps of the model and keeps the fastest that beats fp32 by 5%."""

import dataclasses
import json
import logging
import math

import pytest
import torch

from isotrain.autograd import _cpu
from isotrain.train import config as C
from isotrain.train.precision import cache as cache_mod
from isotrain.train.precision import capability, choice
from isotrain.train.precision.probe import Measurement, measure, model_steps

CPU = torch.device("cpu")
AMX = "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
AVX512_BF16 = "flags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
AVX2 = "flags\t\t: fpu sse avx2 fma\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ISOTRAIN_CACHE_DIR", str(tmp_path))
    return tmp_path / "precision.json"


@pytest.fixture
def native(monkeypatch, own_cpu_kind):
    """A CPU with native bf16 (AVX512-BF16 flags), whatever this machine is."""
    monkeypatch.setattr(capability, "native_bf16_matmul", lambda: True)
    monkeypatch.setattr(_cpu, "_read_cpuinfo", lambda: "model name\t: Test CPU\n" + AVX512_BF16)


def _cfg(**model) -> C.TrainConfig:
    base = C.PRESETS["smoke"]()
    return dataclasses.replace(base, model=dataclasses.replace(base.model, **model))


class FakeMachine:
    """A clock that only moves when a fake step runs: `seconds[mode]` per step."""

    def __init__(self, **seconds: float) -> None:
        self.seconds = {k.replace("_", "-"): v for k, v in seconds.items()}
        self.now, self.calls = 100.0, []

    def clock(self) -> float:
        return self.now

    def step(self, mode: str) -> None:
        self.calls.append(mode)
        self.now += self.seconds[mode]

    def probe(self, budget: float = 60.0):
        return lambda cfg, device: measure(self.step, budget_s=budget, clock=self.clock)


@pytest.mark.parametrize(
    ("bf16", "mixed", "expected"),
    [
        (0.6, 0.5, "bf16-matmul"),
        (0.6, 0.7, "bf16"),
        (0.97, 0.96, "fp32"),
        (1.4, 0.9, "bf16-matmul"),
    ],
)
def test_auto_takes_the_fastest_mode_that_beats_fp32_by_five_percent(
    cache, native, bf16, mixed, expected
) -> None:
    fake = FakeMachine(fp32=1.0, bf16=bf16, bf16_matmul=mixed)
    got = choice.choose_precision(_cfg(), CPU, probe=fake.probe())
    assert got.precision == expected and not got.cached
    assert got.ratios == pytest.approx({"fp32": 1.0, "bf16": bf16, "bf16-matmul": mixed})
    assert f"step time fp32 1.00x, bf16 {bf16:.2f}x, bf16-matmul {mixed:.2f}x" in (got.describe())
    # interleaved: round 0 warms up, each round starts with another mode
    assert fake.calls[:6] == ["fp32", "bf16", "bf16-matmul", "bf16", "bf16-matmul", "fp32"]
    assert len(fake.calls) == 15


def test_the_choice_is_cached_with_its_date_and_the_header_says_so(cache, native) -> None:
    fresh = choice.choose_precision(
        _cfg(), CPU, probe=FakeMachine(fp32=1, bf16=2, bf16_matmul=0.5).probe()
    )
    entry = json.loads(cache.read_text())
    (key,) = entry
    assert "modes fp32 bf16 bf16-matmul" in key  # the key names the modes timed
    assert entry[key]["measured"] == fresh.measured and fresh.measured[:2] == "20"

    def never(cfg, device):
        raise AssertionError("probed although cached")

    again = choice.choose_precision(_cfg(), CPU, probe=never)
    assert (again.precision, again.ratios, again.cached) == ("bf16-matmul", fresh.ratios, True)
    other = choice.choose_precision(
        _cfg(d_model=64), CPU, probe=FakeMachine(fp32=1, bf16=2, bf16_matmul=3).probe()
    )
    assert (other.precision, len(json.loads(cache.read_text()))) == ("fp32", 2)  # probed again


def test_a_planted_cache_entry_is_called_cached_with_its_date_and_how_to_remeasure(
    cache, native
) -> None:
    key = cache_mod.cache_key(_cfg(), CPU)
    planted = {"precision": "bf16", "ratios": {"fp32": 1.0, "bf16": 0.8, "bf16-matmul": 0.9}}
    cache.write_text(json.dumps({key: {**planted, "measured": "2024-01-02T03:04:05+00:00"}}))
    got = choice.choose_precision(_cfg(), CPU, probe=lambda c, d: pytest.fail("probed"))
    assert got.describe() == (
        "bf16 (auto: this CPU has AVX512-BF16 but no AMX tiles; step time fp32 1.00x, "
        f"bf16 0.80x, bf16-matmul 0.90x, cached (measured 2024-01-02; delete {cache} to "
        "measure again))"
    )


def test_an_unreadable_or_incomplete_cache_is_reported_and_replaced(cache, native, caplog) -> None:
    caplog.set_level(logging.WARNING)
    fake = FakeMachine(fp32=1, bf16=0.5, bf16_matmul=0.6)
    cache.write_text("{not json")
    assert choice.choose_precision(_cfg(), CPU, probe=fake.probe()).precision == "bf16"
    assert "unreadable precision cache" in caplog.text and json.loads(cache.read_text())
    key = cache_mod.cache_key(_cfg(), CPU)
    cache.write_text(json.dumps({key: {"precision": "bf16", "reason": "an older entry"}}))
    assert not choice.choose_precision(_cfg(), CPU, probe=fake.probe()).cached
    assert "ignoring an incomplete entry" in caplog.text


@pytest.mark.parametrize(
    ("cpuinfo", "native_bf16", "words"),
    [
        (AMX, True, "this CPU has AMX tiles (amx_bf16, amx_tile)"),
        (AVX512_BF16, True, "this CPU has AVX512-BF16 but no AMX tiles"),
        (
            AVX2,
            False,
            "this CPU has neither AMX tiles nor AVX512-BF16: bf16 is emulated (AVX2), so fp32 "
            "is faster",
        ),
    ],
)
def test_the_header_names_what_the_cpu_flags_say(
    cache, monkeypatch, own_cpu_kind, cpuinfo, native_bf16, words
) -> None:
    monkeypatch.setattr(_cpu, "_read_cpuinfo", lambda: cpuinfo)
    monkeypatch.setattr(capability, "native_bf16_matmul", lambda: native_bf16)
    got = choice.choose_precision(
        _cfg(), CPU, probe=FakeMachine(fp32=1, bf16=2, bf16_matmul=2).probe()
    )
    assert got.reason.startswith(words) and "AVX512)" not in got.reason
    assert got.precision == "fp32" and cache.exists() == native_bf16  # emulated: no probe


FORCED = {  # kind: auto's choice with a fake bf16-matmul at 0.6x fp32, and why
    "avx2": (
        "fp32",
        "this CPU has neither AMX tiles nor AVX512-BF16 (ISOTRAIN_CPU_KIND=avx2): bf16 is "
        "emulated (AVX2), so fp32 is faster",
    ),
    "avx512-bf16": (
        "bf16-matmul",
        "this CPU has AVX512-BF16 but no AMX tiles (ISOTRAIN_CPU_KIND=avx512-bf16); step time "
        "fp32 1.00x, bf16 0.90x, bf16-matmul 0.60x",
    ),
    "amx": (
        "bf16-matmul",
        "this CPU has AMX tiles (amx_bf16, amx_tile) (ISOTRAIN_CPU_KIND=amx); step time fp32 "
        "1.00x, bf16 0.90x, bf16-matmul 0.60x",
    ),
}


def test_a_forced_cpu_kind_takes_its_path_and_says_it_was_forced(
    cache, monkeypatch, cpu_kind
) -> None:
    # The machine is an AVX512-BF16 CPU whose ATen runs AVX2 kernels: no kind's own answer.
    monkeypatch.setattr(_cpu, "_read_cpuinfo", lambda: "model name\t: Test CPU\n" + AVX512_BF16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    fake = FakeMachine(fp32=1, bf16=0.9, bf16_matmul=0.6)
    got = choice.choose_precision(_cfg(), CPU, probe=fake.probe())
    assert (got.precision, got.reason) == FORCED[cpu_kind]
    assert bool(fake.calls) == cache.exists() == (cpu_kind != "avx2")  # avx2: no probe
    assert capability.device_name(CPU) == f"Test CPU as {cpu_kind} (ISOTRAIN_CPU_KIND)"
    assert cache_mod.cache_key(_cfg(), CPU).startswith(f"Test CPU as {cpu_kind} (")
    assert capability.forced_kind_note() == (
        f"{cpu_kind}, forced by ISOTRAIN_CPU_KIND: this CPU has AVX512-BF16 but no AMX tiles, "
        "ATen's kernels AVX2"
    )


def test_a_probe_past_its_budget_keeps_fp32_says_so_and_caches_nothing(cache, native) -> None:
    fake = FakeMachine(fp32=25.0, bf16=25.0, bf16_matmul=25.0)
    got = choice.choose_precision(_cfg(), CPU, probe=fake.probe(budget=60.0))
    assert got.precision == "fp32" and not cache.exists()
    assert len(fake.calls) == 2  # a third 25 s step would end past 60 s: not started
    assert "the probe stopped at its 60 s budget after 2 step(s) (50 s)" in got.describe()
    assert "raise --precision-probe-seconds, or pass --precision bf16 or bf16-matmul" in (
        got.describe()
    )


def test_without_measure_now_a_needed_probe_is_left_for_later(cache, native) -> None:
    got = choice.choose_precision(_cfg(), CPU, measure_now=False, probe=lambda c, d: pytest.fail())
    assert got.precision == "auto" and not cache.exists()
    assert got.describe() == (
        "auto: this CPU has AVX512-BF16 but no AMX tiles; measuring fp32, bf16 and "
        "bf16-matmul steps (at most 60 s)..."
    )


def test_the_real_probe_times_every_mode_and_leaves_the_rng_alone() -> None:
    before = torch.get_rng_state()
    lines: list[str] = []
    with model_steps(_cfg(), CPU) as step:
        result = measure(step, budget_s=600.0, rounds=1, progress=lines.append)
    assert isinstance(result, Measurement) and not result.over_budget and result.steps == 6
    assert result.ratios()["fp32"] == 1.0 and all(  # one round on a shared machine: noisy
        math.isfinite(r) and r > 0 for r in result.ratios().values()
    )
    assert torch.equal(before, torch.get_rng_state())
    assert [ln.split(":")[0] for ln in lines] == [
        "precision  measuring, warm-up",
        "precision  measuring, round 1/1",
    ]


def test_setup_resolves_auto_and_says_why(cache, native, monkeypatch, tmp_path) -> None:
    from isotrain.train.loop import setup

    fake = FakeMachine(fp32=1.0, bf16=0.7, bf16_matmul=0.5)
    monkeypatch.setattr(
        choice, "measure", lambda step, **kw: measure(fake.step, clock=fake.clock, **kw)
    )
    base = _cfg()
    cfg = dataclasses.replace(
        base,
        precision="auto",
        out_dir=str(tmp_path),
        data=dataclasses.replace(base.data, max_bytes=60_000),
    )
    run = setup(cfg)
    assert run.cfg.precision == "bf16-matmul"
    assert run.precision_note == (
        "bf16-matmul (auto: this CPU has AVX512-BF16 but no AMX tiles; step time fp32 1.00x, "
        "bf16 0.70x, bf16-matmul 0.50x)"
    )
    fixed = setup(dataclasses.replace(cfg, precision="fp32", out_dir=str(tmp_path / "b")))
    assert fixed.precision_note == "fp32 (--precision fp32)"
