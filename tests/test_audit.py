"""Tests for isotrain.contexts: each kind of leak is named exactly; clean blocks report nothing."""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from isotrain.contexts import (
    StateAudit,
    StateLeakError,
    assert_isolated,
    autocast_if_available,
    eval_mode,
    frozen,
    rng_isolated,
    subnormals_flushed,
    train_mode,
)

pytest_plugins = ["pytester"]


def make_model() -> nn.Module:
    model = nn.Sequential()
    model.add_module("encoder", nn.Sequential())
    model.encoder.add_module("fc", nn.Linear(4, 4))
    model.encoder.add_module("bn", nn.BatchNorm1d(4))
    model.add_module("head", nn.Linear(4, 2))
    model.train()
    model.encoder.bn.eval()
    return model


@dataclass
class Leak:
    """A block that leaks one thing, the message expected, and an independent reader."""

    leak: Callable[[Any], Any]
    message: str | Callable[[], str]  # one line per expected difference
    read: Callable[[Any], Any]
    undo: Callable[[Any], Any] | None = None  # for state restore() does not cover


def _other_threads() -> int:
    return 1 if torch.get_num_threads() != 1 else 2


def _leak_inference(state: dict) -> None:
    state["ctx"] = torch.inference_mode()
    state["ctx"].__enter__()


def _set_stance(stance: str) -> None:
    torch.compiler.set_stance(stance)


LEAKS = {
    "grad": Leak(lambda s: torch.set_grad_enabled(False), "grad mode: True -> False",
                 lambda s: torch.is_grad_enabled()),
    "inference": Leak(_leak_inference, "grad mode: True -> False\ninference mode: False -> True",
                      lambda s: torch.is_inference_mode_enabled(),
                      undo=lambda s: s["ctx"].__exit__(None, None, None)),
    "autocast-enabled": Leak(lambda s: torch.set_autocast_enabled("cpu", True),
                             "autocast cpu enabled: False -> True",
                             lambda s: torch.is_autocast_enabled("cpu")),
    "autocast-dtype": Leak(lambda s: torch.set_autocast_dtype("cpu", torch.float16),
                           "autocast cpu dtype: torch.bfloat16 -> torch.float16",
                           lambda s: torch.get_autocast_dtype("cpu")),
    "autocast-cuda-dtype": Leak(lambda s: torch.set_autocast_dtype("cuda", torch.bfloat16),
                                "autocast cuda dtype: torch.float16 -> torch.bfloat16",
                                lambda s: torch.get_autocast_dtype("cuda")),
    "autocast-cache": Leak(lambda s: torch.set_autocast_cache_enabled(False),
                           "autocast cache: True -> False",
                           lambda s: torch.is_autocast_cache_enabled()),
    "default-dtype": Leak(lambda s: torch.set_default_dtype(torch.float64),
                          "default dtype: torch.float32 -> torch.float64",
                          lambda s: torch.get_default_dtype()),
    "deterministic": Leak(lambda s: torch.use_deterministic_algorithms(True),
                          "deterministic algorithms: False -> True",
                          lambda s: torch.are_deterministic_algorithms_enabled()),
    "warn-only": Leak(lambda s: torch.use_deterministic_algorithms(False, warn_only=True),
                      "deterministic warn_only: False -> True",
                      lambda s: torch.is_deterministic_algorithms_warn_only_enabled()),
    "threads": Leak(lambda s: torch.set_num_threads(_other_threads()),
                    lambda: f"num threads: {torch.get_num_threads()} -> {_other_threads()}",
                    lambda s: torch.get_num_threads()),
    "anomaly": Leak(lambda s: torch.set_anomaly_enabled(True), "anomaly mode: False -> True",
                    lambda s: torch.is_anomaly_enabled()),
    "anomaly-nan": Leak(lambda s: torch.set_anomaly_enabled(False, False),
                        "anomaly check_nan: True -> False",
                        lambda s: torch.is_anomaly_check_nan_enabled()),
    "matmul-precision": Leak(lambda s: torch.set_float32_matmul_precision("medium"),
                             "float32 matmul precision: highest -> medium",
                             lambda s: torch.get_float32_matmul_precision()),
    "subnormals": Leak(lambda s: torch.set_flush_denormal(True),
                       "subnormals flushed: False -> True", lambda s: subnormals_flushed()),
    "compiler-stance": Leak(lambda s: _set_stance("force_eager"),
                            "compiler stance: default -> force_eager",
                            lambda s: None, undo=lambda s: _set_stance("default")),
    "python-rng": Leak(lambda s: random.random(), "Python random state changed",
                       lambda s: random.getstate()),
    "torch-rng": Leak(lambda s: torch.rand(1), "torch RNG state changed",
                      lambda s: torch.get_rng_state().tolist()),
    "numpy-rng": Leak(lambda s: np.random.rand(), "numpy RNG state changed",
                      lambda s: np.random.get_state()[1].tolist()),
    "module-training": Leak(lambda s: s["model"].encoder.bn.train(),
                            "module 'encoder.bn' training: False -> True",
                            lambda s: s["model"].encoder.bn.training),
    "root-training": Leak(lambda s: setattr(s["model"], "training", False),
                          "module '<root>' training: True -> False",
                          lambda s: s["model"].training),
    "requires-grad": Leak(lambda s: s["model"].head.weight.requires_grad_(False),
                          "parameter 'head.weight' requires_grad: True -> False",
                          lambda s: s["model"].head.weight.requires_grad),
    "buffer-value": Leak(lambda s: s["model"].encoder.bn.running_mean.add_(1e-30),
                         "buffer 'encoder.bn.running_mean' changed",
                         lambda s: s["model"].encoder.bn.running_mean.tolist()),
    "buffer-object": Leak(lambda s: setattr(s["model"].encoder.bn, "running_var", torch.ones(4)),
                          "buffer 'encoder.bn.running_var' replaced",
                          lambda s: id(s["model"].encoder.bn.running_var)),
    "buffer-nan": Leak(lambda s: s["model"].encoder.bn.running_mean.fill_(float("nan")),
                       "buffer 'encoder.bn.running_mean' changed",
                       lambda s: s["model"].encoder.bn.running_mean.isnan().any().item()),
    "bn-forward": Leak(lambda s: s["model"].train()(torch.ones(8, 4)),
                       "module 'encoder.bn' training: False -> True\n"
                       "buffer 'encoder.bn.running_mean' changed\n"
                       "buffer 'encoder.bn.running_var' changed\n"
                       "buffer 'encoder.bn.num_batches_tracked' changed",
                       lambda s: [b.tolist() for b in s["model"].buffers()]),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(LEAKS))
