"""The update-path family: each report's bug is named at its severity, its correct twin gets no
error and no warning from any check and is left untouched, other forms of the same bug are
named too, and correct code that reorders the path on purpose (SAM, a logged norm, LBFGS,
GANs, accumulation over calls) gets no alarm."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.doctor import zoo_update
from tests.doctor.test_trust import examined_untouched, no_alarm
from tests.doctor.zoo import ce, mlp_setup
from tests.doctor.zoo_real import REAL
from torch import nn

from isotrain.doctor import examine

KINDS = [
    "gradient_discarded", "clip_misplaced", "stale_gradient", "advantage_not_detached",
    "update_applied_twice", "update_lost_to_rounding", "loss_term_unused",
]  # fmt: skip
EXTRAS = ("ema", "scheduler", "counter")


def _id(v: Any) -> str:
    return getattr(v, "__name__", str(v))


def severities(d: Any, kind: str) -> list[str]:
    return [f.severity for f in d.findings if f.kind == kind]


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_update.BUGS, ids=_id)
def test_the_bug_is_named(kind: str, make: Any, severity: str) -> None:
    d = examine(**make(False), checks=[kind])
    assert severities(d, kind) == [severity], d
    if kind != "duplicate_parameter":  # read from the groups: named by the parameters
        assert d.findings[0].where.startswith("tests/doctor/zoo_update.py:"), d


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_update.BUGS, ids=_id)
def test_the_twin_is_clean_and_untouched(kind: str, make: Any, severity: str) -> None:
    no_alarm(examined_untouched(make(True), checks="all"))


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_training_code_gets_no_alarm_from_the_update_path(name: str) -> None:
    setup = {k: v for k, v in REAL[name]().items() if k not in EXTRAS}
    d = examine(**setup, checks=KINDS)
    assert not [f for f in d.findings if f.severity != "info"], d


def _accumulating_over_calls(bug: bool) -> dict[str, Any]:
    """One micro-batch per call, a step every second call; the bug zeroes at every call."""
    calls = {"n": 0}

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        if bug:
            model.zero_grad()  # BUG: the model's zero_grad, every micro-batch
        (ce(model, batch) / 2).backward()
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            opt.step()
            if not bug:
                opt.zero_grad()
        return torch.zeros(())

    return mlp_setup(step=step)


def test_zeroing_each_call_of_an_accumulation_over_calls_is_named() -> None:
    (f,) = examine(**_accumulating_over_calls(True), checks=["gradient_discarded"]).findings
    assert f.severity == "error" and "1 earlier backward pass(es)" in f.evidence, f
    no_alarm(examined_untouched(_accumulating_over_calls(False), checks="all"))


def _alpaca_over_calls(fixed: bool) -> dict[str, Any]:
    """alpaca_farm#57 as first rebuilt: one micro-batch per call of the step, the accumulating
    optimizer wrapper counting the calls and stepping on every second."""
    model = zoo_update.seeded(zoo_update.MLP)
    opt = zoo_update.SyncedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), k=2)

    def step(policy: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        loss = ce(policy, batch) / opt.k
        loss.backward()
        opt.step()
        opt.zero_grad() if fixed else policy.zero_grad(set_to_none=True)  # BUG: every call
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=zoo_update.features(4), step=step)


def test_an_optimizer_wrapper_stepping_every_kth_call_is_judged_at_its_step() -> None:
    d = examine(**_alpaca_over_calls(False), checks="all")
    assert severities(d, "gradient_discarded") == ["error"], d
    setup = _alpaca_over_calls(True)
    no_alarm(examined_untouched(setup, checks="all"))
    assert setup["optimizer"].calls == 0  # the wrapper's own counter is put back


def test_a_step_that_never_reaches_optimizer_step_is_not_judged() -> None:
    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        loss = ce(model, batch) / 16
        loss.backward()  # accumulation over 16 calls, longer than the doctor follows
        return loss.detach()

    (f,) = examine(**mlp_setup(step=step), checks=["params_unchanged"]).findings
    assert f.severity == "info" and f.evidence.startswith("not checked: none of 8 calls"), f


def test_a_zero_learning_rate_is_named_at_the_call_that_steps() -> None:
    calls = {"n": 0}

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        (ce(model, batch) / 2).backward()
        calls["n"] += 1
        if calls["n"] % 2 == 0:
            opt.step()
            opt.zero_grad()
        return torch.zeros(())

    setup = mlp_setup(step=step)
    for g in setup["optimizer"].param_groups:
        g["lr"] = 0.0
    (f,) = examine(**setup, checks=["params_unchanged"]).findings
    assert f.severity == "error", f
    assert f.evidence == (
        "4 parameter(s) had a nonzero gradient at the optimizer.step() of call 2 and did not change"
    ), f


def _sam_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """SAM: the first gradient moves the weights to a nearby worst case, is cleared, and the
    gradient there is applied from the original weights."""
    opt.zero_grad()
    ce(model, batch).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    with torch.no_grad():
        norm = torch.norm(torch.stack([p.grad.norm() for p in params]))
        eps = [0.05 * p.grad / (norm + 1e-12) for p in params]
        for p, e in zip(params, eps, strict=True):
            p.add_(e)
    opt.zero_grad()
    loss = ce(model, batch)
    loss.backward()
    with torch.no_grad():
        for p, e in zip(params, eps, strict=True):
            p.sub_(e)
    opt.step()
    return loss.detach()


def _logged_norm_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """A clip with an infinite limit after the step: it only measures the norm for a log."""
    opt.zero_grad()
    loss = ce(model, batch)
    loss.backward()
    opt.step()
    torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    return loss.detach()


def _frozen_clip_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """Clipping a list of parameters of which none has a gradient (a frozen part) is harmless."""
    opt.zero_grad()
    loss = ce(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([nn.Parameter(torch.zeros(3))], 1.0)
    torch.nn.utils.clip_grad_value_(model.parameters(), 10.0)
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("step", [_sam_step, _frozen_clip_step], ids=_id)
def test_a_path_reordered_on_purpose_gets_no_alarm(step: Any) -> None:
    no_alarm(examined_untouched(mlp_setup(step=step), checks="all"))


def test_a_clip_with_an_infinite_limit_only_measures() -> None:
    # (numerics' nonfinite_forward still flags the inf inside clip_grad_norm_: not this family)
    no_alarm(examined_untouched(mlp_setup(step=_logged_norm_step), checks=KINDS))


def _two_optimizers(detach: bool) -> dict[str, Any]:
    """Two networks, the second's loss flowing into the first unless detached; each step
    zeroes its own optimizer: the other one's pending gradient is thrown away by design."""
    torch.manual_seed(0)
    enc, head = nn.Linear(8, 8), nn.Linear(8, 4)
    model = nn.Sequential(enc, head)
    opts = [torch.optim.SGD(enc.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)]

    def step(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        h = enc(x)
        opts[1].zero_grad()
        F.cross_entropy(head(h.detach() if detach else h), y).backward(retain_graph=True)
        opts[1].step()
        opts[0].zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opts[0].step()
        return loss.detach()

    return mlp_setup(model=model, optimizer=opts, step=step)


@pytest.mark.parametrize("detach", [True, False])
def test_another_optimizers_gradient_cleared_after_a_step_is_not_a_discard(detach: bool) -> None:
    d = examine(**_two_optimizers(detach), checks=KINDS)
    assert not [f for f in d.findings if f.severity != "info"], d


def test_a_clip_misplaced_in_a_helper_is_found_at_each_line_once() -> None:
    d = examine(**zoo_update.setup_clip_after_step(False), checks=["clip_misplaced"])
    assert len(d.findings) == 1 and "call 1 of your step" in d.findings[0].evidence, d


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_update.HELD_OUT, ids=_id)
def test_held_out_report_is_named(kind: str, make: Any, severity: str) -> None:
    d = examine(**make(False), checks="all")
    assert severities(d, kind) == [severity], d


