"""The data family's zoo: each public report rebuilt as a small setup, with its correct twin
(`make(fixed)`: False is the report's bug, True the same shape done right). The reports are
listed in data_reports.md."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.doctor.zoo import MLP, adamw, good_step, mlp_setup, seeded
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from isotrain.contexts import eval_mode, rng_isolated

N_CLASSES = 3


def seg_model() -> nn.Module:
    return seeded(lambda: nn.Conv2d(1, N_CLASSES, 3, padding=1))


def seg_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    image, mask = batch
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(image), mask.long())
    loss.backward()
    opt.step()
    return loss.detach()


def seg_setup(batches: Any) -> dict[str, Any]:
    model = seg_model()
    return dict(model=model, optimizer=adamw(model), batches=batches, step=seg_step)


def scenes(n: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """n grey images (1, 8, 8) and their uint8 label masks (8, 8), classes 0..2 in regions
    the image shows (brighter per class), as read from PNG files."""
    g = torch.Generator().manual_seed(seed)
    masks = torch.randint(0, N_CLASSES, (n, 2, 2), generator=g).repeat_interleave(4, 1)
    masks = masks.repeat_interleave(4, 2)  # (n, 8, 8) blocks of 4x4 pixels
    images = masks[:, None].float() + 0.3 * torch.randn(n, 1, 8, 8, generator=g)
    return images, masks.numpy().astype(np.uint8)


# -- labels_truncated -------------------------------------------------------------------------
class MaskFiles(Dataset):  # type: ignore[type-arg]
    """Images and label masks, the masks converted like the images when `scaled`."""

    def __init__(self, scaled: bool) -> None:
        self.images, self.masks = scenes(8)
        self.scaled = scaled

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.from_numpy(self.masks[i])
        if self.scaled:  # BUG: what ToTensor does to a uint8 mask: class k becomes k/255
            return self.images[i], mask.float() / 255
        return self.images[i], mask.long()


def setup_scaled_mask(fixed: bool) -> dict[str, Any]:
    """https://github.com/pytorch/vision/issues/2497: ToTensor on a grayscale label mask
    turns class ids 0..N into k/255, and the models "could not even overfit"."""
    return seg_setup(DataLoader(MaskFiles(scaled=not fixed), batch_size=4))


# -- batch_class_mix --------------------------------------------------------------------------
def sorted_features(n: int = 64) -> TensorDataset:
    """Features whose labels are stored sorted: 16 of class 0, then 16 of class 1, ..."""
    g = torch.Generator().manual_seed(0)
    y = torch.arange(4).repeat_interleave(n // 4)
    return TensorDataset(torch.randn(n, 8, generator=g) + y[:, None], y)


def setup_sorted(fixed: bool) -> dict[str, Any]:
    """https://datascience.stackexchange.com/questions/76951: every batch holds one label
    ("batch 0 all have the 3rd label, batch 1 all have the 1st")."""
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(sorted_features(), batch_size=8, shuffle=fixed, generator=g)
    return mlp_setup(batches=loader, eval_fn=None)


def setup_stored_mixed() -> dict[str, Any]:
    """The other twin: shuffle=False over data stored in mixed order (a validation-like
    loader used for training is fine when the file is not sorted)."""
    data = sorted_features()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(1))
    x, y = data.tensors
    loader = DataLoader(TensorDataset(x[order], y[order]), batch_size=8, shuffle=False)
    return mlp_setup(batches=loader, eval_fn=None)


# -- pair_transform_mismatch ------------------------------------------------------------------
class FlippedPairs(Dataset):  # type: ignore[type-arg]
    """Images and masks with a random left-right flip; `joint` draws one coin for both."""

    def __init__(self, joint: bool) -> None:
        images, masks = scenes(8, seed=1)
        self.images, self.masks = images, torch.from_numpy(masks).long()
        self.joint = joint
        self.reads = 0

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.reads += 1
        image, mask = self.images[i], self.masks[i]
        flip = random.random() < 0.5
        if flip:
            image = image.flip(-1)
        if self.joint:
            mask = mask.flip(-1) if flip else mask
        elif random.random() < 0.5:  # BUG: the mask's pipeline draws its own coin
            mask = mask.flip(-1)
        return image, mask


def setup_pairs(fixed: bool) -> dict[str, Any]:
    """https://github.com/Project-MONAI/MONAI/issues/100: the image and the segmentation go
    through separate random pipelines whose draws fall out of step."""
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(FlippedPairs(joint=fixed), batch_size=4, shuffle=True, generator=g)
    return seg_setup(loader)


# -- held out: rebuilt once the checks were done, tested once ----------------------------------
def bce_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    image, mask = batch
    opt.zero_grad(set_to_none=True)
    loss = F.binary_cross_entropy_with_logits(model(image), mask)
    loss.backward()
    opt.step()
    return loss.detach()


class OneHotNpy(Dataset):  # type: ignore[type-arg]
    """https://github.com/pytorch/pytorch/issues/53959: one-hot (0/1) masks stored as uint8
    .npy go through the images' ToTensor (`mask = self.tfm(mask)`), and "the optimizer will
    train the model to return 0"; `.astype('int32')` before it is the fix."""

    def __init__(self, fixed: bool) -> None:
        images, masks = scenes(8, seed=2)
        self.images, self.masks = images, (masks > 0).astype(np.uint8)[:, None]
        self.fixed = fixed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.from_numpy(self.masks[i].astype(np.int32) if self.fixed else self.masks[i])
        scale = 1 if self.fixed else 255  # ToTensor divides uint8 arrays by 255
        return self.images[i], mask.float() / scale


