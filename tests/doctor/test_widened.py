"""Other instances of three kinds' bug classes: a graph kept in any container
(graph_retained), a schedule judged over the run's length (lr_collapse), and a float32
island inside an autocast region (autocast_not_applied). Each bug is named with its kind,
severity, place and evidence; each twin gets no error and no warning from any check and no
finding of its kind, and comes back untouched."""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from tests.doctor import zoo_precision, zoo_state
from tests.doctor.test_trust import examined_untouched, no_alarm
from tests.doctor.zoo import seeded

from isotrain.doctor import examine

CASES = zoo_state.WIDENED + [(k, m, s, "") for k, m, s in zoo_precision.ISLANDS]


def _id(v: Any) -> str:
    return getattr(v, "__name__", str(v))


@pytest.mark.parametrize(("kind", "make", "severity", "phrase"), CASES, ids=_id)
def test_the_bug_is_named_with_what_was_measured(
    kind: str, make: Any, severity: str, phrase: str
) -> None:
    (f,) = examine(**make(False), checks=[kind]).findings
    assert (f.kind, f.severity) == (kind, severity), f
    assert phrase in f.evidence, f
    assert f.where.startswith("tests/doctor/zoo_") or f"`{f.where}`" in f.evidence, f


@pytest.mark.parametrize(("kind", "make", "severity", "phrase"), CASES, ids=_id)
def test_the_twin_is_clean_and_untouched(kind: str, make: Any, severity: str, phrase: str) -> None:
    d = examined_untouched(make(True), checks="all")
    no_alarm(d)
    assert d.of(kind) == [], d


# -- graph_retained ---------------------------------------------------------------------------
def test_a_graph_kept_on_the_model_names_the_attribute_and_the_copy_it_breaks() -> None:
    setup = zoo_state.setup_output_on_the_model(False)
    (f,) = examine(**setup, checks=["graph_retained"]).findings
    assert f.evidence.startswith(
        "after each of 4 calls of your step, `model.last_out` holds a tensor with its autograd "
        "graph"
    ), f
    setup["step"](setup["model"], setup["optimizer"], setup["batches"][0])
    with pytest.raises(RuntimeError, match="graph leaves"):  # what the evidence says
        copy.deepcopy(setup["model"])


def test_a_hidden_state_carried_and_detached_next_step_is_not_named() -> None:
    """pytorch/examples word_language_model's repackage_hidden: the state keeps its graph
    until the next step detaches it, as the design wants."""
    model = zoo_state.seeded(zoo_state.SeqModel)
    state: dict[str, Any] = {}

    def keep(loss: torch.Tensor, seq: torch.Tensor) -> None:
        state["last"] = seq[:, -1]  # detached at the start of the next step, below

    setup = zoo_state.keeping(keep, model, zoo_state.setup_lstm_outputs(True)["batches"])
    inner = setup["step"]

    def step(model: Any, opt: Any, batch: Any) -> torch.Tensor:
        if "last" in state:
            state["last"] = state["last"].detach()
        return inner(model, opt, batch)

    d = examine(**{**setup, "step": step}, checks=["graph_retained"])
    assert d.findings == [], d


def test_a_legacy_spectral_norm_weight_is_not_a_kept_graph() -> None:
    """Its forward pre-hook sets the module's weight, with a graph, on every forward."""
    model = zoo_state.seeded(
        lambda: torch.nn.Sequential(
            torch.nn.utils.spectral_norm(torch.nn.Linear(8, 16)), torch.nn.ReLU(),
            torch.nn.Linear(16, 3),
        )
    )  # fmt: skip
    d = examined_untouched(zoo_state.keeping(lambda loss, out: None, model), checks="all")
    assert d.of("graph_retained") == [], d


# -- lr_collapse ------------------------------------------------------------------------------
def _undeclared(setup: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in setup.items() if k != "total_steps"}


def test_a_schedule_that_spends_itself_after_the_assumed_run_is_information() -> None:
    """ExponentialLR(0.9) per batch falls 100x after 44 batches: a collapse over the declared
    30 epochs, not judged over the one epoch (50 batches) assumed without total_steps."""
    setup = _undeclared(zoo_state.setup_exponential_per_batch(False))
    (f,) = examine(**setup, checks=["lr_collapse"]).findings
    assert f.severity == "info" and f.where == "tests/doctor/zoo_state.py:46", f
    assert f.evidence == (
        "not judged: the learning rate of param group 0 falls below 1/100 of its peak (0.1 -> "
        "0.00097) after 44 batches (ExponentialLR.step() x1 per batch), later than the first 40 "
        "of the 50 batches judged (one epoch of your DataLoader); in a run longer than 88 batches "
        "that is a collapse: pass total_steps= (the run's optimizer steps)"
    ), f


