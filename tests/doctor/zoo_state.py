"""The state-across-steps family's zoo: each public report (state_reports.md) rebuilt as a
small setup beside its correct twin (`make(fixed)`: False is the report's bug)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from tests.doctor.zoo import seeded
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

Setup = Callable[[], dict[str, Any]]


def classifier() -> nn.Module:
    return seeded(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)))


def loader(n_batches: int, **kw: Any) -> DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * n_batches, 8, generator=g),
                         torch.randint(0, 3, (4 * n_batches,), generator=g))  # fmt: skip
    return DataLoader(data, batch_size=4, **kw)


def stepping(sched: Any, ema: Any = None, *, ema_first: bool = False) -> Callable[..., Any]:
    """A classifier step that steps `sched` per batch and updates `ema` before or after."""

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if ema is not None and ema_first:
            ema.update(model)
        opt.step()
        if ema is not None and not ema_first:
            ema.update(model)
        if sched is not None:
            sched.step()
        return loss.detach()

    return step


# -- lr_collapse ------------------------------------------------------------------------------
def setup_steplr_per_batch(fixed: bool) -> dict[str, Any]:
    """pytorch/examples mnist's StepLR(step_size=1, gamma=0.7), meant per epoch, moved into
    the batch loop (ivadomed#55's bug): 17x in 8 steps, 2e-8 after 50. Fixed: the same
    schedule counted in batches (step_size = batches per epoch) over mnist's 14 epochs,
    declared."""
    model, batches = classifier(), loader(64)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=len(batches) if fixed else 1,
                                            gamma=0.7)  # fmt: skip
    declared = {"total_steps": 14 * len(batches)} if fixed else {}
    return dict(model=model, optimizer=opt, batches=batches, step=stepping(sched), **declared)


def setup_cosine_per_batch(fixed: bool) -> dict[str, Any]:
    """A cosine over 20 epochs (T_max=20) stepped per batch over 100 batches an epoch: it
    reaches 0 in the first epoch, then starts over. Fixed: T_max in optimizer steps, the
    run's length declared."""
    model, batches, epochs = classifier(), loader(100), 20
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    t_max = epochs * len(batches) if fixed else epochs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
    declared = {"total_steps": t_max} if fixed else {}
    return dict(model=model, optimizer=opt, batches=batches, step=stepping(sched), **declared)


def stepping_epochs(sched: Any, *, per_batch: bool) -> Callable[..., Any]:
    """An epoch function (pytorch/examples mnist's train()) stepping `sched` inside the batch
    loop or once after it."""

    def epoch(model: nn.Module, opt: Any, loader: Any) -> None:
        model.train()
        for batch in loader:
            stepping(sched if per_batch else None)(model, opt, batch)
        if not per_batch:
            sched.step()

    return epoch


def setup_exponential_per_batch(fixed: bool) -> dict[str, Any]:
    """Planted, the form of pytorch/tutorials#640 (the transfer-learning tutorial's
    exp_lr_scheduler stepped per batch): ExponentialLR(0.9), meant per epoch, stepped in the
    batch loop of a 30-epoch run: 100x after 44 batches, within the first epoch of 50.
    Fixed: stepped once an epoch, the run declared."""
    model, batches = classifier(), loader(50)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    return dict(model=model, optimizer=opt, batches=batches, total_steps=30 * len(batches),
                epoch=stepping_epochs(sched, per_batch=not fixed))  # fmt: skip


def setup_cosine_epochs_per_batch(fixed: bool) -> dict[str, Any]:
    """ivadomed#55's form over a longer run: CosineAnnealingLR(T_max=90 epochs) stepped per
    batch, 50 batches an epoch, 90 epochs declared: 0 after 90 batches, then again and again.
    Fixed: T_max counted in optimizer steps (90 x 50)."""
    model, batches, epochs = classifier(), loader(50), 90
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    t_max = epochs * len(batches) if fixed else epochs
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=t_max)
    return dict(model=model, optimizer=opt, batches=batches, step=stepping(sched),
                total_steps=epochs * len(batches))  # fmt: skip


