"""Bugs people reported in public, each written the way the report wrote it, with its fix.

Every `setup_*` function returns examine's keyword arguments; its docstring links the report.
`CASES` lists (kind, buggy setup, fixed setup, the severity the bug earns) for test_zoo.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tests.doctor.zoo import MLP, TinyLM, adamw, features, good_step, mlp_setup, seeded
from torch import nn
from torch.utils.data import DataLoader, Dataset

V = 16  # the token LMs' vocabulary


def _ids(rows: int, cols: int, *, low: int = 0, seed: int = 1) -> torch.Tensor:
    return torch.randint(low, V, (rows, cols), generator=torch.Generator().manual_seed(seed))


class TokenLM(TinyLM):
    """The attention LM called as Hugging Face models are: model(input_ids=..., ...)."""

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> torch.Tensor:
        return super().forward(input_ids)


def _lm(batches: list[Any], step: Any) -> dict[str, Any]:
    model = seeded(lambda: TokenLM(vocab=V, n_layer=1))
    return dict(model=model, optimizer=adamw(model), batches=batches, step=step, task="lm")


# -- labels_not_shifted ---------------------------------------------------------------------
def step_labels_as_inputs(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
    opt.zero_grad()
    logits = model(input_ids=batch["input_ids"])  # (B, T, V)
    loss = F.cross_entropy(logits.view(-1, V), batch["labels"].view(-1))  # BUG: not shifted
    loss.backward()
    opt.step()
    return loss.detach()


def step_labels_shifted(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
    opt.zero_grad()
    logits = model(input_ids=batch["input_ids"])  # position t predicts token t+1
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return loss.detach()


def setup_labels(fixed: bool) -> dict[str, Any]:
    """https://github.com/KempnerInstitute/KempnerForge/issues/154: labels aligned with the
    input position (labels[i] == input_ids[i]) and no shift in the loss, so "each logit is
    scored against the current, already-visible token": the model copies, the loss goes to 0."""
    batches = [{"input_ids": (ids := _ids(4, 16, seed=s)), "labels": ids.clone()} for s in (1, 2)]
    return _lm(batches, step_labels_shifted if fixed else step_labels_as_inputs)


# -- padding_in_loss ------------------------------------------------------------------------
PAD = 0


def _padded(fixed: bool, seed: int) -> dict[str, torch.Tensor]:
    ids = _ids(4, 16, low=1, seed=seed)
    mask = torch.ones_like(ids)
    for row, length in enumerate((16, 12, 9, 5)):
        ids[row, length:], mask[row, length:] = PAD, 0  # right padding
    labels = ids.clone()  # BUG: the pad positions keep the pad id, not -100
    if fixed:
        labels = labels.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def setup_padding(fixed: bool) -> dict[str, Any]:
    """https://github.com/01-ai/Yi/issues/110: "the labels corresponding to pad tokens are not
    set to ignore index", so the loss is computed on padding."""
    return _lm([_padded(fixed, s) for s in (1, 2)], step_labels_shifted)


# -- loss_broadcast -------------------------------------------------------------------------
class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))  # (N, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def mse_unsqueezed(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)  # BUG: input (N, 1) against target (N,): (N, N)


def mse_same_shape(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).squeeze(-1), y)


def setup_broadcast(fixed: bool) -> dict[str, Any]:
    """https://github.com/timeseriesAI/tsai/issues/22: "Using a target size (torch.Size([16]))
    that is different to the input size (torch.Size([16, 1]))", and the model does not train
    (also deepset-ai/FARM#229)."""
    model = seeded(Regressor)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(16, 8, generator=g), torch.randn(16, generator=g)) for _ in range(2)]
    loss_fn = mse_same_shape if fixed else mse_unsqueezed
    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=loss_fn)


# -- softmax_before_loss --------------------------------------------------------------------
CRITERION = nn.CrossEntropyLoss()


def classify(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return CRITERION(model(x), y)


def setup_softmax(fixed: bool) -> dict[str, Any]:
    """https://github.com/MicrosoftDocs/ml-basics/issues/48: a classifier whose last layer is
    a softmax, trained with CrossEntropyLoss, which "expects logits instead of normalized
    probabilities"."""
    layers: list[nn.Module] = [nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)]
    if not fixed:
        layers.append(nn.Softmax(dim=1))  # BUG: the loss applies log_softmax itself
    model = seeded(lambda: nn.Sequential(*layers))
    return dict(model=model, optimizer=adamw(model), batches=features(2), loss_fn=classify)


# -- graph_retained -------------------------------------------------------------------------
RUNNING: dict[str, Any] = {"total_loss": 0.0}


def step_summing_losses(model: nn.Module, opt: Any, batch: Any, *, detach: bool = False) -> Any:
    x, y = batch
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    RUNNING["total_loss"] += loss.detach() if detach else loss  # BUG: keeps the history
    return loss.detach()