def test_the_steplr_meant_per_epoch_is_named_over_the_assumed_epoch_and_the_declared_run() -> None:
    """mnist's StepLR(1, 0.7) stepped per batch: 17x in the 8 traced steps, 1/100 at 13."""
    setup = zoo_state.setup_steplr_per_batch(False)
    (f,) = examine(**setup, checks=["lr_collapse"]).findings
    assert f.severity == "warning" and "after 13 of the run's 64 calls" in f.evidence, f
    assert "(one epoch of your DataLoader; pass total_steps= for the run's)" in f.evidence
    (f,) = examine(**setup, total_steps=14 * 64, checks=["lr_collapse"]).findings
    assert f.severity == "warning" and "after 13 of the run's 896 calls" in f.evidence, f


def test_a_per_epoch_schedule_of_an_unknown_run_is_information() -> None:
    setup = _undeclared(zoo_state.setup_exponential_per_batch(True))  # stepped once an epoch
    (f,) = examine(**setup, checks=["lr_collapse"]).findings
    assert f.severity == "info" and f.evidence.startswith(
        "not judged: the learning rate of param group 0 falls below 1/100 of its peak (0.1 -> "
        "0.00097) after 44 epochs (ExponentialLR.step() x1 per epoch), and your run's epochs "
        "are not known; in a run longer than 88 epochs that is a collapse"
    ), f


@pytest.mark.parametrize(
    "make",
    [zoo_state.setup_cosine_epochs_per_batch, zoo_state.setup_warmup_decay_per_batch],
    ids=_id,
)
def test_a_schedule_over_the_run_undeclared_is_at_most_information(make: Any) -> None:
    d = examine(**_undeclared(make(True)), checks=["lr_collapse"])
    assert [f.severity for f in d.findings] == ["info"], d
    assert "not judged" in d.findings[0].evidence


def test_a_onecycle_over_the_run_is_never_named() -> None:
    """Its own length bounds the run (it raises past it): nothing to pass total_steps= for."""
    setup = zoo_state.setup_onecycle_per_batch(True)
    assert examine(**_undeclared(setup), checks=["lr_collapse"]).findings == []


# -- autocast_not_applied ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("make", "what", "share"),
    [
        (zoo_precision.setup_block_in_fp32, "torch.autocast(enabled=False), inside", "(60%)"),
        (zoo_precision.setup_custom_fwd_mlp,
         "custom_fwd(cast_inputs=torch.float32) of FP32MLP.forward, inside", "(60%)"),
        (zoo_precision.setup_decorated_mlp,
         "@torch.autocast(enabled=False) on Block.mlp_fp32, inside", "(60%)"),
    ],
    ids=_id,
)  # fmt: skip
def test_a_float32_island_names_its_scope_and_its_share_of_the_matmuls(
    make: Any, what: str, share: str
) -> None:
    (f,) = examine(**make(False), checks=["autocast_not_applied"]).findings
    assert f.where.startswith("tests/doctor/zoo_precision.py:"), f
    assert f.evidence.startswith(what) and share in f.evidence, f
    assert "your autocast(cpu, bfloat16) region, runs 2 matmul-class op(s) per step" in f.evidence


@pytest.mark.parametrize("form", zoo_precision.DELIBERATE)
def test_float32_on_purpose_is_at_most_information(form: str) -> None:
    """A norm, a router, a z-loss's logsumexp, a custom op (torch autocasts its body) and the
    attention scores in float32 (pytorch#40497's fix: 8% of the matmul FLOPs, information)."""
    d = examined_untouched(zoo_precision.block_setup(form), checks="all")
    no_alarm(d)
    found = d.of("autocast_not_applied")
    if form == "attention_fp32":
        (f,) = found
        assert f.severity == "info" and "(8%)" in f.evidence and "float32 island" in f.evidence
    else:
        assert found == [], d


# -- what examine still leaves behind (ground/, not these checks) -----------------------------
def test_examine_leaves_a_deque_the_step_fills_as_it_found_it() -> None:
    window: deque[torch.Tensor] = deque(maxlen=100)
    setup = zoo_state.keeping(lambda loss, out: window.append(loss.detach()))
    examine(**setup, checks=["graph_retained"])
    assert len(window) == 0


