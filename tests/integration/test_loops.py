"""Inside loops we did not write: Lightning Fabric, HF Accelerate, a user's own wrapper.

Every skip mode against every wrapper: a NaN gradient leaves parameters, optimizer moments and
`step` bitwise unchanged, and good steps equal an unwrapped clip + step reference. Then all
five patterns at once inside a Fabric and an Accelerate training loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tests.integration.zoo import GPT, seeded
from torch import nn

from isotrain.autograd import quantize_linear_layers
from isotrain.checkpointing import apply_activation_checkpointing
from isotrain.compile import compile_model, no_recompiles, track_compiles, warmup
from isotrain.guard import SkipReason, StepGuard

fabric_mod = pytest.importorskip("lightning.fabric")
accelerate = pytest.importorskip("accelerate")


class Forwarding:
    """A user's own wrapper: forwards what a loop calls, keeps its own attributes."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._impl, self.calls = optimizer, 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._impl.param_groups

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        return self._impl.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._impl.zero_grad(set_to_none)


class Opaque(Forwarding):
    """A wrapper that hides its optimizer where the guard cannot find it."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.__dict__["_impl"] = [optimizer]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.__dict__["_impl"][0].param_groups

    def step(self, closure: Any = None) -> Any:
        return self.__dict__["_impl"][0].step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.__dict__["_impl"][0].zero_grad(set_to_none)


@pytest.fixture(scope="module")
def fabric() -> Any:
    return fabric_mod.Fabric(accelerator="cpu", devices=1)


@pytest.fixture(scope="module")
def accelerator() -> Any:
    return accelerate.Accelerator(cpu=True)


def _wrappers(fabric: Any, accelerator: Any) -> dict[str, Callable[..., tuple[Any, Any]]]:
    return {
        "fabric": lambda m, o: fabric.setup(m, o),
        "accelerate": lambda m, o: accelerator.prepare(m, o),
        "forwarding": lambda m, o: (m, Forwarding(o)),
        "opaque": lambda m, o: (m, Opaque(o)),
    }


OPTIMIZERS = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
}
CASES = [
    (wrap, name, mode)
    for wrap in ("fabric", "accelerate", "forwarding", "opaque")
    for name in OPTIMIZERS
    for mode in ("select", "host", "found_inf")
    if "fused" in name or mode != "found_inf"
]


def _model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss(model: Any, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    return nn.functional.mse_loss(model(x), y)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    sd = opt.state_dict()["state"]
    moments = [t for k in sorted(sd) for t in sd[k].values() if torch.is_tensor(t)]
    return [t.detach().clone() for t in (*model.state_dict().values(), *moments)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(("wrap", "name", "mode"), CASES)
def test_a_nan_gradient_never_reaches_a_wrapped_optimizer(fabric, accelerator, wrap, name, mode):
    raw, ref = _model(), _model()
    inner, ref_opt = OPTIMIZERS[name](raw.parameters()), OPTIMIZERS[name](ref.parameters())
    model, opt = _wrappers(fabric, accelerator)[wrap](raw, inner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = StepGuard(opt, model, max_norm=0.5, spike_k=None, skip_mode=mode)
    fell_back = [str(w.message) for w in caught if "StepGuard" in str(w.message)]
    assert guard.skip_mode == ("host" if wrap == "opaque" else mode)
    assert len(fell_back) == (wrap == "opaque" and mode != "host")  # one warning says so
    for step in range(4):
        before = _state(raw, inner)
        loss = _loss(model, step) * (float("nan") if step in (0, 2) else 1.0)
        loss.backward()
        outcome = guard.step(loss.detach())
        if step in (0, 2):
            assert outcome.reason.item() == SkipReason.NONFINITE_LOSS
            assert _same(_state(raw, inner), before)  # params, moments, step: bit-identical
            continue
        assert outcome.applied
        _loss(ref, step).backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        assert _same(_state(raw, inner), _state(ref, ref_opt))
    if wrap == "forwarding":
        assert opt.calls == (2 if mode == "host" else 4)  # the wrapper's own step ran


def test_found_inf_reaches_the_kernel_through_a_gradscaler_inside_the_wrapper(accelerator):
    # A wrapper that runs GradScaler.step itself sets (and deletes) its own found_inf right
    # before the kernel; the guard's flag must still reach the kernel, combined with it.
    raw = _model()
    inner = torch.optim.AdamW(raw.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)

    class ScalingWrapper(Forwarding):
        def step(self, closure: Any = None) -> Any:
            scaler.step(self._impl)
            scaler.update()

    opt = ScalingWrapper(inner)  # the guard unscales; the wrapper's scaler.update() is the one
    guard = StepGuard(opt, raw, scaler=scaler, spike_k=None, skip_mode="found_inf")
    scaler.scale(_loss(raw, 0)).backward()
    guard.step(torch.tensor(1.0))
    before = _state(raw, inner)
    loss = _loss(raw, 1)  # finite gradients, but the guard skips on the (non-finite) loss value
    scaler.scale(loss).backward()
    assert guard.step(torch.tensor(float("nan"))).reason.item() == SkipReason.NONFINITE_LOSS
    assert _same(_state(raw, inner), before)
    assert "found_inf" not in inner.__dict__ and "grad_scale" not in inner.__dict__
    assert guard.summary()["loss_scale"] == 2.0**4  # updated once per step: no overflow seen


def test_a_sharding_wrapper_is_not_unwrapped() -> None:
    # A wrapper holding an optimizer over other parameters (a shard) steps as a whole.
    a, b = _model(), _model()
    shard = torch.optim.SGD(b.parameters(), lr=0.1)

    class Sharded(torch.optim.SGD):
        def __init__(self) -> None:
            super().__init__(a.parameters(), lr=0.1)
            self.local = shard

    guard = StepGuard(Sharded(), a, spike_k=None, skip_mode="select")
    assert guard.chain == [guard.optimizer] and guard.inner.local is shard


@pytest.mark.parametrize("framework", ["fabric", "accelerate"])
def test_all_five_patterns_inside_the_frameworks_loop(fabric, accelerator, framework) -> None:
    torch._dynamo.reset()
    raw = seeded(GPT)
    quantize_linear_layers(raw, bits=8, exclude=["lm_head"])
    apply_activation_checkpointing(raw, policy="full")
    compile_model(raw, backend="eager", dynamic=False)
    inner = torch.optim.AdamW(raw.parameters(), lr=3e-3, fused=True)
    model, opt = _wrappers(fabric, accelerator)[framework](raw, inner)
    backward = fabric.backward if framework == "fabric" else accelerator.backward
    guard = StepGuard(opt, raw, skip_mode="found_inf", protect_buffers=True)
    data = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    assert warmup(raw, [(x, y)]).eager_block_calls == 0
    losses = []
    with no_recompiles(), track_compiles() as run:
        for i in range(6):
            before = _state(raw, inner)
            _, loss = model(x, y)
            loss = loss * (float("nan") if i == 3 else 1.0)
            backward(loss)
            if bool(guard.step(loss.detach()).applied):  # sync: the test reads every step
                losses.append(loss.item())
            else:
                assert i == 3 and _same(_state(raw, inner), before)
    torch._dynamo.reset()
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert run.compilations == 0 and run.compiled_block_calls == run.block_calls == 12