def setup_onecycle_per_batch(fixed: bool) -> dict[str, Any]:
    """A OneCycleLR over the run's optimizer steps, stepped per batch: right (its own length
    bounds the run). The bug: its total_steps given in epochs."""
    model, batches, epochs = classifier(), loader(50), 10
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = epochs * len(batches)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1,
                                                total_steps=steps if fixed else epochs)  # fmt: skip
    return dict(model=model, optimizer=opt, batches=batches, step=stepping(sched),
                total_steps=steps)  # fmt: skip


def setup_warmup_decay_per_batch(fixed: bool) -> dict[str, Any]:
    """A linear warm-up then linear decay to 0 (transformers' get_linear_schedule_with_warmup,
    written as a LambdaLR) over the run's optimizer steps, per batch. The bug: its length
    taken from the epochs."""
    model, batches, epochs = classifier(), loader(50), 10
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    total = epochs * len(batches) if fixed else epochs * 5
    warmup = total // 10

    def lr_at(i: int) -> float:
        return min((i + 1) / warmup, max(0.0, (total - i) / (total - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    return dict(model=model, optimizer=opt, batches=batches, step=stepping(sched),
                total_steps=epochs * len(batches))  # fmt: skip


# -- ema_off_decay, ema_before_step -----------------------------------------------------------
class ShadowEMA:
    """ai-toolkit's ExponentialMovingAverage shape: float shadows, s -= (1 - decay) * (s - p);
    `flipped` adds the gap instead (ai-toolkit#1034), `backwards` swaps decay and 1 - decay."""

    def __init__(self, model: nn.Module, decay: float = 0.99, *, flipped: bool = False,
                 backwards: bool = False) -> None:  # fmt: skip
        self.decay, self.flipped, self.backwards = decay, flipped, backwards
        self.shadow = {n: p.detach().clone().float() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        keep = 1 - self.decay if self.backwards else self.decay
        for n, p in model.named_parameters():
            gap = self.shadow[n] - p.float()
            if self.flipped:
                self.shadow[n].add_(gap * (1 - keep))
            else:
                self.shadow[n].sub_(gap * (1 - keep))


def _ema_setup(ema_kw: dict[str, Any], *, ema_first: bool = False) -> dict[str, Any]:
    model = classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = ShadowEMA(model, **ema_kw)
    return dict(model=model, optimizer=opt, batches=list(loader(4)),
                step=stepping(None, ema, ema_first=ema_first))  # fmt: skip


def setup_ema_sign(fixed: bool) -> dict[str, Any]:
    """ai-toolkit#1034: `sub_` turned into `add_`: the shadow runs away from the weights."""
    return _ema_setup({"flipped": not fixed})


def setup_ema_before_step(fixed: bool) -> dict[str, Any]:
    """The EMA updated between backward and optimizer.step(): it averages last step's weights."""
    return _ema_setup({}, ema_first=not fixed)


# -- sampler_epoch ----------------------------------------------------------------------------
def setup_sampler_epoch(fixed: bool) -> dict[str, Any]:
    """DALLE-pytorch#230: a DistributedSampler whose set_epoch is never called. The doctor
    cannot see the epoch loop: information. Twin: a single-process shuffling DataLoader."""
    model, data = classifier(), loader(16).dataset
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if fixed:
        batches = DataLoader(data, batch_size=4, shuffle=True,
                             generator=torch.Generator().manual_seed(0))  # fmt: skip
    else:
        sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
        batches = DataLoader(data, batch_size=4, sampler=sampler)
    return dict(model=model, optimizer=opt, batches=batches, step=stepping(None))


def setup_plateau_per_batch(fixed: bool) -> dict[str, Any]:
    """https://github.com/abhishekkrthakur/wtfml/issues/7: the engine steps its scheduler after
    every batch, a ReduceLROnPlateau with it, on the batch's training loss (the behaviour
    https://github.com/pytorch/pytorch/issues/30873 shows: a noisy loss rarely sets a new best,
    so the lr is cut again and again). Fixed: stepped once per epoch after validation, which
    the step does not do."""
    model, batches = classifier(), loader(200)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min")

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        loss = stepping(None)(model, opt, batch)
        if not fixed:
            sched.step(loss)  # BUG: patience counts batches of a noisy training loss
        return loss

    return dict(model=model, optimizer=opt, batches=batches, step=step)


# -- graph_retained: a graph kept in any container (graph.py's NOTE [held state]) ------------
class Tracker:
    """A metrics tracker (tntorch#19's loss_history in an object of the user's own)."""

    def __init__(self) -> None:
        self.history: list[torch.Tensor] = []


@dataclass
class Running:
    """A dataclass of running statistics."""

    losses: list[torch.Tensor] = field(default_factory=list)
    count: int = 0


class KeepsOutput(nn.Module):
    """A classifier that keeps its last output on itself (sktime#10928's layer)."""

    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.body, self.detach = classifier(), detach
        self.last_out: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        self.last_out = out.detach() if self.detach else out  # BUG without detach
        return out


class SeqModel(nn.Module):
    """An LSTM over (B, T, 8) sequences and a classifier head on its last position."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq, _ = self.lstm(x)  # (B, T, 16)
        return self.head(seq[:, -1]), seq


def keeping(keep: Callable[[torch.Tensor, torch.Tensor], None], model: Any = None,
            batches: Any = None) -> dict[str, Any]:  # fmt: skip
    """A classifier step that hands its loss and output to `keep` after the update."""
    model = model if model is not None else classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        out = model(x)
        logits = out[0] if isinstance(out, tuple) else out
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        keep(loss, out[1] if isinstance(out, tuple) else out)
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=batches or list(loader(6)), step=step)


def _kept(fixed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda t: t.detach()) if fixed else (lambda t: t)


def setup_tracker_history(fixed: bool) -> dict[str, Any]:
    """https://github.com/rballester/tntorch/pull/19: "every added loss used to be a full
    computational graph": a loss history, here an attribute of a tracker object."""
    tracker, d = Tracker(), _kept(fixed)
    return keeping(lambda loss, out: tracker.history.append(d(loss)))


def setup_outputs_of_dicts(fixed: bool) -> dict[str, Any]:
    """https://github.com/TRI-ML/packnet-sfm/issues/47: the epoch's outputs list holds each
    batch's output dict, its 'loss' undetached (fixed in packnet-sfm#51)."""
    outputs: list[dict[str, Any]] = []
    d = _kept(fixed)
    return keeping(lambda loss, out: outputs.append({"loss": d(loss), "batch": len(outputs)}))


def setup_smoothing_deque(fixed: bool) -> dict[str, Any]:
    """Planted: a deque(maxlen=100) window of losses for a smoothed log line."""
    window: deque[torch.Tensor] = deque(maxlen=100)
    d = _kept(fixed)
    return keeping(lambda loss, out: window.append(d(loss)))


def setup_nested_dict(fixed: bool) -> dict[str, Any]:
    """Planted: per-split, per-step losses in a dict of dicts."""
    stats: dict[str, dict[int, torch.Tensor]] = {"train": {}, "val": {}}
    d = _kept(fixed)
    return keeping(lambda loss, out: stats["train"].__setitem__(len(stats["train"]), d(loss)))


def setup_tuples_in_list(fixed: bool) -> dict[str, Any]:
    """Planted: (loss, logits) pairs kept for an epoch-end metric."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    d = _kept(fixed)
    return keeping(lambda loss, out: pairs.append((d(loss), d(out))))


def setup_dataclass_field(fixed: bool) -> dict[str, Any]:
    """Planted: a dataclass's list field of losses."""
    running, d = Running(), _kept(fixed)

    def keep(loss: torch.Tensor, out: torch.Tensor) -> None:
        running.losses.append(d(loss))
        running.count += 1

    return keeping(keep)


def setup_every_other_step(fixed: bool) -> dict[str, Any]:
    """Planted: losses kept at log steps only (every second call): the graph grows in steps."""
    logged: list[torch.Tensor] = []
    calls, d = [0], _kept(fixed)

    def keep(loss: torch.Tensor, out: torch.Tensor) -> None:
        if calls[0] % 2 == 0:
            logged.append(d(loss))
        calls[0] += 1

    return keeping(keep)


def setup_lstm_outputs(fixed: bool) -> dict[str, Any]:
    """Planted: an LSTM's output sequences kept for a metric (an op's tuple output, which the
    call watch does not see made)."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 5, 8, generator=g), torch.randint(0, 3, (4,), generator=g))
               for _ in range(6)]  # fmt: skip
    seqs: list[torch.Tensor] = []
    d = _kept(fixed)
    return keeping(lambda loss, seq: seqs.append(d(seq)), seeded(SeqModel), batches)


def setup_output_on_the_model(fixed: bool) -> dict[str, Any]:
    """https://github.com/sktime/sktime/issues/10928 (and pytorch#54580): a layer keeps its
    last output on itself with its graph: one step's graph lives until the next forward, and
    copy.deepcopy of the model raises meanwhile."""
    return keeping(lambda loss, out: None, seeded(lambda: KeepsOutput(detach=fixed)))


def setup_epoch_loss(fixed: bool) -> dict[str, Any]:
    """https://github.com/BatsResearch/labelmodels/issues/4: running_loss summed from
    undetached losses, here epoch_loss += loss / len(loader)."""
    total, d = {"epoch_loss": 0.0}, _kept(fixed)

    def keep(loss: torch.Tensor, out: torch.Tensor) -> None:
        total["epoch_loss"] += d(loss) / 6

    return keeping(keep)


# -- resume_mismatch ---------------------------------------------------------------------------
def resume_setup(saves: tuple[str, ...], loads: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A classifier with dropout, AdamW and a per-step LambdaLR; save/load write and read the
    pieces named in `saves` ("model", "optimizer", "scheduler", "rng"); load reads `loads`
    of them (all it saved unless told)."""
    loads = saves if loads is None else loads
    model = seeded(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2),
                                         nn.Linear(16, 3)))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9**step)
    parts = {"model": model, "optimizer": opt, "scheduler": sched}

    def save(path: str) -> None:
        state = {k: parts[k].state_dict() for k in saves if k in parts}
        if "rng" in saves:
            state["rng"] = torch.get_rng_state()
        torch.save(state, path)

    def load(path: str) -> None:
        state = torch.load(path, weights_only=True)
        for k in loads:
            if k in parts:
                parts[k].load_state_dict(state[k])
        if "rng" in loads:
            torch.set_rng_state(state["rng"])

    return dict(model=model, optimizer=opt, batches=loader(8), step=stepping(sched),
                save=save, load=load)  # fmt: skip


EVERYTHING = ("model", "optimizer", "scheduler", "rng")


def setup_resume_without_scheduler(fixed: bool) -> dict[str, Any]:
    """https://github.com/D-X-Y/NAS-Bench-201/issues/19 (and
    https://github.com/PolymathicAI/the_well/issues/77): the checkpoint holds the model and the
    optimizer but not the LR scheduler: a resumed run starts the schedule over."""
    return resume_setup(EVERYTHING if fixed else ("model", "optimizer", "rng"))


def setup_resume_weights_only(fixed: bool) -> dict[str, Any]:
    """https://github.com/CodefyUI/CodefyUI/issues/118: a resume restores only the weights; the
    optimizer is built anew (Adam's moments and step counts lost)."""
    return resume_setup(EVERYTHING if fixed else ("model", "scheduler", "rng"))


def setup_resume_without_rng(fixed: bool) -> dict[str, Any]:
    """The RNG states left out of the checkpoint: dropout draws other masks after a resume."""
    return resume_setup(EVERYTHING if fixed else ("model", "optimizer", "scheduler"))


def setup_resume_loads_weights_only(fixed: bool) -> dict[str, Any]:
    """https://github.com/NVIDIA-NeMo/Automodel/issues/763 (held out): the checkpoint holds the
    optimizer and the step scheduler, but the resume never loads them: the lr starts over."""
    return resume_setup(EVERYTHING, None if fixed else ("model", "rng"))


BUILT: list[tuple[str, Callable[[bool], dict[str, Any]], str]] = [
    ("lr_collapse", setup_steplr_per_batch, "warning"),
    ("lr_collapse", setup_cosine_per_batch, "warning"),
    ("ema_off_decay", setup_ema_sign, "error"),
    ("ema_before_step", setup_ema_before_step, "warning"),
    ("sampler_epoch", setup_sampler_epoch, "info"),
    ("lr_collapse", setup_plateau_per_batch, "warning"),
    ("resume_mismatch", setup_resume_without_scheduler, "error"),
    ("resume_mismatch", setup_resume_weights_only, "error"),
    ("resume_mismatch", setup_resume_without_rng, "error"),
]
# other forms of graph_retained and lr_collapse (tests/doctor/test_widened.py): kind, setup,
# severity, where (a line of this file, or a path the evidence names), a phrase of the evidence
WIDENED: list[tuple[str, Callable[[bool], dict[str, Any]], str, str]] = [
    ("graph_retained", setup_tracker_history, "warning", "`tracker.history` (4)"),
    ("graph_retained", setup_outputs_of_dicts, "warning", "`outputs['loss']` (4)"),
    ("graph_retained", setup_smoothing_deque, "warning", "`window`"),
    ("graph_retained", setup_nested_dict, "warning", "`stats['train']` (4)"),
    ("graph_retained", setup_tuples_in_list, "warning", "`pairs` (8)"),
    ("graph_retained", setup_dataclass_field, "warning", "`running.losses` (4)"),
    ("graph_retained", setup_every_other_step, "warning", "`logged` (2)"),
    ("graph_retained", setup_lstm_outputs, "warning", "`seqs` (4)"),
    ("graph_retained", setup_epoch_loss, "warning", "`total['epoch_loss']` (1)"),
    ("graph_retained", setup_output_on_the_model, "info", "`model.last_out` holds a tensor"),
    ("lr_collapse", setup_exponential_per_batch, "warning", "after 44 of the run's 1500 batches"),
    (
        "lr_collapse",
        setup_cosine_epochs_per_batch,
        "warning",
        "after 85 of the run's 4500 calls of your step (total_steps=4500)",
    ),
    ("lr_collapse", setup_onecycle_per_batch, "warning", "(OneCycleLR.step() x1 per call)"),
    ("lr_collapse", setup_warmup_decay_per_batch, "warning", "(LambdaLR.step() x1 per call)"),
]
# kind, buggy setup, clean twin, the severity the bug earns (tests/doctor/test_zoo.py's shape)
CASES: list[tuple[str, Setup, Setup, str]] = [
    (kind, partial(make, False), partial(make, True), sev) for kind, make, sev in BUILT
]


# -- held out until the checks were done (state_reports.md), rebuilt once ---------------------
def setup_srgan_steplr(fixed: bool) -> dict[str, Any]:
    """SRGAN#94: StepLR(step_size=epochs // 2 = 50, gamma=0.1) stepped at every training step
    of a 100-epoch run, ~261 batches an epoch (VOC crops at batch 64). Fixed: per epoch."""
    model, batches = classifier(), loader(261)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.1)
    return dict(model=model, optimizer=opt, batches=batches,
                step=stepping(None if fixed else sched))  # fmt: skip


def setup_ema_beta_backwards(fixed: bool) -> dict[str, Any]:
    """levanter#883: the EMA's beta (0.999) applied the wrong way round."""
    return _ema_setup({"decay": 0.999, "backwards": not fixed})


def setup_sampler_never_shuffles(fixed: bool) -> dict[str, Any]:
    """pytorch#31771: DistributedSampler(shuffle=True) looped over epochs with no set_epoch."""
    return setup_sampler_epoch(fixed)


HELD_OUT: list[tuple[str, Callable[[bool], dict[str, Any]], str]] = [
    ("lr_collapse", setup_srgan_steplr, "warning"),
    ("ema_off_decay", setup_ema_beta_backwards, "error"),
    ("resume_mismatch", setup_resume_loads_weights_only, "error"),
    ("sampler_epoch", setup_sampler_never_shuffles, "warning"),
]