def test_examine_leaves_no_attribute_the_step_set_on_the_model() -> None:
    def keep(loss: torch.Tensor, out: torch.Tensor) -> None:
        setup["model"].last_out = out  # a new attribute, with its graph

    setup = zoo_state.keeping(keep)
    examine(**setup, checks=["graph_retained"])
    assert not hasattr(setup["model"], "last_out")  # copy.deepcopy(model) raises while it is


def test_examine_rebinds_an_attribute_the_step_replaced_on_the_model() -> None:
    def keep(loss: torch.Tensor, out: torch.Tensor) -> None:
        setup["model"].last_out = out

    setup = zoo_state.keeping(keep)
    setup["model"].last_out = None
    examine(**setup, checks=["graph_retained"])
    assert setup["model"].last_out is None


def test_a_custom_op_on_mixed_dtype_inputs_is_run_as_torch_runs_it() -> None:
    """Inside the region a custom op gets a linear's bfloat16 output beside a float32 weight;
    torch autocasts the matmul in its body; every check's watch must run it so too."""
    setup = zoo_precision.block_setup("custom_op_mixed")
    setup["step"](setup["model"], setup["optimizer"], setup["batches"][0])  # runs in torch
    d = examined_untouched(zoo_precision.block_setup("custom_op_mixed"), checks="all")
    assert [f for f in d.findings if "raised" in f.evidence] == [], d
    no_alarm(d)


# -- held out from graph_retained's widening: rebuilt once it was done, tested once -------------
class _Stats:
    """NVIDIA/DeepLearningExamples#1102's stats helper: running values by name, on device."""

    def __init__(self) -> None:
        self.device_stats: dict[str, torch.Tensor] = {}

    def device_stat(self, name: str) -> torch.Tensor:
        return self.device_stats.setdefault(name, torch.zeros(()))


def _stats_average_loss(fixed: bool) -> dict[str, Any]:
    """https://github.com/NVIDIA/DeepLearningExamples/issues/1102: BERT pretraining's RAM
    grows every step: `stats.device_stat('average_loss').add_(loss)` adds the loss, with its
    graph, in place into a running tensor; the fix adds `loss.clone().detach()`."""
    stats = _Stats()
    return zoo_state.keeping(
        lambda loss, out: stats.device_stat("average_loss").add_(loss.detach() if fixed else loss)
    )


@dataclass
class _Output:
    """A Hugging Face style model output."""

    loss: torch.Tensor
    logits: torch.Tensor


class _WithLoss(torch.nn.Module):
    """A classifier that computes its own loss from labels, as a *ForSequenceClassification."""

    def __init__(self) -> None:
        super().__init__()
        self.net = zoo_state.classifier()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> _Output:
        logits = self.net(x)
        return _Output(torch.nn.functional.cross_entropy(logits, labels), logits)


def _ta_train_loss(fixed: bool) -> dict[str, Any]:
    """https://github.com/pai4451/ML2021/issues/2: the course's example loop sums
    `train_loss += output.loss` and the RAM grows until 64 GB are full; `.detach()` or
    `.item()` is the fix (`.item()` each step is a host sync: the twin detaches)."""
    running = {"train_loss": 0.0}

    def step(model: torch.nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        output = model(x, labels=y)
        opt.zero_grad()
        output.loss.backward()
        opt.step()
        running["train_loss"] += output.loss.detach() if fixed else output.loss
        return output.loss.detach()

    model = seeded(_WithLoss)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return dict(model=model, optimizer=opt, batches=list(zoo_state.loader(6)), step=step)


GRAPH_HELD_OUT = [_stats_average_loss, _ta_train_loss]


@pytest.mark.parametrize("make", GRAPH_HELD_OUT, ids=lambda m: m.__name__)
def test_held_out_graph_kept_is_named(make: Any) -> None:
    found = examine(**make(False), checks="all")
    assert [(f.kind, f.severity) for f in found.findings if f.severity != "info"] == [
        ("graph_retained", "warning")
    ], found


@pytest.mark.parametrize("make", GRAPH_HELD_OUT, ids=lambda m: m.__name__)
def test_held_out_graph_twin_is_clean_and_untouched(make: Any) -> None:
    no_alarm(examined_untouched(make(True), checks="all"))