@pytest.mark.parametrize(("kind", "make", "severity"), zoo_update.HELD_OUT, ids=_id)
def test_held_out_twin_is_clean_and_untouched(kind: str, make: Any, severity: str) -> None:
    no_alarm(examined_untouched(make(True), checks="all"))


def _ppo_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """PPO's clipped surrogate: ratio (exp of a log-prob difference) times a detached
    advantage, an entropy bonus; the value loss on its own."""
    s, a, ret = batch
    logits, value = model(s)
    dist = torch.distributions.Categorical(logits=logits, validate_args=False)
    logp = dist.log_prob(a)
    ratio = torch.exp(logp - logp.detach() + 0.1)
    adv = (ret - value).detach()
    surrogate = torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    loss = -surrogate.mean() + 0.5 * F.mse_loss(value, ret) - 0.01 * dist.entropy().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _focal_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """Focal loss by hand: (1 - p)^2 * log p, p from the same log-probabilities."""
    x, y = batch
    logp = F.log_softmax(model(x), -1).gather(1, y[:, None]).squeeze(1)
    loss = -((1 - logp.exp()) ** 2 * logp).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _learned_weight_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """A learned scalar weight on a hand-written log-likelihood (uncertainty weighting)."""
    x, y = batch
    logp = F.log_softmax(model(x), -1).gather(1, y[:, None]).squeeze(1)
    s = model.fc2.bias[0]
    loss = -(torch.exp(-s) * logp).mean() + s
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _gated_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """A swish gate on the logits (x * sigmoid(x)) before a log-softmax loss: no policy term."""
    x, y = batch
    h = model(x)
    logp = F.log_softmax(h * torch.sigmoid(h), -1)
    loss = F.nll_loss(logp, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def test_policy_terms_that_are_right_get_no_alarm() -> None:
    no_alarm(examined_untouched(zoo_update.ac_setup(_ppo_step, shared=True), checks=KINDS))
    for step in (_focal_step, _learned_weight_step, _gated_step):
        no_alarm(examined_untouched(mlp_setup(step=step), checks=KINDS))


def test_the_advantage_check_names_the_parameters_it_moved() -> None:
    (f,) = examine(
        **zoo_update.setup_actor_critic_summed(False), checks=["advantage_not_detached"]
    ).findings
    assert "ends with 3 parameter(s) different (critic.0.bias, critic.0.weight, critic." in (
        f.evidence
    ), f


# -- an optimizer its loss does not reach: unused_parameter's error ---------------------------


def _line_of(fn: Any, text: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    return f"{start + next(i for i, s in enumerate(lines) if text in s)}"


def test_a_generator_stepped_on_a_detached_fake_is_named_at_its_step() -> None:
    d = examine(**zoo_update.setup_gan_generator_detached(False), checks="all")
    assert [(f.kind, f.severity) for f in d.findings if f.severity != "info"] == [
        ("unused_parameter", "error")
    ], d  # not gradient_discarded: D's gradient from g_loss was handed to og.step()
    (f,) = d.of("unused_parameter")
    line = _line_of(zoo_update.setup_gan_generator_detached, "og.step()")
    assert f.where == f"tests/doctor/zoo_update.py:{line}", f
    assert f.evidence.startswith(
        "optimizer 0 (Adam over G.0.weight, G.0.bias, G.2.weight (+1 more): 4 parameter(s) with "
        "requires_grad) ran step() 4 time(s) in 4 call(s) of your step"
    ), f
    assert "sent gradient to 4 parameter(s) of optimizer 1 (D.0.weight" in f.evidence, f
    assert "fake.detach()" in f.fix and "torch.no_grad()" in f.fix, f


def test_a_loss_given_requires_grad_by_hand_reaches_no_parameter() -> None:
    (f,) = examine(
        **zoo_update.setup_gan_discriminator_no_grad(False), checks=["unused_parameter"]
    ).findings
    assert f.severity == "error" and "reached no parameter at all" in f.evidence, f


def _one_network_no_grad(fixed: bool) -> dict[str, Any]:
    """arcface-pytorch#56's form on one network: the forward of an evaluation helper under
    torch.no_grad(), `loss.requires_grad = True` to silence backward."""

    @torch.no_grad()
    def predict(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=False)  # zeroed grads, not None: still unchanged by backward
        loss = F.cross_entropy(model(x) if fixed else predict(model, x), y)
        if not fixed:
            loss.requires_grad = True
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # rewrites the zeros in place
        opt.step()
        return loss.detach()

    return mlp_setup(step=step)


def test_one_optimizer_that_no_gradient_reaches_is_an_error() -> None:
    d = examine(**_one_network_no_grad(False), checks=["unused_parameter"])
    assert severities(d, "unused_parameter") == ["error"], d
    assert d.findings[0].evidence.startswith("optimizer 0 (AdamW over fc1.weight"), d
    no_alarm(examined_untouched(_one_network_no_grad(True), checks="all"))


def _ddpg(rebuilt: bool) -> dict[str, Any]:
    """DDPG's actor update through the critic; the bug hands the critic actor(s).data."""
    torch.manual_seed(0)
    actor, critic = nn.Linear(8, 2), nn.Linear(10, 1)
    model = nn.ModuleDict({"actor": actor, "critic": critic})
    opts = [torch.optim.Adam(actor.parameters(), 1e-3), torch.optim.Adam(critic.parameters(), 1e-3)]

    def step(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
        actor_opt, critic_opt = opts
        s, a, r = batch
        critic_opt.zero_grad()
        critic_loss = F.mse_loss(critic(torch.cat([s, a], 1)).squeeze(1), r)
        critic_loss.backward()
        critic_opt.step()
        action = actor(s).data if rebuilt else actor(s)  # BUG (rebuilt): a tensor with no graph
        actor_opt.zero_grad()
        actor_loss = -critic(torch.cat([s, action], 1)).mean()
        actor_loss.backward()
        actor_opt.step()
        return critic_loss.detach()

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g),
                torch.randn(8, generator=g)) for _ in range(3)]  # fmt: skip
    return dict(model=model, optimizer=opts, batches=batches, step=step, loss_falls=False)


