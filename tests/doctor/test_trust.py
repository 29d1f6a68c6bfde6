"""The doctor is trusted: correct setups people really run get no error and no warning, and
examine leaves the caller's objects (model, optimizers, schedulers, RNG, flags) bit for bit."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from tests.doctor import zoo

from isotrain.contexts import StateAudit
from isotrain.doctor import Diagnosis, examine


def state_hash(*objects: Any) -> str:
    """sha256 over the state dicts of models, optimizers and schedulers (tensor bytes too)."""
    h = hashlib.sha256()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                feed(value[k])
        elif isinstance(value, (list, tuple)):
            for v in value:
                feed(v)
        else:
            h.update(repr(value).encode())

    for obj in objects:
        feed(obj.state_dict())
    return h.hexdigest()


def examined_untouched(setup: dict[str, Any], *extra: Any, **kw: Any) -> Diagnosis:
    """examine(**setup) under an audit that raises on any leak, with the state hash of the
    model, the optimizer(s) and `extra` (schedulers) compared before and after."""
    opts = setup["optimizer"]
    opts = list(opts) if isinstance(opts, (list, tuple)) else [opts]
    before = state_hash(setup["model"], *opts, *extra)
    grads = {n: p.grad for n, p in setup["model"].named_parameters()}
    with StateAudit(setup["model"], raise_on_leak=True, check_params=True):
        d = examine(**setup, **kw)
    assert state_hash(setup["model"], *opts, *extra) == before
    assert all(p.grad is grads[n] for n, p in setup["model"].named_parameters())
    return d


def no_alarm(d: Diagnosis) -> None:
    assert not [f for f in d.findings if f.severity != "info"], d


def test_a_step_that_steps_a_scheduler_bound_to_the_real_optimizer() -> None:
    setup = zoo.mlp_setup()
    model, opt = setup["model"], setup["optimizer"]
    zoo.good_step(model, opt, setup["batches"][0])  # grads and moments exist before examine
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)
    model.fc1.weight.tensor_model_parallel = True  # an attribute parallel code sets

    def step(m: torch.nn.Module, o: Any, batch: Any) -> torch.Tensor:
        loss = zoo.good_step(model, opt, batch)  # closes over the real objects, as scripts do
        sched.step()
        return loss

    lr = opt.param_groups[0]["lr"]
    d = examined_untouched({**setup, "step": step}, sched, checks="all")
    no_alarm(d)
    assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == 0
    assert model.fc1.weight.tensor_model_parallel is True


def test_examine_restores_what_a_check_changed_even_on_a_copy_proof_model() -> None:
    setup = zoo.mlp_setup()
    zoo.good_step(setup["model"], setup["optimizer"], setup["batches"][0])
    setup["model"].pending = (i for i in range(3))  # copy.deepcopy of the model raises
    no_alarm(examined_untouched(setup, checks="all"))