def setup_onehot_npy(fixed: bool) -> dict[str, Any]:
    model = seeded(lambda: nn.Conv2d(1, 1, 3, padding=1))
    loader = DataLoader(OneHotNpy(fixed), batch_size=4)
    return dict(model=model, optimizer=adamw(model), batches=loader, step=bce_step)


def rotate(image: torch.Tensor, degrees: float) -> torch.Tensor:
    """`image` (C, H, W) turned by `degrees` about its centre (bilinear, zeros outside)."""
    a = torch.tensor(degrees * np.pi / 180)
    theta = torch.stack([torch.stack([a.cos(), -a.sin(), torch.tensor(0.0)]),
                         torch.stack([a.sin(), a.cos(), torch.tensor(0.0)])])  # fmt: skip
    grid = F.affine_grid(theta[None], [1, *image.shape], align_corners=False)
    return F.grid_sample(image[None], grid, align_corners=False)[0]


class SeparateTransforms(Dataset):  # type: ignore[type-arg]
    """https://github.com/bigmb/Unet-Segmentation-Pytorch-Nest-of-Unets/issues/29: the image's
    transforms (tx) hold RandomRotation((-10, 10)) and ColorJitter, the label's (lx) neither:
    the label is not rotated with its image."""

    def __init__(self, fixed: bool) -> None:
        images, masks = scenes(8, seed=3)
        self.images, self.masks = images, torch.from_numpy(masks > 0).float()[:, None]
        self.fixed = fixed

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        degrees = random.uniform(-10, 10)
        image = rotate(self.images[i], degrees) * random.uniform(0.6, 1.4)  # + brightness
        mask = rotate(self.masks[i], degrees).round() if self.fixed else self.masks[i]
        return image, mask


def setup_separate_transforms(fixed: bool) -> dict[str, Any]:
    model = seeded(lambda: nn.Conv2d(1, 1, 3, padding=1))
    loader = DataLoader(SeparateTransforms(fixed), batch_size=4)
    return dict(model=model, optimizer=adamw(model), batches=loader, step=bce_step)


SIDE = 48  # pixels: a turn by a few degrees moves a 48-pixel scene's edges by a pixel or more


