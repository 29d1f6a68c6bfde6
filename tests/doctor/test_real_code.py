"""The doctor on training code as public repositories write it (tests/doctor/zoo_real.py):
their own model calls, optimizer wrappers and batches, correct code every one, so no error,
no warning, no doctor_error, everything put back, and the fast checks well inside 10 s."""

from __future__ import annotations

import hashlib
import time
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.doctor.test_trust import examined_untouched, no_alarm, state_hash
from tests.doctor.zoo import seeded as zoo_seeded
from tests.doctor.zoo_loops import mnist_epoch
from tests.doctor.zoo_real import REAL
from torch import nn

from isotrain.doctor import examine

EXTRAS = ("ema", "scheduler", "counter")  # what a setup's step keeps beside model and optimizer


def _split(setup: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """examine's arguments, and the other objects the step writes (to check they come back)."""
    return {k: v for k, v in setup.items() if k not in EXTRAS}, {
        k: v for k, v in setup.items() if k in EXTRAS
    }


def _kept_state(extras: dict[str, Any]) -> Any:
    """The extras' state, by value: a scheduler's state dict, an EMA's shadows and counter."""
    out: dict[str, Any] = {}
    if "scheduler" in extras:
        out["scheduler"] = state_hash(extras["scheduler"])
    if "ema" in extras:
        ema = extras["ema"]
        out["ema"] = (ema.updates, {k: v.clone() for k, v in ema.shadow.items()})
    if "counter" in extras:
        out["counter"] = dict(extras["counter"])
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# Judged true: torch.distributions validates a Categorical's logits and its sampled actions with
# a host sync each (reinforce.py's two lines); validate_args=False removes both.
TRUE_ALARMS = {"policy_gradient": [("host_sync", "warning"), ("host_sync", "warning")]}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_training_code_gets_no_alarm_and_comes_back_untouched(name: str) -> None:
    setup, extras = _split(REAL[name]())
    before = _kept_state(extras)
    started = time.perf_counter()
    d = examined_untouched(setup, checks="fast")
    assert time.perf_counter() - started < 10
    assert d.of("doctor_error") == [], d
    loud = [(f.kind, f.severity) for f in d.findings if f.severity != "info"]
    assert loud == TRUE_ALARMS.get(name, []), d
    assert _same(_kept_state(extras), before)  # the EMA, the scheduler, the step counter


@pytest.mark.parametrize(
    "name", ["lora_finetune", "long_warmup", "diffusion_noise", "vae_summed_loss"]
)
def test_slow_or_noisy_learning_is_not_a_cannot_overfit_warning(name: str) -> None:
    """A LoRA rate, a warmup that keeps the lr near 0, a loss drawing new noise each call, a
    summed loss with a large floor."""
    setup, _ = _split(REAL[name]())
    d = examine(**setup, checks=["cannot_overfit"])
    assert [f for f in d.findings if f.severity != "info"] == [], d


def _not_checked(d: object, kind: str) -> list[str]:
    return [f.evidence for f in d.of(kind) if f.evidence.startswith("not checked")]  # type: ignore[attr-defined]


def test_checks_call_the_model_as_the_step_does() -> None:
    """An RNN fed its hidden state, a graph model its sparse adjacency, a seq2seq model its
    masks, a model that computes its own loss: each check with a forward of its own runs."""
    for name in ("rnn_carried_state", "gcn_sparse_graph", "seq2seq_masks",
                 "model_returns_its_loss"):  # fmt: skip
        d = examine(**REAL[name](), checks=["batch_mixing", "nonfinite_forward"])
        assert _not_checked(d, "batch_mixing") == [], (name, d)
        assert _not_checked(d, "nonfinite_forward") == [], (name, d)


def test_a_time_major_rnn_is_one_way_along_dim_0_not_mixed() -> None:
    (f,) = examine(**REAL["rnn_carried_state"](), checks=["batch_mixing"]).of("batch_mixing")
    assert f.severity == "info" and "dim 0 runs one way, like time" in f.evidence


def test_a_step_that_calls_only_the_models_parts_is_told_to_pass_forward() -> None:
    setup = REAL["gan_two_networks"]()
    d = examine(**setup, checks=["batch_mixing"])
    assert _not_checked(d, "batch_mixing") == [
        "not checked: your step does not call the model it is given (it calls its parts): pass "
        "forward=(model, batch) -> output to say how to call it"
    ]
    d = examine(**setup, checks=["batch_mixing"], forward=lambda m, batch: m["D"](batch))
    assert d.findings == []  # the discriminator's rows stay apart


def test_an_optimizer_inside_accelerates_wrapper_is_read() -> None:
    setup = REAL["accelerate_loop"]()
    d = examine(**setup, checks=["parameter_not_in_optimizer", "params_unchanged"])
    assert d.findings == []
    extra = nn.Parameter(torch.zeros(3))
    setup["model"].register_parameter("extra", extra)
    (f,) = examine(**setup, checks=["parameter_not_in_optimizer"]).findings
    assert (f.kind, f.severity, f.where) == ("parameter_not_in_optimizer", "error", "extra")


def test_a_forward_that_fails_in_the_doctors_call_is_not_checked_not_an_error() -> None:
    """The doctor's own call of the model failing is information, never a doctor_error."""
    setup = REAL["contrastive_pair"]()

    def forward(model: nn.Module, batch: object) -> torch.Tensor:
        raise RuntimeError("this model needs a call the doctor cannot make")

    d = examine(**setup, checks=["batch_mixing"], forward=forward)
    (f,) = d.findings
    assert f.severity == "info" and f.evidence.startswith(
        "not checked: the model raised RuntimeError (this model needs a call the doctor "
        "cannot make)"
    )


def _classifier(dropout: float) -> dict[str, object]:
    """pytorch/examples mnist's shape: train() sets model.train(), test() sets model.eval()
    and never sets it back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def evaluate(model: nn.Module, batches: object) -> float:
        model.eval()
        with torch.no_grad():
            return sum(float(F.cross_entropy(model(x), y)) for x, y in batches)  # type: ignore[attr-defined]

    def step(model: nn.Module, opt: object, batch: object) -> torch.Tensor:
        x, y = batch  # type: ignore[misc]
        opt.zero_grad()  # type: ignore[attr-defined]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # type: ignore[attr-defined]
        return loss

    batches = [(torch.randn(6, 8), torch.randint(0, 3, (6,))) for _ in range(2)]
    return {"model": model, "optimizer": opt, "batches": batches, "step": step,
            "eval_fn": evaluate}  # fmt: skip


def test_mode_leak_is_an_error_only_when_the_next_step_runs_differently() -> None:
    leaky = _classifier(0.5)
    (f,) = examine(**leaky, checks=["mode_leak"]).findings
    assert f.severity == "error" and f.evidence.endswith(
        "your next step, run from there, computes another loss and update than from the modes "
        "it found"
    )
    nothing_reads_it = _classifier(0.0)
    (f,) = examine(**nothing_reads_it, checks=["mode_leak"]).findings
    assert f.severity == "info" and "computes the same loss and update bit for bit" in f.evidence
    resets = _classifier(0.5)
    user_step = resets["step"]

    def step(model: nn.Module, opt: object, batch: object) -> torch.Tensor:
        model.train()  # the epoch loop's own reset, at the start of each step here
        return user_step(model, opt, batch)  # type: ignore[operator]

    resets["step"] = step
    (f,) = examine(**resets, checks=["mode_leak"]).findings
    assert f.severity == "info"


def test_an_epoch_function_is_examined_as_the_loop_runs_it() -> None:
    """pytorch/examples mnist's train(model, device, loader, optimizer, epoch) shape: the
    epoch sets model.train() itself, so test()'s model.eval() leaks nothing that matters."""
    setup = _classifier(0.5)
    step = setup.pop("step")

    def train_epoch(model: nn.Module, optimizer: Any, loader: Any) -> float:
        model.train()
        total = torch.zeros(())
        for batch in loader:
            total += step(model, optimizer, batch).detach()  # type: ignore[operator]
        return float(total) / len(loader)  # sync: once per epoch, for the log

    d = examined_untouched(setup, epoch=train_epoch, checks="fast")
    assert d.of("doctor_error") == [], d
    no_alarm(d)
    (leak,) = d.of("mode_leak")
    assert leak.severity == "info"
    with pytest.raises(ValueError, match="pass step=your_step or epoch=your_epoch, not both"):
        examine(**setup, step=step, epoch=train_epoch)


def test_a_distributions_argument_check_is_named_with_its_switch() -> None:
    d = examine(**REAL["policy_gradient"](), checks=["host_sync"])
    assert [f.fix for f in d.findings] == [
        "pass validate_args=False to the distribution (or call torch.distributions.Distribution."
        "set_default_validate_args(False) once) when its inputs are known to be valid"
    ] * 2


def test_eval_fn_gets_the_users_loader_and_its_failure_is_information() -> None:
    """mnist's test(): `len(test_loader.dataset)`; and an evaluation that fails on the
    examined batches is not checked, never a doctor_error."""
    from torch.utils.data import DataLoader, TensorDataset

    setup = _classifier(0.5)
    loader = DataLoader(TensorDataset(torch.randn(12, 8), torch.randint(0, 3, (12,))), 6)
    setup["batches"] = loader

    def test(model: nn.Module, test_loader: Any) -> float:
        model.eval()
        with torch.no_grad():
            total = sum(
                float(F.cross_entropy(model(x), y, reduction="sum")) for x, y in test_loader
            )
        return total / len(test_loader.dataset)

    setup["eval_fn"] = test
    d = examine(**setup, checks=["mode_leak", "rng_leak"])
    assert d.of("doctor_error") == [] and [f.kind for f in d.findings] == ["mode_leak"], d

    def broken(model: nn.Module, batches: Any) -> None:
        raise KeyError("images")

    setup["eval_fn"] = broken
    (f,) = examine(**setup, checks=["rng_leak"]).findings
    assert (f.kind, f.severity) == ("rng_leak", "info")
    assert (
        f.evidence == "not checked: your eval_fn raised KeyError ('images') on the examined batches"
    )


def test_a_log_line_every_few_batches_of_an_epoch_function_is_not_a_per_step_sync() -> None:
    """mnist's `if batch_idx % log_interval == 0: ... loss.item()`: judged over the epoch
    function run on all six batches, it syncs once, not on every batch; logged on every batch,
    it is the per-batch sync a step's would be."""
    (f,) = examine(**mnist_epoch(), checks=["host_sync"]).findings
    assert (f.severity, f.where) == ("info", "tests/doctor/zoo_loops.py:70")
    assert f.evidence.startswith(
        "1 sync(s) from .item() / float(t) / bool(t) / `if t:` / print(t) in one call of your "
        "epoch function over 6 batches and 1 over 1 batch: not on every batch"
    )
    (f,) = examine(**mnist_epoch(log_interval=1), checks=["host_sync"]).findings
    assert (f.severity, f.where) == ("warning", "tests/doctor/zoo_loops.py:70")
    assert f.evidence.startswith(
        "1 sync(s) per batch from .item() / float(t) / bool(t) / `if t:` / print(t) (6 in one "
        "call of your epoch function over 6 batches)"
    )


def test_an_epoch_functions_schedule_is_judged_over_the_declared_run() -> None:
    """StepLR(1, 0.7) after each of 14 epochs keeps 8% of its lr at half the run; the same
    scheduler stepped inside the batch loop, or StepLR(4, 0.1) over 90 epochs, spends it."""
    assert examine(**mnist_epoch(), checks=["lr_collapse"]).findings == []
    (f,) = examine(**mnist_epoch(per_batch=True), checks=["lr_collapse"]).findings
    assert f.severity == "warning" and f.evidence.endswith(
        "after 13 of the run's 84 batches (total_steps=84), its schedulers stepped as your epoch "
        "function steps them (StepLR.step() x1 per batch)"
    )
    short = mnist_epoch(step_size=4, gamma=0.1, epochs=90)
    (f,) = examine(**short, checks=["lr_collapse"]).findings
    assert f.severity == "warning" and f.evidence.endswith(
        "after 12 of the run's 90 epochs (total_steps=540, 6 batches an epoch), its schedulers "
        "stepped as your epoch function steps them (StepLR.step() x1 per epoch)"
    )
    imagenet = mnist_epoch(step_size=30, gamma=0.1, epochs=90)  # pytorch/examples imagenet's
    assert examine(**imagenet, checks=["lr_collapse"]).findings == []
    undeclared = mnist_epoch(step_size=4, gamma=0.1, epochs=90)
    del undeclared["total_steps"]  # the run's epochs unknown: a per-epoch schedule not judged
    (f,) = examine(**undeclared, checks=["lr_collapse"]).findings
    assert f.severity == "info" and "not judged" in f.evidence and "after 12 epochs" in f.evidence


def _deep_hash(*objects: Any) -> str:
    """sha256 over everything reachable through the user's objects' attributes, dicts and
    lists: tensor bytes, plain values, attribute names."""
    h = hashlib.sha256()
    seen: set[int] = set()

    def feed(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            h.update(f"{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        elif isinstance(value, (nn.Module, torch.optim.Optimizer)):
            h.update(state_hash(value).encode())
        elif id(value) in seen:
            h.update(b"<seen>")
        elif isinstance(value, dict):
            seen.add(id(value))
            for k in sorted(value, key=str):
                h.update(str(k).encode())
                feed(value[k])
        elif isinstance(value, (list, tuple)):
            seen.add(id(value))
            for v in value:
                feed(v)
        elif hasattr(value, "__dict__"):
            seen.add(id(value))
            feed(vars(value))
        else:
            h.update(repr(value).encode())

    for obj in objects:
        feed(obj)
    return h.hexdigest()


def test_state_three_levels_below_the_step_comes_back_bit_for_bit() -> None:
    """A Trainer (its train_step a bound method) holding an EMA helper holding its shadow dict
    and counter: all of it as before, the attribute the first step creates gone again."""
    setup = REAL["nested_trainer"]()
    trainer = setup["step"].__self__
    shadow = trainer.ema.state.shadow
    before = _deep_hash(trainer)
    d = examined_untouched(setup, checks="all")
    assert d.of("doctor_error") == [] and d.of("global_state_leak") == [], d
    assert _deep_hash(trainer) == before
    assert trainer.ema.state.shadow is shadow and trainer.ema.state.steps == 0
    assert not hasattr(trainer.ema.state, "last_loss")
    closed_over = REAL["nested_trainer"]()
    kept = closed_over["step"].__self__

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        return kept.train_step(model, opt, batch)

    before = _deep_hash(kept)
    examined_untouched({**closed_over, "step": step}, checks="fast")
    assert _deep_hash(kept) == before


def test_state_past_the_bounds_is_named_not_silently_kept() -> None:
    """A chain of objects deeper than the doctor follows: its end named as information."""
    setup = REAL["nested_trainer"]()
    trainer = setup["step"].__self__
    link = trainer.ema.state
    for _ in range(10):
        link.next = types.SimpleNamespace(count=0)
        link = link.next
    (f,) = examine(**setup, checks=["global_state_leak"]).findings
    assert (f.kind, f.severity, f.where) == ("global_state_leak", "info", "your step's state")
    assert f.evidence.startswith(
        "not put back after examine: self.ema.state.next.next.next.next.next.next.next, past 8 "
        "levels or 4096 objects of what your step reads by name"
    )


def test_a_gradient_norm_measured_with_max_norm_inf_is_no_nonfinite_forward() -> None:
    """clip_grad_norm_(params, inf) makes inf inside (max_norm / norm) and clamps it to 1; an
    inf the step passes that reaches its loss is still named."""
    setup = REAL["grad_norm_measured"]()
    assert examine(**setup, checks=["nonfinite_forward"]).findings == []

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x) * float("inf"), y)  # a temperature of inf, inverted
        loss.backward()
        opt.step()
        return loss

    d = examine(**{**setup, "step": step}, checks=["nonfinite_forward"])
    (f,) = d.findings
    assert (f.kind, f.severity) == ("nonfinite_forward", "error")
    line = step.__code__.co_firstlineno + 3  # the loss line
    assert f.where.endswith(f"test_real_code.py:{line}"), f.where
    assert f.evidence.startswith(
        "mul turned a NaN/Inf number your code passed it into the step's first NaN/Inf (outside "
        "any module), and the loss or a gradient at the update is not finite"
    )


@pytest.mark.parametrize("own_generator", [False, True])
def test_an_eval_loaders_base_seed_is_named_as_the_rng_its_evaluation_draws(
    own_generator: bool,
) -> None:
    """pytorch/examples mnist's test(): iterating the test DataLoader (shuffle off) draws its
    iterator's base seed from the global RNG, so the next step's dropout masks change; a
    DataLoader with a generator of its own draws nothing from it."""
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g))
    loader = DataLoader(data, 16, generator=torch.Generator() if own_generator else None)
    model = zoo_seeded(lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 3)))

    def test(model: nn.Module, batches: Any) -> float:
        model.eval()
        with torch.no_grad():
            return sum(float(F.cross_entropy(model(x), y)) for x, y in loader)

    setup = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                 batches=[data[:16], data[16:]], eval_fn=test,
                 loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))  # fmt: skip
    found = examine(**setup, checks=["rng_leak"]).findings
    if own_generator:
        assert found == [], found
        return
    (f,) = found
    assert f.severity == "warning" and "1 DataLoader iterator(s) it started" in f.evidence, f
    assert "own generator=torch.Generator()" in f.fix, f