def test_audit_names_each_leak_and_restore_puts_it_back(kind: str) -> None:
    case = LEAKS[kind]
    state: dict[str, Any] = {"model": make_model()}
    message = case.message() if callable(case.message) else case.message
    before = case.read(state)
    with StateAudit(state["model"], warn=False) as audit:
        case.leak(state)
    assert audit.differences == message.split("\n")
    if case.undo is not None:
        case.undo(state)
    else:
        audit.restore()
    assert case.read(state) == before


@pytest.mark.parametrize("kind", ["grad", "default-dtype", "torch-rng", "module-training"])
def test_raise_on_leak_lists_every_difference(kind: str) -> None:
    case, state = LEAKS[kind], {"model": make_model()}
    audit = StateAudit(state["model"], raise_on_leak=True)
    with pytest.raises(StateLeakError) as info, audit:
        case.leak(state)
        torch.set_grad_enabled(False)  # a second leak: both must be listed
    audit.restore()
    assert isinstance(info.value, AssertionError)
    assert info.value.differences == audit.differences and len(audit.differences) >= 1
    assert "grad mode: True -> False" in audit.differences
    for diff in audit.differences:
        assert f"  - {diff}" in str(info.value)


def test_clean_block_reports_nothing_even_with_the_contexts() -> None:
    model = make_model()
    x = torch.randn(8, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with (
            StateAudit(model, raise_on_leak=True) as audit,
            frozen(model),
            train_mode(model.head),
            eval_mode(model),
            autocast_if_available(device="cpu"),
            rng_isolated(seed=3),
        ):
            model(x + torch.randn(8, 4))
            random.random()
            np.random.rand()
    assert audit.differences == []


def test_default_warns_and_never_masks_the_blocks_exception() -> None:
    with pytest.warns(UserWarning, match=r"grad mode: True -> False"), StateAudit() as audit:
        torch.set_grad_enabled(False)
    audit.restore()
    with pytest.raises(KeyError), StateAudit(raise_on_leak=True) as audit:
        torch.set_grad_enabled(False)
        raise KeyError("boom")
    audit.restore()
    assert audit.differences == ["grad mode: True -> False"]


def test_check_rng_false_ignores_rng_and_several_modules_are_prefixed() -> None:
    a, b = make_model(), make_model()
    with StateAudit(a, b, check_rng=False, warn=False) as audit:
        torch.rand(1)
        b.encoder.bn.train()
        a.eval()
    audit.restore()
    assert audit.differences == [
        "module '0' training: True -> False",
        "module '0.encoder' training: True -> False",
        "module '0.encoder.fc' training: True -> False",
        "module '0.head' training: True -> False",
        "module '1.encoder.bn' training: False -> True",
    ]
    assert a.training and b.encoder.bn.training is False


def test_check_params_names_changed_values_and_gradients() -> None:
    model = make_model()
    model.head.weight.grad = torch.zeros_like(model.head.weight)
    before = [p.detach().clone() for p in model.parameters()], model.head.weight.grad
    with StateAudit(model, warn=False, check_params=True) as audit:
        with torch.no_grad():
            model.encoder.fc.bias.add_(1.0)
        model.head.weight.grad = None
        model.encoder.fc.weight.grad = torch.ones_like(model.encoder.fc.weight)
        model.head.weight.requires_grad_(False)
    assert audit.differences == [
        "parameter 'head.weight' requires_grad: True -> False",
        "parameter 'encoder.fc.weight' grad changed",
        "parameter 'encoder.fc.bias' changed",
        "parameter 'head.weight' grad changed",
    ]
    audit.restore()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before[0]))
    assert model.head.weight.grad is before[1] and model.encoder.fc.weight.grad is None
    with StateAudit(model, raise_on_leak=True), torch.no_grad():  # values are not read
        model.head.bias.add_(1.0)