class TurnedScenes(Dataset):  # type: ignore[type-arg]
    """Nest-of-Unets#29's pipelines on SIDE x SIDE scenes (3 x 3 blocks, foreground or not): the
    image turned by up to 10 degrees and brightened, the mask turned too (`form="joint"`), not
    turned (`"image only"`), or the image only brightened and noised (`"photometric"`)."""

    def __init__(self, form: str) -> None:
        g = torch.Generator().manual_seed(6)
        blocks = torch.randint(0, 2, (4, 3, 3), generator=g)
        self.masks = blocks.repeat_interleave(SIDE // 3, 1).repeat_interleave(SIDE // 3, 2)
        self.images = self.masks[:, None].float() + 0.3 * torch.randn(4, 1, SIDE, SIDE, generator=g)
        self.form = form

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, mask = self.images[i], self.masks[i][None].float()
        if self.form == "photometric":
            return image * random.uniform(0.6, 1.4) + 0.05 * torch.randn_like(image), mask
        degrees = random.uniform(-10, 10)
        image = rotate(image, degrees) * random.uniform(0.6, 1.4)
        if self.form == "joint":
            mask = rotate(mask, degrees).round()
        return image, mask  # "image only": BUG, the mask is not turned with its image


def setup_turned_image_only(fixed: bool) -> dict[str, Any]:
    """Nest-of-Unets#29 (missed when held out, on 8 x 8 scenes), at SIDE pixels: the image's
    transforms hold RandomRotation((-10, 10)), the label's do not."""
    model = seeded(lambda: nn.Conv2d(1, 1, 3, padding=1))
    loader = DataLoader(TurnedScenes("joint" if fixed else "image only"), batch_size=2)
    return dict(model=model, optimizer=adamw(model), batches=loader, step=bce_step)


def setup_photometric_only() -> dict[str, Any]:
    """Correct: only the image's brightness and noise change; the mask stays as it is."""
    model = seeded(lambda: nn.Conv2d(1, 1, 3, padding=1))
    loader = DataLoader(TurnedScenes("photometric"), batch_size=2)
    return dict(model=model, optimizer=adamw(model), batches=loader, step=bce_step)


# -- the training split against the eval split ------------------------------------------------


class Images(Dataset):  # type: ignore[type-arg]
    """A torchvision-style dataset: raw rows in `.data`, labels in `.targets`, a transform."""

    def __init__(self, n: int, transform: Any = None, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randn(n, 8, generator=g)
        self.targets = torch.randint(0, 4, (n,), generator=g)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.data[i]
        return (self.transform(x) if self.transform else x), self.targets[i]


def jitter(x: torch.Tensor) -> torch.Tensor:
    """A random augmentation: noise drawn from the global generator (a worker's seed)."""
    return x + 0.1 * torch.randn_like(x)


def split_setup(train: Any, val: Any) -> dict[str, Any]:
    """A classifier trained on `train`, its eval_fn reading a DataLoader over `val` by name."""
    train_loader = DataLoader(train, batch_size=8, shuffle=True,
                              generator=torch.Generator().manual_seed(0))  # fmt: skip
    val_loader = DataLoader(val, batch_size=8)

    def evaluate(model: nn.Module, _: Any) -> float:
        with torch.no_grad(), eval_mode(model), rng_isolated(seed=0):
            loss = sum(F.cross_entropy(model(x), y).item() for x, y in val_loader)
        return loss / len(val_loader)

    return mlp_setup(batches=train_loader, eval_fn=evaluate)


def setup_split_shuffled_then_sliced(fixed: bool) -> dict[str, Any]:
    """https://github.com/marin-community/marin/pull/2700: the training set is shuffled and then
    sliced, the validation set sliced without shuffling: some samples are in both."""
    full = Images(96)
    order = torch.randperm(96, generator=torch.Generator().manual_seed(1)).tolist()
    val_idx = list(range(16))
    train_idx = list(range(16, 96)) if fixed else order[16:]  # BUG: slice after the shuffle
    return split_setup(Subset(full, train_idx), Subset(full, val_idx))


def setup_split_from_the_full_set(fixed: bool) -> dict[str, Any]:
    """https://github.com/edgarsmdn/MLCE_book/pull/4: the validation set is split off the full
    data with another seed, not off the training part: it overlaps train (and test)."""
    rows = Images(100)
    rest, _test = train_test_split(list(range(100)), seed=0)
    train_idx, val_idx = train_test_split(rest if fixed else list(range(100)), seed=1)
    if not fixed:
        train_idx = rest  # BUG: train keeps all of `rest`, val drawn from everything
    train = TensorDataset(rows.data[train_idx], rows.targets[train_idx])
    val = TensorDataset(rows.data[val_idx], rows.targets[val_idx])
    return split_setup(train, val)


def train_test_split(items: list[int], seed: int) -> tuple[list[int], list[int]]:
    """sklearn's train_test_split(items, test_size=0.2, random_state=seed), in short."""
    perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = len(items) - len(items) // 5
    return [items[i] for i in perm[:cut]], [items[i] for i in perm[cut:]]


def setup_train_loader_over_the_full_set(fixed: bool) -> dict[str, Any]:
    """https://github.com/ratschlab/aestetik/pull/12: random_split builds train and val subsets,
    but the train DataLoader wraps the full dataset, so validation samples are trained on."""
    full = Images(96)
    train, val = torch.utils.data.random_split(
        full, [80, 16], generator=torch.Generator().manual_seed(0)
    )
    return split_setup(train if fixed else full, val)  # BUG (unfixed): the full dataset


def setup_split_after_augmentation(fixed: bool) -> dict[str, Any]:
    """https://github.com/udacity/deep-learning-v2-pytorch/issues/132 (and
    https://github.com/gpleiss/efficient_densenet_pytorch/issues/51): the dataset is built with
    the training transform and then split: the validation part is augmented too."""
    if fixed:
        train_part = Images(96, transform=jitter)
        val_part = Images(96)  # the same rows, built again without augmentation
    else:
        train_part = val_part = Images(96, transform=jitter)  # BUG: one dataset, one transform
    idx = torch.randperm(96, generator=torch.Generator().manual_seed(0)).tolist()
    return split_setup(Subset(train_part, idx[16:]), Subset(val_part, idx[:16]))


def setup_val_given_train_transform(fixed: bool) -> dict[str, Any]:
    """https://github.com/ildoonet/pytorch-randaugment/issues/16: with a validation ratio, the
    validation loader is given the training transforms (RandAugment included)."""
    return split_setup(Images(80, jitter, seed=0), Images(16, None if fixed else jitter, seed=1))


def setup_split_drawn_twice(fixed: bool) -> dict[str, Any]:
    """https://github.com/TensorAuto/OpenTau/pull/498 (one process's form): random_split takes
    its permutation from the global RNG, and the train and val subsets come from two draws of
    it, so they partition the dataset differently."""
    full = Images(96)
    with rng_isolated(seed=5):
        if fixed:
            g = torch.Generator().manual_seed(0)
            train, val = torch.utils.data.random_split(full, [80, 16], generator=g)
        else:
            train, _ = torch.utils.data.random_split(full, [80, 16])  # the global RNG
            _, val = torch.utils.data.random_split(full, [80, 16])  # BUG: another partition
    return split_setup(train, val)


def setup_ffpn_val_transform(fixed: bool) -> dict[str, Any]:
    """https://github.com/shigen-StoneRoot/FFPN/issues/2: `val_transform = train_transform`."""
    train_transform = jitter
    val_transform = None if fixed else train_transform  # BUG (unfixed)
    return split_setup(Images(80, train_transform), Images(16, val_transform, seed=1))


SPLIT_HELD_OUT = [
    ("train_val_overlap", setup_split_drawn_twice, "error"),
    ("eval_augmented", setup_ffpn_val_transform, "warning"),
]

SPLIT_CASES = [
    ("train_val_overlap", setup_split_shuffled_then_sliced, "error"),
    ("train_val_overlap", setup_split_from_the_full_set, "error"),
    ("train_val_overlap", setup_train_loader_over_the_full_set, "error"),
    ("eval_augmented", setup_split_after_augmentation, "warning"),
    ("eval_augmented", setup_val_given_train_transform, "warning"),
]

HELD_OUT_SETUPS = [setup_onehot_npy, setup_separate_transforms]
_MISSED = "held-out miss, kept as tested once: "
HELD_OUT = [
    pytest.param("labels_truncated", setup_onehot_npy, "error", marks=pytest.mark.xfail(
        strict=True, reason=_MISSED + "a 0/1 mask scaled to 0/(1/255) feeds BCE as floats; "
        "labels_truncated reads only class ids cut by .long()")),
    pytest.param("pair_transform_mismatch", setup_separate_transforms, "error",
        marks=pytest.mark.xfail(strict=True, reason=_MISSED + "a rotation by up to 10 "
        "degrees was not judged then; turns are since, but on these 8 x 8 scenes one moves "
        "the pixels by under one")),
]  # fmt: skip

CASES = [
    ("labels_truncated", setup_scaled_mask, "error"),
    ("batch_class_mix", setup_sorted, "warning"),
    ("pair_transform_mismatch", setup_pairs, "error"),
    ("pair_transform_mismatch", setup_turned_image_only, "error"),
    *SPLIT_CASES,
]
__all__ = ["CASES", "MLP", "good_step", "setup_stored_mixed"]
