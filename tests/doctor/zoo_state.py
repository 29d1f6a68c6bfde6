"""The state-across-steps family's zoo: each public report (state_reports.md) rebuilt as a
small setup beside its correct twin (`make(fixed)`: False is the report's bug)."""

from __future__ import annotations

from collections.abc import Callable
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
    schedule counted in batches (step_size = batches per epoch)."""
    model, batches = classifier(), loader(64)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=len(batches) if fixed else 1,
                                            gamma=0.7)  # fmt: skip
    return dict(model=model, optimizer=opt, batches=batches, step=stepping(sched))


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