def test_an_action_rebuilt_from_data_starves_the_actor() -> None:
    (f,) = examine(**_ddpg(True), checks=["unused_parameter"]).findings
    assert f.severity == "error" and f.evidence.startswith("optimizer 0 (Adam over actor."), f
    assert "sent gradient to 2 parameter(s) of optimizer 1 (critic." in f.evidence, f
    no_alarm(examined_untouched(_ddpg(False), checks="all"))


def _gan(g_step: Any) -> dict[str, Any]:
    model = zoo_update.seeded(zoo_update.GAN)
    opts = [torch.optim.Adam(model.G.parameters(), 2e-4), torch.optim.Adam(model.D.parameters())]
    turns = [(x, y, i % 2 == 1) for i, (x, y) in enumerate(zoo_update.features(4))]
    return dict(model=model, optimizer=opts, batches=turns, step=g_step, task="gan")


def _bce(score: torch.Tensor, label: float) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(score, torch.full_like(score, label))


def _frozen_d_step(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
    """pytorch-CycleGAN-and-pix2pix's set_requires_grad(netD, False) for the generator's step:
    D gets no gradient there, G does."""
    og, od = opts
    real = batch[0]
    fake = model.G(torch.randn(len(real), 4))
    model.D.requires_grad_(True)
    od.zero_grad()
    (_bce(model.D(real), 1.0) + _bce(model.D(fake.detach()), 0.0)).backward()
    od.step()
    model.D.requires_grad_(False)
    og.zero_grad()
    g_loss = _bce(model.D(fake), 1.0)
    g_loss.backward()
    og.step()
    model.D.requires_grad_(True)
    return g_loss.detach()


def _idle_steps(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
    """The generator's backward on every second batch, its optimizer's step on every batch (a
    step with nothing to apply on the others)."""
    og, od = opts
    real, _, generator_turn = batch
    fake = model.G(torch.randn(len(real), 4))
    od.zero_grad()
    (_bce(model.D(real), 1.0) + _bce(model.D(fake.detach()), 0.0)).backward()
    od.step()
    og.zero_grad()
    if generator_turn:
        _bce(model.D(fake), 1.0).backward()
    og.step()
    return fake.detach().mean()


def _hand_written_grads(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
    """G's gradient by torch.autograd.grad, written into .grad by hand, after D's backward."""
    og, od = opts
    real = batch[0]
    fake = model.G(torch.randn(len(real), 4))
    od.zero_grad()
    (_bce(model.D(real), 1.0) + _bce(model.D(fake.detach()), 0.0)).backward()
    od.step()
    og.zero_grad()
    grads = torch.autograd.grad(_bce(model.D(fake), 1.0), list(model.G.parameters()))
    for p, g in zip(model.G.parameters(), grads, strict=True):
        p.grad = g
    og.step()
    return fake.detach().mean()


@pytest.mark.parametrize(
    "step",
    [_frozen_d_step, _idle_steps, _hand_written_grads],
    ids=["frozen_discriminator", "idle_steps", "hand_written_grads"],
)
def test_gans_whose_generator_trains_get_no_alarm(step: Any) -> None:
    no_alarm(examined_untouched(_gan(step), checks="all"))


def test_a_partly_unused_model_stays_a_warning_named_by_its_parameters() -> None:
    model = zoo_update.seeded(lambda: zoo_update.MLP(unused=True))
    (f,) = examine(**mlp_setup(model=model, optimizer=torch.optim.AdamW(model.parameters())),
                   checks=["unused_parameter"]).findings  # fmt: skip
    assert (f.severity, f.where) == ("warning", "extra.weight, extra.bias"), f


def _d_accumulating(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
    """The discriminator over two micro-batches, zero_grad inside their loop (the bug), then
    the generator's step: no step ran between the first backward and that zero_grad."""
    og, od = opts
    real = batch[0]
    fake = model.G(torch.randn(len(real), 4))
    for r, f in zip(real.chunk(2), fake.detach().chunk(2), strict=True):
        od.zero_grad()  # BUG: clears the first micro-batch's gradient
        ((_bce(model.D(r), 1.0) + _bce(model.D(f), 0.0)) / 2).backward()
    od.step()
    og.zero_grad()
    _bce(model.D(fake), 1.0).backward()
    og.step()
    return fake.detach().mean()


def test_a_micro_batch_cleared_before_any_step_is_still_discarded_beside_a_gan() -> None:
    (f,) = examine(**_gan(_d_accumulating), checks=["gradient_discarded"]).findings
    assert f.severity == "error" and "1 earlier backward pass(es)" in f.evidence, f
    line = _line_of(_d_accumulating, "od.zero_grad()")
    assert f.where == f"tests/doctor/test_update_family.py:{line}", f


# -- a loss term that trains nothing while the rest of the loss trains: loss_term_unused ------


def _alarms(d: Any) -> list[tuple[str, str]]:
    return [(f.kind, f.severity) for f in d.findings if f.severity != "info"]


def test_an_adversarial_term_cut_beside_an_l1_term_is_named_at_its_line() -> None:
    make = zoo_update.setup_image2reverb_adversarial_cut
    d = examine(**make(False), checks="all")
    assert _alarms(d) == [("loss_term_unused", "error")], d  # G trains: no unused_parameter
    (f,) = d.of("loss_term_unused")
    at = f"tests/doctor/zoo_update.py:{_line_of(make, 'G_loss1 = F.mse_loss')}"
    assert f.where == at and f.evidence.startswith(f"mse_loss at {at} is a term of the loss "), f
    assert (
        "its gradient reaches only D.0.weight, D.0.bias, D.2.weight (+1 more) (optimizer "
        "1's), which optimizer 0's step at tests/doctor/zoo_update.py:"
        f"{_line_of(make, 'g_optim.step()')} did not update, and which the zero_grad at "
        f"tests/doctor/zoo_update.py:{_line_of(make, 'd_optim.zero_grad()')} cleared" in f.evidence
    )
    assert "trains nothing" in f.evidence and "(4 of 4 call(s) of your step)" in f.evidence, f
    assert "that backward trained 4 parameter(s) through the rest of its loss (G.0.weight" in (
        f.evidence
    ), f
    assert "D(fake), not D(fake.detach())" in f.fix, f


def test_a_term_on_a_detached_prediction_has_no_graph_and_is_named() -> None:
    make = zoo_update.setup_csa_cdgan_prediction_detached
    d = examine(**make(False), checks="all")
    assert _alarms(d) == [("loss_term_unused", "error")], d
    (f,) = d.of("loss_term_unused")
    assert f.where == f"tests/doctor/zoo_update.py:{_line_of(make, 'err_d_fake = l_bce')}", f
    assert f.evidence.startswith("binary_cross_entropy at "), f
    assert "but it has no autograd graph" in f.evidence and "trains nothing" in f.evidence, f
    assert "(netg.0.weight, netg.0.bias, netg.2.weight (+1 more), optimizer 0's)" in f.evidence


def _g_turn(cut: str, freeze: bool = False) -> Any:
    """A GAN's two turns; the generator's loss is an adversarial term beside an L1 term (to the
    real batch's first 8 features), the adversarial term cut by `cut` unless it is "none"."""

    def step(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
        og, od = opts
        real = batch[0]
        fake = model.G(torch.randn(len(real), 4))
        od.zero_grad()
        (_bce(model.D(real), 1.0) + _bce(model.D(fake.detach()), 0.0)).backward()
        od.step()
        model.D.requires_grad_(not freeze)  # pytorch-CycleGAN-and-pix2pix's set_requires_grad
        og.zero_grad()
        if cut == "no_grad":
            with torch.no_grad():
                score = model.D(fake)
        else:
            score = model.D(fake.detach() if cut == "detach" else fake)
        g_loss = _bce(score, 1.0) + 10 * F.l1_loss(fake, real)
        g_loss.backward()
        og.step()
        model.D.requires_grad_(True)
        return g_loss.detach()

    return step


@pytest.mark.parametrize(("cut", "freeze", "graph"), [
    ("detach", True, False),  # D frozen as well: the cut term reaches no leaf at all
    ("no_grad", False, False),
])  # fmt: skip
def test_other_cuts_of_the_adversarial_term_are_named(cut: str, freeze: bool, graph: bool) -> None:
    d = examine(**_gan(_g_turn(cut, freeze)), checks="all")
    assert _alarms(d) == [("loss_term_unused", "error")], d
    (f,) = d.of("loss_term_unused")
    # the helper's line, and the step's line it was called from
    assert f.where == f"tests/doctor/test_update_family.py:{_line_of(_bce, 'return F.')}", f
    called = f"(called from tests/doctor/test_update_family.py:{_line_of(_g_turn, 'g_loss = ')})"
    assert called in f.evidence and ("has no autograd graph" in f.evidence) != graph, f


@pytest.mark.parametrize("freeze", [False, True], ids=["trainable_d", "frozen_d"])
def test_an_adversarial_term_that_reaches_the_generator_gets_no_alarm(freeze: bool) -> None:
    no_alarm(examined_untouched(_gan(_g_turn("none", freeze)), checks="all"))


def test_a_single_cut_term_stays_unused_parameter_s_alone() -> None:
    d = examine(**zoo_update.setup_gan_generator_detached(False), checks=["loss_term_unused"])
    assert not d.findings, d  # the backward trained nothing: one cause, one finding


class _EncoderHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


def _two_parts(step: Any) -> dict[str, Any]:
    model = zoo_update.seeded(_EncoderHead)
    opts = [torch.optim.AdamW(model.enc.parameters(), 1e-3),
            torch.optim.AdamW(model.head.parameters(), 1e-3)]  # fmt: skip
    return dict(model=model, optimizer=opts, batches=zoo_update.features(3), step=step)


def _regularized(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
    """A term that regularizes the encoder only, both optimizers stepped after one backward,
    and metrics that are never backwarded (under no_grad, and on detached tensors)."""
    x, y = batch
    for o in opts:
        o.zero_grad()
    h = model.enc(x)
    logits = model.head(h)
    loss = F.cross_entropy(logits, y) + 1e-3 * F.mse_loss(h, torch.zeros_like(h))
    with torch.no_grad():
        F.l1_loss(logits, torch.zeros_like(logits))
    logged = F.mse_loss(logits.detach(), torch.zeros_like(logits))
    loss.backward()
    for o in opts:
        o.step()
    return logged


def _pcgrad(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
    """Each task's gradient read by hand between zero_grads, their sum written into .grad."""
    x, y = batch
    params = list(model.parameters())
    logits = model(x)
    grads = []
    for task in (F.cross_entropy(logits, y), F.mse_loss(logits, torch.zeros_like(logits))):
        for o in opts:
            o.zero_grad()
        task.backward(retain_graph=True)
        grads.append([p.grad.clone() for p in params])
    for p, *gs in zip(params, *grads, strict=True):
        p.grad = sum(gs)
    for o in opts:
        o.step()
    return logits.detach().mean()


def _fgsm(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
    """Adversarial training: a backward for the input's gradient, zero_grad, the loss on the
    perturbed input."""
    x, y = batch
    x = x.clone().requires_grad_(True)
    F.cross_entropy(model(x), y).backward()
    x_adv = (x + 0.1 * x.grad.sign()).detach()
    for o in opts:
        o.zero_grad()
    loss = F.cross_entropy(model(x_adv), y)
    loss.backward()
    for o in opts:
        o.step()
    return loss.detach()


def test_loss_terms_that_train_what_a_step_updates_get_no_alarm() -> None:
    no_alarm(examined_untouched(_two_parts(_regularized), checks="all"))


@pytest.mark.parametrize("step", [_pcgrad, _fgsm], ids=_id)
def test_a_gradient_read_by_hand_before_a_zero_grad_is_no_dead_term(step: Any) -> None:
    """Nor a discarded one: PCGrad's applied gradient is no later backward's alone, and FGSM's
    first backward is for the input's gradient (a leaf no optimizer holds)."""
    d = examined_untouched(_two_parts(step), checks=[*KINDS, "unused_parameter"])
    no_alarm(d)
    assert d.of("gradient_discarded") == [], d


@pytest.mark.xfail(
    strict=True,
    reason="held-out miss, kept as tested once: the latent term is a hand-written L2 loss, and "
    "the same tensor trains D in D's own backward (a term is judged over every backward)",
)
@pytest.mark.parametrize(("kind", "make"), zoo_update.MISSED, ids=_id)
def test_a_missed_held_out_report_is_named(kind: str, make: Any) -> None:
    d = examine(**make(False), checks="all")
    assert severities(d, kind) == ["error"], d


@pytest.mark.parametrize(("kind", "make"), zoo_update.MISSED, ids=_id)
def test_a_missed_held_out_report_s_twin_is_clean_and_untouched(kind: str, make: Any) -> None:
    no_alarm(examined_untouched(make(True), checks="all"))


# -- a zero_grad that throws away gradients the step used otherwise ---------------------------
def _micro_batches(bug: bool, *, clip: bool = False, scaler: bool = False) -> dict[str, Any]:
    """zero_grad inside the micro-batch loop, as in RAE#67, behind a clip or a GradScaler."""
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**4, enabled=scaler)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            if bug:
                opt.zero_grad()  # BUG: clears the micro-batch before
            amp.scale(F.cross_entropy(model(xs), ys) / 2).backward()
        amp.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # it clips every step
        amp.step(opt)
        amp.update()
        return torch.zeros(())

    return mlp_setup(step=step)


@pytest.mark.parametrize("behind", ["clip", "scaler", "both"])
def test_a_discarded_micro_batch_behind_a_clip_or_a_scaler_is_named(behind: str) -> None:
    kw = dict(clip=behind in ("clip", "both"), scaler=behind in ("scaler", "both"))
    (f,) = examine(**_micro_batches(True, **kw), checks=["gradient_discarded"]).findings
    assert f.severity == "error" and "1 earlier backward pass(es)" in f.evidence, f
    no_alarm(examined_untouched(_micro_batches(False, **kw), checks="all"))


def _gradient_surgery(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """Two tasks' gradients read one at a time (PCGrad's shape), the first kept, cleared,
    and added back by hand onto the second's, projected where they conflict."""
    x, y = batch
    out = model(x)
    opt.zero_grad()
    F.cross_entropy(out, y).backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    opt.zero_grad()
    out.pow(2).mean().backward()
    dot = sum((a * p.grad).sum() for a, p in zip(first, model.parameters(), strict=True))
    norm = sum(p.grad.pow(2).sum() for p in model.parameters())
    with torch.no_grad():
        for a, p in zip(first, model.parameters(), strict=True):
            p.grad += a - torch.clamp(dot, max=0.0) / norm * p.grad  # sync-free projection
    opt.step()
    return out.detach().sum()


def test_a_gradient_added_back_onto_a_pending_one_is_not_discarded() -> None:
    d = examined_untouched(mlp_setup(step=_gradient_surgery), checks="all")
    no_alarm(d)
    assert d.of("gradient_discarded") == [], d
