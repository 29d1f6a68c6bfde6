"""The doctor is trusted: correct setups people really run get no error and no warning, and
examine leaves the caller's objects (model, optimizers, schedulers, RNG, flags) bit for bit."""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

import pytest
import torch
from tests.doctor import correct, zoo

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


@pytest.mark.parametrize("name", sorted(correct.SETUPS))
def test_a_correct_unusual_setup_gets_no_error_and_no_warning(name: str) -> None:
    setup = correct.SETUPS[name]()
    d = examined_untouched(setup, checks="all")
    no_alarm(d)
    assert not d.of("doctor_error"), d
    if name in EXPECTED:
        kind, where, evidence = EXPECTED[name]
        (f,) = d.of(kind)
        assert f.severity == "info" and where in f.where, d
        assert evidence in f.evidence + " " + f.fix


EXPECTED = {  # name -> (kind, where, words of its evidence or fix): what the info says
    "bias_before_batchnorm": ("params_unchanged", "0.bias", "feed a batch-statistics norm (1)"),
    "gan": ("cannot_overfit", "overfit", "not checked: several optimizers"),
    "gru_compiled": ("graph_break", "<model> (GRUClassifier)", "allow_rnn=True"),
    "t5": ("overflow_risk", "modeling_t5.py:", "(inside an installed library, not your code)"),
}


def test_lora_zero_init_is_followed_over_steps_not_reported() -> None:
    d = examine(**correct.lora(), checks=["params_unchanged", "unused_parameter"])
    assert d.findings == [], d


def test_a_graph_network_mixing_rows_is_information_and_a_declaration_silences_the_guess() -> None:
    (f,) = examine(**correct.gnn(), checks=["batch_mixing"]).findings
    assert f.severity == "info" and "x[idx] (integer indexing) over dim 0" in f.evidence
    assert f.where == correct_line("self.msg(x)[src]")
    (g,) = examine(**correct.gnn(samples_interact=True), checks=["batch_mixing"]).findings
    assert g.severity == "info" and g.evidence.endswith("as declared: samples_interact=True")


def test_a_sync_inside_the_models_forward_is_information_with_its_line() -> None:
    found = examine(**correct.moe(), checks=["host_sync"]).of("host_sync")
    assert {f.severity for f in found} == {"info"}
    assert correct_line("int(torch.ceil(") in {f.where for f in found}
    assert all("inside the model's forward" in f.evidence for f in found)


def correct_line(text: str) -> str:
    """`tests/doctor/correct.py:N` of the first line holding `text`."""
    lines = inspect.getsource(correct).splitlines()
    return f"tests/doctor/correct.py:{1 + next(i for i, s in enumerate(lines) if text in s)}"


def test_compile_findings_are_warnings_only_where_the_setup_compiles() -> None:
    def branchy() -> dict[str, Any]:
        model = zoo.seeded(lambda: zoo.BranchyNet(bug=True))
        return zoo.mlp_setup(model=model, optimizer=zoo.adamw(model))

    never = examine(**branchy(), checks="all").of("graph_break")
    assert [f.severity for f in never] == ["info"]
    assert never[0].evidence.endswith("(your setup does not compile: this matters once it does)")
    assert never[0].fix.startswith("replace the Python `if` on a tensor with torch.where")
    asked = examine(**branchy(), checks=["graph_break"]).of("graph_break")
    compiled = branchy()
    compiled["model"].blocks[0].compile(backend="eager")
    assert [f.severity for f in asked] == ["warning"]
    assert [f.severity for f in examine(**compiled, checks="all").of("graph_break")] == ["warning"]


def test_an_lstm_in_a_script_that_never_compiles_is_information_naming_allow_rnn() -> None:
    model = zoo.seeded(correct.GRUClassifier)
    model.gru = torch.nn.LSTM(8, 16, batch_first=True)
    setup = {**correct.gru_compiled(), "model": model, "optimizer": zoo.adamw(model)}
    (f,) = examine(**setup, checks="all").of("graph_break")
    assert f.severity == "info" and "allow_rnn=True" in f.fix and ".item()" not in f.fix


def test_an_accumulation_step_returning_its_scaled_loss_is_judged_on_its_cross_entropy() -> None:
    def step(model: torch.nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(batch[0].chunk(4), batch[1].chunk(4), strict=True):
            loss = torch.nn.functional.cross_entropy(model(xs), ys) / 4  # as nanoGPT scales it
            loss.backward()
        opt.step()
        return loss.detach()  # the last micro-batch's scaled loss: ~ln(4) / 4

    d = examine(**zoo.mlp_setup(step=step), checks=["loss_at_init", "accumulation_scale"])
    assert d.findings == [], d


def test_the_state_a_step_keeps_in_globals_is_put_back_between_checks_and_at_the_end() -> None:
    from tests.doctor import zoo_reports

    setup = zoo_reports.setup_hidden(True)  # carries an RNN's hidden state in a global dict
    zoo_reports.RUNNING["h"] = h = torch.zeros(1, 4, 16)
    zoo.LOGGED[:] = [1.0]
    d = examine(**setup, checks="all")
    no_alarm(d)  # each check starts from the same hidden state: no "nondeterminism"
    assert zoo_reports.RUNNING["h"] is h and not h.any()
    examine(**zoo.mlp_setup(step=zoo.step_with_item), checks=["host_sync", "cannot_overfit"])
    assert zoo.LOGGED == [1.0]  # the step appended dozens of losses; the list is as it was
    examine(**zoo.mlp_setup(step=_counting_step), checks=["nondeterminism", "cannot_overfit"])
    assert STEPS_TAKEN.item() == 0  # a global tensor written in place has its value back


STEPS_TAKEN = torch.zeros((), dtype=torch.long)


def _counting_step(model: torch.nn.Module, opt: Any, batch: Any) -> torch.Tensor:
    STEPS_TAKEN.add_(1)  # a step counter kept in a global tensor, written in place
    return zoo.good_step(model, opt, batch)


def test_a_sync_inside_a_torch_module_is_torchs_not_the_users() -> None:
    class AdaptiveHead(torch.nn.Module):  # its forward selects rows per cluster: nonzero()
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 16)
            self.head = torch.nn.AdaptiveLogSoftmaxWithLoss(16, 10, cutoffs=[4])

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.head(self.fc(x), y).loss

    model = zoo.seeded(AdaptiveHead)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 8, generator=g), torch.randint(0, 10, (8,), generator=g))] * 2
    d = examine(model, zoo.adamw(model), batches, loss_fn=lambda m, b: m(*b),
                checks=["host_sync"])  # fmt: skip
    assert d.of("host_sync") and {f.severity for f in d.findings} == {"info"}, d
    assert all("inside an installed library" in f.evidence for f in d.findings)
