"""Loss contracts broken the way users break them, each beside its clean twin.

Every `setup_*(fixed)` returns the keyword arguments of `isotrain.doctor.examine`; the bug
ones (fixed=False) cite the public report they were written from. The models are tiny.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from tests.doctor.zoo import MLP, TinyLM, adamw, features, seeded
from torch import nn
from torch.utils._pytree import register_pytree_node

PAD = 0


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mlp_setup(loss_fn: Any, batches: Any = None) -> dict[str, Any]:
    model = seeded(MLP)
    return dict(model=model, optimizer=adamw(model), batches=batches or features(2),
                loss_fn=loss_fn)  # fmt: skip


# -- softmax_before_loss: kl_div ------------------------------------------------------------
TEACHER = seeded(lambda: nn.Linear(8, 4), seed=7).requires_grad_(False)


def _distill(fixed: bool) -> Any:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model(x)
        # BUG (fixed=False): the student's probabilities, not its log-probabilities
        student = F.log_softmax(out, dim=1) if fixed else F.softmax(out, dim=1)
        with torch.no_grad():
            teacher = F.softmax(TEACHER(x), dim=1)
        kd = F.kl_div(student, teacher, reduction="none").sum(1).mean()
        return F.cross_entropy(out, y) + kd

    return loss_fn


def setup_kl_probabilities(fixed: bool) -> dict[str, Any]:
    """https://github.com/microsoft/ProDA/issues/43: self-distillation where "the student didn't
    calculate log_softmax": F.kl_div(F.softmax(student), F.softmax(teacher))."""
    return _mlp_setup(_distill(fixed))