def test_decorator_audits_every_call() -> None:
    audit = StateAudit(raise_on_leak=True)

    @audit
    def step(leak: bool) -> int:
        if leak:
            torch.set_default_dtype(torch.float64)
        return 7

    assert step(False) == 7 and audit.differences == []
    with pytest.raises(StateLeakError, match=r"default dtype: torch.float32 -> torch.float64"):
        step(True)
    torch.set_default_dtype(torch.float32)
    assert audit.differences == ["default dtype: torch.float32 -> torch.float64"]


def test_assert_isolated() -> None:
    model = make_model()
    assert assert_isolated(lambda: 5, model) == 5
    with pytest.raises(StateLeakError, match=r"module 'encoder.bn' training: False -> True"):
        assert_isolated(lambda: model.train(), model)
    model.encoder.bn.eval()
    with pytest.raises(StateLeakError, match="grad mode"), assert_isolated(None):
        torch.set_grad_enabled(False)
    torch.set_grad_enabled(True)
    with pytest.raises(TypeError, match=r"got an nn\.Module"):
        assert_isolated(model)
    with pytest.raises(TypeError, match=r"StateAudit takes nn\.Module arguments"):
        StateAudit(lambda: None)


def test_audit_misuse_is_explained() -> None:
    audit = StateAudit()
    with pytest.raises(RuntimeError, match="needs a finished block"):
        audit.restore()
    with audit, pytest.raises(RuntimeError, match="already active"), audit:
        pass


def test_audit_without_modules_is_cheap() -> None:
    def once() -> None:
        with StateAudit(warn=False):
            pass

    once()
    times = []
    for _ in range(50):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    assert min(times) < 1e-3, f"fastest empty audit took {min(times) * 1e6:.0f} us"


# ------------------------------------------------------------------ the autouse fixture


CONFTEST = Path(__file__).with_name("conftest.py").read_text()


def test_autouse_fixture_fails_leaks_restores_state_and_rng(pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        """
        import torch

        def test_a_leaks_grad_and_dtype():
            torch.set_grad_enabled(False)
            torch.set_default_dtype(torch.float64)

        def test_b_state_was_put_back():
            assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32

        def test_c_rng_is_fine_and_starts_equal():
            torch.manual_seed(123)

        def test_d_rng_was_restored():
            global FIRST
            FIRST = torch.rand(1)

        def test_e_same_draw_again():
            assert torch.equal(torch.rand(1), FIRST)
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=5, errors=1)
    result.stdout.fnmatch_lines(
        ["*test leaked global state*", "*grad mode: True -> False", "*default dtype: *"]
    )