def step_summing_detached(model: nn.Module, opt: Any, batch: Any) -> Any:
    return step_summing_losses(model, opt, batch, detach=True)


def setup_graph(fixed: bool) -> dict[str, Any]:
    """https://pytorch.org/docs/stable/notes/faq.html ("Don't accumulate history across your
    training loop"): `total_loss += loss` keeps the autograd history of every step alive."""
    RUNNING["total_loss"] = 0.0
    return mlp_setup(step=step_summing_detached if fixed else step_summing_losses)


class SeqRNN(nn.Module):
    """An RNN over a sequence whose hidden state the loop carries from batch to batch."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.out = nn.RNN(8, 16, batch_first=True), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, h: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = self.rnn(x, h)
        return self.out(y[:, -1]), h


def step_carrying_hidden(model: nn.Module, opt: Any, batch: Any, *, detach: bool = False) -> Any:
    x, y = batch
    opt.zero_grad()
    h = RUNNING.get("h")
    if h is not None and detach:
        h = h.detach()  # the tutorial's h_state = h_state.data
    logits, RUNNING["h"] = model(x, h)  # BUG (no detach): the graph reaches the last batch
    loss = F.cross_entropy(logits, y)
    loss.backward()
    opt.step()
    return loss.detach()


def step_carrying_detached(model: nn.Module, opt: Any, batch: Any) -> Any:
    return step_carrying_hidden(model, opt, batch, detach=True)


def setup_hidden(fixed: bool) -> dict[str, Any]:
    """https://github.com/MorvanZhou/PyTorch-Tutorial/issues/57: without `h_state =
    h_state.data` the RNN loop raises "Trying to backward through the graph a second time"
    (and retain_graph=True, the suggested cure, keeps every batch's graph: OOM in
    sgadgil6/cnslab_fmri#4)."""
    RUNNING["h"] = None
    model = seeded(SeqRNN)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 5, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
               for _ in range(2)]  # fmt: skip
    step = step_carrying_detached if fixed else step_carrying_hidden
    return dict(model=model, optimizer=adamw(model), batches=batches, step=step)


# -- stale_gradient -------------------------------------------------------------------------
def step_without_zero_grad(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
    x, y = batch
    loss = F.cross_entropy(model(x), y)  # BUG: optimizer.zero_grad() is missing
    loss.backward()
    opt.step()
    return loss.detach()


def setup_stale(fixed: bool) -> dict[str, Any]:
    """https://stackoverflow.com/questions/60335387 (TrainCheck's reproduced set): the MNIST
    loop lost `optimizer.zero_grad()`, gradients add up across batches, and it does not
    converge."""
    return mlp_setup(step=good_step if fixed else step_without_zero_grad)


# -- accumulation_scale ---------------------------------------------------------------------
ACCUMULATE = 4


def step_accumulating(model: nn.Module, opt: Any, batch: Any, *, divide: bool = False) -> Any:
    x, y = batch
    opt.zero_grad()
    total = torch.zeros(())
    for xs, ys in zip(x.chunk(ACCUMULATE), y.chunk(ACCUMULATE), strict=True):
        loss = F.cross_entropy(model(xs), ys)
        total += loss.detach() / ACCUMULATE  # the step's mean loss, for the log
        if divide:
            loss = loss / ACCUMULATE
        loss.backward()  # BUG (divide=False): each micro-batch adds its full gradient
    opt.step()
    return total


def step_accumulating_divided(model: nn.Module, opt: Any, batch: Any) -> Any:
    return step_accumulating(model, opt, batch, divide=True)


def setup_accumulation(fixed: bool) -> dict[str, Any]:
    """https://github.com/agokrani/distillKitPlus/issues/5: with gradient accumulation "the
    scalar loss being back-propagated is summed across all batches without adjusting for the
    number of accumulation steps"."""
    return mlp_setup(step=step_accumulating_divided if fixed else step_accumulating)


# -- batch_size_mismatch --------------------------------------------------------------------
IMAGE = 1  # the image placeholder token


class TinyVLM(nn.Module):
    """Token embeddings with each image's features written over its placeholder token; returns
    its loss as a Hugging Face model does (a dict with "loss")."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.vision = nn.Embedding(V, 16), nn.Linear(3 * 4 * 4, 16)
        self.head = nn.Linear(16, V)

    def forward(self, input_ids: Any, pixel_values: Any, attention_mask: Any, labels: Any) -> Any:
        x = self.wte(input_ids)
        images = self.vision(pixel_values.flatten(1))  # (images, 16)
        is_image = input_ids == IMAGE
        order = is_image.flatten().cumsum(0).view_as(input_ids) - 1  # which image goes there
        x = torch.where(is_image[..., None], images[order.clamp(min=0)], x)
        logits = self.head(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1))
        return {"logits": logits, "loss": loss}


def _vlm_batch(fixed: bool, seed: int) -> dict[str, torch.Tensor]:
    rows = _ids(8, 6, low=2, seed=seed)
    rows[:, 0] = IMAGE  # "[IMG] caption" per sample
    ids = rows if fixed else rows.reshape(1, -1)  # BUG: the 8 samples joined into one row
    labels = ids.masked_fill(ids == IMAGE, -100)
    pixels = torch.randn(8, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "pixel_values": pixels}  # fmt: skip


def setup_batch_size(fixed: bool) -> dict[str, Any]:
    """https://github.com/huggingface/transformers/issues/34204 (TrainCheck's reproduced set):
    the processor returns input_ids of shape [1, sequence_length] for a batch of 50 images."""
    model = seeded(TinyVLM)
    batches = [_vlm_batch(fixed, s) for s in (1, 2)]
    return dict(model=model, optimizer=adamw(model), batches=batches)  # no loss_fn: .loss


# -- autocast_not_applied -------------------------------------------------------------------
def step_autocast_cuda(model: nn.Module, opt: Any, batch: Any, device: str = "cuda") -> Any:
    x, y = batch
    opt.zero_grad()
    with torch.autocast(device, dtype=torch.bfloat16):  # BUG (cuda): the model is on the CPU
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def step_autocast_cpu(model: nn.Module, opt: Any, batch: Any) -> Any:
    return step_autocast_cuda(model, opt, batch, device="cpu")


def setup_autocast(fixed: bool) -> dict[str, Any]:
    """https://github.com/Lightning-AI/pytorch-lightning/issues/21815: bf16-mixed on the CPU
    opens autocast for "cuda", torch warns "CUDA is not available ... Disabling autocast" and
    the step runs in float32 (on a GPU machine the region exists, but torch.mm of CPU tensors
    stays float32: pytorch/pytorch#114458)."""
    return mlp_setup(step=step_autocast_cpu if fixed else step_autocast_cuda)


# -- lr_collapse ----------------------------------------------------------------------------
EPOCHS = 5


def setup_lr(fixed: bool) -> dict[str, Any]:
    """https://github.com/ivadomed/ivadomed/pull/55: "Scheduler was incorrectly stepped in the
    batch loop instead of in the epoch loop, causing the LR to be updated after each batch"."""
    batches = features(8)
    model = seeded(MLP)
    opt = adamw(model)
    steps = EPOCHS * len(batches) if fixed else EPOCHS  # T_max in epochs, stepped per batch
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)

    def step(model: nn.Module, optimizer: Any, batch: Any) -> torch.Tensor:
        loss = good_step(model, optimizer, batch)
        scheduler.step()  # BUG (unfixed): T_max counts epochs, this runs every batch
        return loss

    return dict(model=model, optimizer=opt, batches=batches, step=step)


# -- dataloader_worker_seed -----------------------------------------------------------------
class NoisyFeatures(Dataset):  # type: ignore[type-arg]
    """Features with random noise added on every read, from the dataset's own generator."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        self.rng = np.random.default_rng(0)  # BUG: copied into every worker as it is

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.from_numpy(self.rng.normal(0.0, 0.1, 8).astype(np.float32))
        return self.x[i] + noise, self.y[i]


def seed_worker(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    info.dataset.rng = np.random.default_rng(info.seed)  # each worker its own stream


def setup_workers(fixed: bool) -> dict[str, Any]:
    """https://github.com/wolny/pytorch-3dunet/issues/32: random rotations and contrasts repeat
    across DataLoader workers, "since the workers share the common instance of the Dataset
    which was initialized with a fixed seed" (TrainCheck's stackoverflow-67180955 is the same
    bug with numpy's global RNG, which the DataLoader seeds per worker since torch 1.9)."""
    loader = DataLoader(NoisyFeatures(), batch_size=8, num_workers=2,
                        worker_init_fn=seed_worker if fixed else None)  # fmt: skip
    return mlp_setup(batches=loader, eval_fn=None)


def _pair(make: Any) -> tuple[Any, Any]:
    return (lambda: make(False)), (lambda: make(True))


CASES = [
    ("labels_not_shifted", *_pair(setup_labels), "error"),
    ("padding_in_loss", *_pair(setup_padding), "error"),
    ("loss_broadcast", *_pair(setup_broadcast), "error"),
    ("softmax_before_loss", *_pair(setup_softmax), "error"),
    ("graph_retained", *_pair(setup_graph), "warning"),
    ("graph_retained", *_pair(setup_hidden), "error"),
    ("stale_gradient", *_pair(setup_stale), "error"),
    ("accumulation_scale", *_pair(setup_accumulation), "error"),
    ("batch_size_mismatch", *_pair(setup_batch_size), "warning"),
    ("autocast_not_applied", *_pair(setup_autocast), "warning"),
    ("lr_collapse", *_pair(setup_lr), "warning"),
    ("dataloader_worker_seed", *_pair(setup_workers), "warning"),
]