# -- softmax_before_loss: BCE with logits -----------------------------------------------------
class Binary(nn.Module):
    """A binary classifier: 8 features -> one score (a sigmoid at its end when `sigmoid`)."""

    def __init__(self, *, sigmoid: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.sigmoid = nn.Sigmoid() if sigmoid else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sigmoid(self.net(x)).squeeze(-1)


def _binary_batches(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = _gen(3)
    return [(torch.randn(32, 8, generator=g), torch.randint(0, 2, (32,), generator=g).float())
            for _ in range(n)]  # fmt: skip


def bce_logits(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.binary_cross_entropy_with_logits(model(x), y)


def setup_double_sigmoid(fixed: bool) -> dict[str, Any]:
    """https://github.com/YXNTU/GeneralDyG/issues/6: the classifier "applies a Sigmoid before
    returning" and training uses binary_cross_entropy_with_logits (sigmoid twice)."""
    model = seeded(lambda: Binary(sigmoid=not fixed))  # BUG: nn.Sigmoid as the last layer
    return dict(model=model, optimizer=adamw(model), batches=_binary_batches(), loss_fn=bce_logits)


# -- target_out_of_range: a 0/255 mask --------------------------------------------------------
class Segmenter(nn.Module):
    """(N, 3, H, W) image -> (N, C, H, W) logits."""

    def __init__(self, classes: int = 1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


CRITERION = nn.BCEWithLogitsLoss()


def segment(model: nn.Module, batch: Any) -> torch.Tensor:
    x, mask = batch
    return CRITERION(model(x), mask)


def setup_mask_255(fixed: bool) -> dict[str, Any]:
    """https://github.com/milesial/Pytorch-UNet/issues/65: negative BCE loss; "the targets (the
    true masks) should be between 0 and 1": the normalization was applied to the images only."""
    g = _gen(4)
    batches = []
    for _ in range(2):
        image = torch.rand(4, 3, 8, 8, generator=g)
        mask = (image[:, :1] > 0.5).float() * 255  # as read from a PNG: 0 or 255
        batches.append((image, mask / 255 if fixed else mask))
    model = seeded(Segmenter)
    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=segment)


def setup_mask_over_255(fixed: bool) -> dict[str, Any]:
    """https://github.com/pytorch/pytorch/issues/53959 and albumentations#148: a 0/1 mask stored
    as uint8 goes through the image's ToTensor, which divides it by 255: the positive class's
    target is 1/255."""
    g = _gen(5)
    batches = []
    for _ in range(2):
        image = torch.rand(4, 3, 8, 8, generator=g)
        mask = (image[:, :1] > 0.5).to(torch.uint8)  # 0/1, as stored
        batches.append((image, mask.float() if fixed else mask.float() / 255))  # BUG: ToTensor
    model = seeded(Segmenter)
    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=segment)


def bce_probabilities(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.binary_cross_entropy(torch.sigmoid(model(x)), y)


def setup_multilabel_over_255(fixed: bool) -> dict[str, Any]:
    """Planted: multi-label 0/1 targets read as an 8-bit image (ToTensor, /255) into
    binary_cross_entropy on sigmoid probabilities."""
    batches = [(x, y if fixed else y / 255) for x, y in _binary_batches()]
    model = seeded(lambda: Binary(sigmoid=False))
    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=bce_probabilities)


def setup_soft_binary_targets(form: str) -> dict[str, Any]:
    """Binary targets that are not 0/1 on purpose: label smoothing (0.05 / 0.95), a Gaussian
    heatmap, or every target 0 (a batch with no positives)."""
    g = _gen(6)
    batches = []
    for _ in range(2):
        x = torch.randn(32, 8, generator=g)
        hard = torch.randint(0, 2, (32,), generator=g).float()
        y = {"smoothed": hard * 0.9 + 0.05, "heatmap": torch.exp(-x[:, 0] ** 2),
             "negatives": torch.zeros(32)}[form]  # fmt: skip
        batches.append((x, y))
    model = seeded(lambda: Binary(sigmoid=False))
    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=bce_logits)


# -- padding_in_loss without an attention mask -------------------------------------------------
class TokenLM(TinyLM):
    """TinyLM called as Hugging Face models are: model(input_ids=...)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids)


def _padded_rows(seed: int) -> torch.Tensor:
    ids = torch.randint(1, 16, (4, 16), generator=_gen(seed))
    for row, length in enumerate((16, 12, 9, 5)):
        ids[row, length:] = PAD  # right padding to the longest row
    return ids


def lm_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    logits = model(input_ids=batch["input_ids"])
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                           batch["labels"][:, 1:].reshape(-1))  # fmt: skip
    loss.backward()
    opt.step()
    return loss.detach()


def setup_padding_no_mask(fixed: bool, *, config: bool = False) -> dict[str, Any]:
    """https://github.com/hengjiUSTC/learn-llm/issues/2: pretraining examples pad input_ids but
    "did not change pad_token_id in the labels to -100", so the loss falls quickly (no mask is
    passed: the model is causal). With `config` the model names its pad_token_id."""
    batches = []
    for seed in (1, 2):
        ids = _padded_rows(seed)
        labels = ids.masked_fill(ids == PAD, -100) if fixed else ids.clone()  # BUG: pads kept
        batches.append({"input_ids": ids, "labels": labels})
    model = seeded(TokenLM)
    if config:
        model.config = SimpleNamespace(pad_token_id=PAD, eos_token_id=2)
    return dict(model=model, optimizer=adamw(model), batches=batches, step=lm_step, task="lm")


# -- not_log_probabilities ----------------------------------------------------------------------
def nll_of(fixed: bool) -> Any:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model(x)
        return F.nll_loss(F.log_softmax(out, dim=1) if fixed else out, y)  # BUG: raw logits

    return loss_fn


def setup_nll_logits(fixed: bool) -> dict[str, Any]:
    """nll_loss given the raw logits (the class invariant: its input must be log-probabilities)."""
    return _mlp_setup(nll_of(fixed))


def _kl_log_target(fixed: bool) -> Any:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model(x)
        with torch.no_grad():
            teacher = F.log_softmax(TEACHER(x), dim=1)  # the teacher in log space
        kd = F.kl_div(F.log_softmax(out, dim=1), teacher, reduction="batchmean",
                      log_target=fixed)  # fmt: skip # BUG (fixed=False): log_target missing
        return F.cross_entropy(out, y) + kd

    return loss_fn


def setup_kl_log_target(fixed: bool) -> dict[str, Any]:
    """kl_div given a log-space target without log_target=True (it reads them as probabilities)."""
    return _mlp_setup(_kl_log_target(fixed))


# -- target_out_of_range: multi-hot targets to cross_entropy -----------------------------------
def _multi_hot(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = _gen(5)
    out = []
    for _ in range(n):
        y = (torch.rand(16, 4, generator=g) > 0.5).float()
        y[:, 0] = 1.0  # every sample has at least one label; most have several
        out.append((torch.randn(16, 8, generator=g), y))
    return out


def multilabel_of(fixed: bool) -> Any:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        if fixed:
            return F.binary_cross_entropy_with_logits(model(x), y)
        return F.cross_entropy(model(x), y)  # BUG: multi-hot rows read as distributions

    return loss_fn


def setup_multi_hot_ce(fixed: bool) -> dict[str, Any]:
    """A multi-label task trained with cross_entropy on multi-hot float targets."""
    return _mlp_setup(multilabel_of(fixed), _multi_hot())


# -- loss_weight_shape ---------------------------------------------------------------------------
def setup_pos_weight(fixed: bool) -> dict[str, Any]:
    """Per-class pos_weight of shape (C,) on (N, C, H, W) logits with W == C (it weighs columns)."""
    g = _gen(6)
    batches = [(torch.rand(2, 3, 4, 4, generator=g),
                (torch.rand(2, 4, 4, 4, generator=g) > 0.7).float()) for _ in range(2)]  # fmt: skip
    pos_weight = torch.tensor([1.0, 2.0, 4.0, 8.0])
    if fixed:
        pos_weight = pos_weight.view(4, 1, 1)
    criterion = nn.BCEWithLogitsLoss(pos_weight=pos_weight)  # BUG (fixed=False): (4,) not (4,1,1)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return criterion(model(x), y)

    model = seeded(lambda: Segmenter(4))
    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=loss_fn)


# -- loss_unread -----------------------------------------------------------------------------------
def hand_written(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logp = torch.log_softmax(model(x), dim=1)
    return -logp.gather(1, y[:, None]).mean()  # cross-entropy written out: right, but unread


def setup_hand_written() -> dict[str, Any]:
    """A correct loss written by hand: its contract cannot be read (info, never an alarm)."""
    return _mlp_setup(hand_written)


BUGS: list[tuple[str, Any, str]] = [
    ("softmax_before_loss", setup_kl_probabilities, "error"),
    ("softmax_before_loss", setup_double_sigmoid, "error"),
    ("target_out_of_range", setup_mask_255, "error"),
    ("target_out_of_range", setup_mask_over_255, "error"),
    ("target_out_of_range", setup_multilabel_over_255, "error"),
    ("padding_in_loss", setup_padding_no_mask, "warning"),
    ("not_log_probabilities", setup_nll_logits, "error"),
    ("not_log_probabilities", setup_kl_log_target, "error"),
    ("target_out_of_range", setup_multi_hot_ce, "warning"),
    ("loss_weight_shape", setup_pos_weight, "warning"),
]


# -- held out: written after the checks were done, tested once ----------------------------------
class PointSeg(nn.Module):
    """A per-point segmentation head: (B, 3, N) points -> (B, N, C) scores, no log_softmax."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(3, 16, 1), nn.Conv1d(16, classes, 1)
        self.classes = classes

    def forward(self, points: torch.Tensor, *, log: bool = False) -> torch.Tensor:
        x = self.conv2(F.relu(self.conv1(points))).transpose(2, 1).contiguous()  # (B, N, C)
        return F.log_softmax(x, dim=-1) if log else x


def setup_pointnet_nll(fixed: bool) -> dict[str, Any]:
    """https://github.com/yanx27/Pointnet_Pointnet2_pytorch/issues/30: "nll_loss is used but
    the input labels_pred is not a log_softmax, causing a negative label loss value"."""
    g = _gen(8)
    batches = [(torch.randn(2, 3, 32, generator=g), torch.randint(0, 4, (2, 32), generator=g))
               for _ in range(2)]  # fmt: skip

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        points, labels = batch
        labels_pred = model(points, log=fixed)  # BUG (fixed=False): raw scores
        return F.nll_loss(labels_pred.view(-1, 4), labels.view(-1))

    model = seeded(PointSeg)
    return dict(model=model, optimizer=adamw(model), batches=batches, loss_fn=loss_fn)


class Output(dict):
    """A Hugging Face ModelOutput in small: a dict whose keys are attributes too."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


# as transformers registers ModelOutput: a pytree node, so tree walks see its tensors
register_pytree_node(
    Output, lambda o: (list(o.values()), list(o.keys())), lambda v, k: Output(zip(k, v))
)


class GLMLike(TinyLM):
    """A causal LM that computes its own shifted loss from `labels` (ignore_index=-100), with
    a config naming its pad id, as ChatGLM's model does."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(pad_token_id=3, eos_token_id=2, is_encoder_decoder=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits = super().forward(input_ids)
        loss = None
        if labels is not None:
            shift = logits[:, :-1].reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(shift, labels[:, 1:].reshape(-1), ignore_index=-100)
        return Output(loss=loss, logits=logits)


def setup_glm_pad_labels(fixed: bool) -> dict[str, Any]:
    """https://github.com/zai-org/ChatGLM-6B/issues/362: input_ids and labels are padded with
    pad_token_id (20003) while the loss is CrossEntropyLoss(ignore_index=-100): are the pads
    counted? (they are, unless the labels' pads become -100)."""
    batches = []
    for seed in (1, 2):
        ids = torch.randint(4, 16, (4, 16), generator=_gen(seed))
        labels = ids.clone()
        for row, (prompt, length) in enumerate(((3, 16), (4, 12), (2, 10), (5, 7))):
            labels[row, :prompt] = -100  # the prompt is not a target
            ids[row, length - 1], labels[row, length - 1] = 2, 2  # eos
            ids[row, length:] = labels[row, length:] = 3  # right padding with pad_token_id
        if fixed:
            labels = labels.masked_fill(labels == 3, -100)  # ignore_pad_token_for_loss
        batches.append({"input_ids": ids, "labels": labels})
    model = seeded(GLMLike)
    return dict(model=model, optimizer=adamw(model), batches=batches, task="lm")


HELD_OUT: list[tuple[str, Any, str]] = [
    ("not_log_probabilities", setup_pointnet_nll, "error"),
    ("padding_in_loss", setup_glm_pad_labels, "error"),
]


def _pair(make: Any) -> tuple[Any, Any]:
    return (lambda: make(False)), (lambda: make(True))


# (kind, bug, clean twin, severity), as tests/doctor/test_zoo.py's CASES
CASES: list[tuple[str, Any, Any, str]] = [
    (kind, *_pair(make), severity) for kind, make, severity in BUGS + HELD_OUT
] + [("loss_unread", setup_hand_written, _pair(setup_nll_logits)[1], "info")]
