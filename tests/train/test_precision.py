"""`--precision auto`: capability first, then a measured, cached probe of the model's step."""

import dataclasses
import json

import pytest
import torch

from isotrain.train import config as C
from isotrain.train import precision as P


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ISOTRAIN_CACHE_DIR", str(tmp_path))
    return tmp_path / "precision.json"


def _cfg(**model) -> C.TrainConfig:
    base = C.PRESETS["smoke"]()
    return dataclasses.replace(base, model=dataclasses.replace(base.model, **model))


def _probe(ratio: float, calls: list[int]):
    def probe(cfg, device):
        calls.append(1)
        return ratio

    return probe


def test_an_emulating_cpu_gets_fp32_without_a_probe(cache, monkeypatch) -> None:
    monkeypatch.setattr(P, "native_bf16_matmul", lambda: False)
    calls: list[int] = []
    choice = P.choose_precision(_cfg(), torch.device("cpu"), probe=_probe(0.5, calls))
    assert (choice.precision, calls) == ("fp32", [])
    assert "emulates bf16" in choice.reason and not cache.exists()


@pytest.mark.parametrize(("ratio", "expected"), [(0.6, "bf16"), (0.97, "fp32"), (1.4, "fp32")])
def test_a_native_cpu_takes_the_measured_faster_precision(cache, monkeypatch, ratio, expected):
    monkeypatch.setattr(P, "native_bf16_matmul", lambda: True)
    calls: list[int] = []
    choice = P.choose_precision(_cfg(), torch.device("cpu"), probe=_probe(ratio, calls))
    assert choice.precision == expected and choice.ratio == ratio and not choice.cached
    assert f"{ratio:.2f}x" in choice.describe()
    again = P.choose_precision(_cfg(), torch.device("cpu"), probe=_probe(0.1, calls))
    assert (again.precision, again.ratio, again.cached, len(calls)) == (expected, ratio, True, 1)
    other = P.choose_precision(_cfg(d_model=64), torch.device("cpu"), probe=_probe(0.5, calls))
    assert (other.precision, len(calls)) == ("bf16", 2)  # another shape: probed again
    assert len(json.loads(cache.read_text())) == 2


def test_an_unreadable_cache_is_reported_and_replaced(cache, monkeypatch, caplog) -> None:
    monkeypatch.setattr(P, "native_bf16_matmul", lambda: True)
    cache.write_text("{not json")
    choice = P.choose_precision(_cfg(), torch.device("cpu"), probe=_probe(0.5, []))
    assert choice.precision == "bf16" and "unreadable precision cache" in caplog.text
    assert json.loads(cache.read_text())


def test_the_real_probe_times_both_precisions_and_leaves_the_rng_alone() -> None:
    before = torch.get_rng_state()
    ratio = P.probe_ratio(_cfg(), torch.device("cpu"), rounds=2)
    assert 0.05 < ratio < 20.0
    assert torch.equal(before, torch.get_rng_state())


def test_setup_resolves_auto_and_says_why(cache, monkeypatch, tmp_path) -> None:
    from isotrain.train.loop import setup

    monkeypatch.setattr(P, "native_bf16_matmul", lambda: True)
    monkeypatch.setattr(P, "probe_ratio", lambda cfg, device: 0.5)
    base = _cfg()
    cfg = dataclasses.replace(
        base,
        precision="auto",
        out_dir=str(tmp_path),
        data=dataclasses.replace(base.data, max_bytes=60_000),
    )
    run = setup(cfg)
    assert run.cfg.precision == "bf16"
    assert run.precision_note == "bf16 (auto: this CPU multiplies bf16 natively (" + (
        f"{torch.backends.cpu.get_cpu_capability()}); measured bf16/fp32 step time 0.50x on "
        "this model)"
    )
    fixed = setup(dataclasses.replace(cfg, precision="fp32", out_dir=str(tmp_path / "b")))
    assert fixed.precision_note == "fp32 (--precision fp32)"
