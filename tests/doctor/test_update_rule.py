"""The update each parameter receives against its optimizer's own rule, replayed: an update
applied twice and an update rounded away are named with what was measured; correct code that
moves parameters after the step on purpose, or steps them in unusual ways, gets no alarm."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tests.doctor import zoo_update
from tests.doctor.test_trust import examined_untouched, no_alarm
from tests.doctor.zoo import MLP, ce, good_step, lm_setup, mlp_setup, seeded
from torch import nn

from isotrain.doctor import examine

KINDS = ["update_applied_twice", "update_lost_to_rounding"]


def _line(fn: Any, text: str) -> str:
    lines, start = inspect.getsourcelines(fn)
    return f"zoo_update.py:{start + next(i for i, s in enumerate(lines) if text in s)}"


def _manual_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    loss = good_step(model, opt, batch)
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.01 * p.grad  # BUG: a second, hand-written update
    return loss


def test_each_form_of_an_update_applied_twice_says_how() -> None:
    (f,) = examine(**zoo_update.setup_manual_update_on_top(False), checks=KINDS).findings
    assert f.where.endswith(_line(zoo_update.setup_manual_update_on_top, "p.data.add_")), f
    assert "changed outside optimizer.step() by -0.05 x the gradient step() received" in (
        f.evidence
    ), f
    (f,) = examine(**zoo_update.setup_curl_encoder_two_optimizers(False), checks=KINDS).findings
    assert "received 2.00 x the update" in f.evidence and "two optimizers hold it" in f.evidence
    (f,) = examine(
        **zoo_update.setup_tianshou_listed_twice(False), checks=[*KINDS, "duplicate_parameter"]
    ).findings  # one cause, one finding: the listing, read from the groups
    assert (f.kind, f.where) == ("duplicate_parameter", "preprocess.0.bias, preprocess.0.weight")

    def twice(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        loss = good_step(model, opt, batch)
        opt.step()  # BUG: the same gradient again
        return loss

    (f,) = examine(**mlp_setup(step=twice), checks=KINDS).findings
    assert "(step() ran twice: AdamW at" in f.evidence, f


_VARIANTS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adam_for_loop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
}


@pytest.mark.parametrize("name", sorted(_VARIANTS))
def test_each_optimizer_s_rule_is_replayed_and_a_hand_written_update_named(name: str) -> None:
    no_alarm(examined_untouched(_with(_VARIANTS[name])(), checks=KINDS))
    d = examine(**_with(_VARIANTS[name], step=_manual_step)(), checks=KINDS)
    assert [f.severity for f in d.findings] == ["error"], d


# -- correct code: the parameters move after step() on purpose, or are stepped unusually ----


def _wgan_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """WGAN's critic: RMSprop, then every weight clipped into [-c, c]."""
    loss = good_step(model, opt, batch)
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)
    return loss


class Lookahead:
    """An optimizer wrapper holding an inner optimizer: after each inner step the weights move
    back towards a slow copy (k = 1)."""

    def __init__(self, optimizer: torch.optim.Optimizer, alpha: float = 0.5) -> None:
        self.optimizer, self.alpha = optimizer, alpha
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.slow = [p.detach().clone() for p in self.params]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self) -> None:
        self.optimizer.step()
        with torch.no_grad():
            for p, s in zip(self.params, self.slow, strict=True):
                s.add_(p - s, alpha=self.alpha)
                p.copy_(s)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.optimizer.state_dict(), "slow": self.slow}


class ClippingAdam(torch.optim.Adam):
    """A subclass whose step() clips, then calls Adam's own (its step hooks then fire twice)."""

    def step(self, closure: Any = None) -> Any:
        params = [p for g in self.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        return super().step(closure)


class KahanSGD(torch.optim.Optimizer):
    """SGD for bfloat16 weights that keeps what rounding lost in a compensation buffer."""

    def __init__(self, params: Any, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                comp = self.state[p].setdefault("compensation", torch.zeros_like(p))
                new = p.float() - g["lr"] * p.grad.float() + comp.float()
                p.copy_(new)
                comp.copy_(new - p.float())  # what rounding to p's dtype lost


def _two_tasks_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """micro-sam#1331's joint trainer: two losses on a shared network, each with its own
    backward and step: two updates per call, each for its own gradient."""
    x, y = batch
    for loss_fn in (F.cross_entropy, lambda out, y: F.mse_loss(out.softmax(-1)[:, 0], y.float())):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    return loss.detach()


def _tied_lm() -> dict[str, Any]:
    setup = lm_setup()
    model = setup["model"]
    model.head.weight = model.wte.weight  # tied: model.parameters() lists it once
    return setup | {"optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}


def _muon() -> dict[str, Any]:
    model = seeded(MLP)
    matrices = [model.fc1.weight, model.fc2.weight]
    opts = [torch.optim.Muon(matrices, lr=0.02),
            torch.optim.AdamW([model.fc1.bias, model.fc2.bias], lr=1e-3)]  # fmt: skip
    return mlp_setup(model=model, optimizer=opts, step=_two_optimizers_step)


def _two_optimizers_step(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
    for o in opts:
        o.zero_grad()
    loss = ce(model, batch)
    loss.backward()
    for o in opts:
        o.step()
    return loss.detach()


class Bag(nn.Module):
    """A sparse embedding bag (sparse gradients) and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.EmbeddingBag(16, 8, sparse=True), nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _bag() -> dict[str, Any]:
    model = seeded(Bag)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 16, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g))
               for _ in range(2)]  # fmt: skip
    return dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                batches=batches, step=good_step)  # fmt: skip


def _kahan() -> dict[str, Any]:
    model = seeded(zoo_update.norm_mlp).to(torch.bfloat16)
    setup = zoo_update.setup_bf16_adam_no_master(False)
    return setup | {"model": model, "optimizer": KahanSGD(model.parameters(), lr=1e-3)}


def _scaled() -> dict[str, Any]:
    scaler = torch.amp.GradScaler("cpu")

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ce(model, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return mlp_setup(step=step)


def _with(make: Any, build: Any = MLP, **kw: Any) -> Any:
    """A factory of the MLP setup (or build()'s) stepped by make(its parameters)."""

    def setup() -> dict[str, Any]:
        model = seeded(build)
        return mlp_setup(model=model, optimizer=make(model.parameters()), **kw)

    return setup


torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # Adam.step is hooked: ClippingAdam's
# own step() and the Adam.step it calls both run the optimizer's step hooks

CORRECT = {
    "wgan_clipping": _with(lambda ps: torch.optim.RMSprop(ps, lr=5e-5), step=_wgan_step),
    "lookahead_wrapper": _with(lambda ps: Lookahead(torch.optim.SGD(ps, lr=0.1))),
    "subclass_calling_super_step": _with(lambda ps: ClippingAdam(ps, lr=1e-3)),
    "two_tasks_two_steps": lambda: mlp_setup(step=_two_tasks_step),
    "tied_weights_listed_once": _tied_lm,
    "muon_and_adamw": _muon,
    "unused_layer_no_gradient": _with(torch.optim.AdamW, lambda: MLP(unused=True)),
    "sparse_embedding_and_dense_head": _bag,
    "bf16_kahan_summation": _kahan,
    "grad_scaler": _scaled,
}


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_correct_code_gets_no_alarm_and_is_left_untouched(name: str) -> None:
    d = examined_untouched(CORRECT[name](), checks=KINDS)
    assert d.findings == [], d


def test_a_check_that_cannot_run_says_why() -> None:
    from tests.doctor import correct

    (f,) = examine(**correct.lbfgs(), checks=["update_applied_twice"]).findings
    assert f.severity == "info" and "optimizer.step(closure)" in f.evidence, f
    model = seeded(Bag)
    model.head.requires_grad_(False)
    setup = _bag() | {"model": model, "optimizer": torch.optim.SparseAdam(model.emb.parameters())}
    (f,) = examine(**setup, checks=["update_applied_twice"]).findings
    assert f.severity == "info" and "every gradient step() received was sparse" in f.evidence, f


class ScaledSGD(torch.optim.SGD):
    """An optimizer whose constructor needs an argument its defaults do not hold."""

    def __init__(self, params: Any, scale: float, lr: float = 0.1) -> None:
        self.scale = scale
        super().__init__(params, lr=lr * scale)


def test_an_optimizer_that_cannot_be_rebuilt_is_judged_without_its_rule() -> None:
    model = seeded(MLP)
    setup = mlp_setup(model=model, optimizer=ScaledSGD(model.parameters(), scale=0.5))
    assert examined_untouched(setup, checks=KINDS).findings == []  # float32: no rule needed
    d = examine(**(setup | {"step": _manual_step}), checks=KINDS)
    assert [f.severity for f in d.findings] == ["error"], d
