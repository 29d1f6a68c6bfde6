"""pair_transform_mismatch: an image and its label mask moved by different geometric transforms.

A segmentation sample's mask must follow every flip and rotation of its image. Transforms
called once on the image and once on the mask draw their own coins (or the mask gets none),
and the pair no longer lines up. The check reads one sample several times (in a worker:
`draw`); when the image and the mask each come back as read 1 clearly flipped, turned by 90
degrees or as they were, they must have moved the same way; so too when each comes back
clearly turned by some angle (NOTE [small turns]). Crops, shifts and scalings are not judged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from isotrain.doctor.data.draw import Path, at, draw, getitem_at, leaves, map_style
from isotrain.doctor.ground.context import Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind

__all__ = ["PAIRS", "check_pair_transform"]

_DRAWS = 6  # reads of each sample
_MAX_CLASSES = 64  # a mask holds at most this many distinct values
_SAME, _APART = 0.98, 0.9  # correlation of a match, and below which the others must fall

Move = Callable[[torch.Tensor], torch.Tensor]
_MOVES: dict[str, Move] = {
    "as it was": lambda t: t,
    "flipped left-right": lambda t: t.flip(-1),
    "flipped upside down": lambda t: t.flip(-2),
    "turned 180 degrees": lambda t: t.flip(-1).flip(-2),
}
_SQUARE: dict[str, Move] = {
    "turned 90 degrees": lambda t: t.rot90(1, (-2, -1)),
    "turned 270 degrees": lambda t: t.rot90(-1, (-2, -1)),
    "transposed": lambda t: t.transpose(-2, -1),
}


def _pair(batch: Any, image: torch.Tensor) -> tuple[Path, Path] | None:
    """Where the batch holds the image (the model's input) and a label mask of its height and
    width (integer, or few distinct values)."""
    found = {id(t): p for p, t in leaves(batch)}
    if id(image) not in found or image.dim() < 3 or not image.is_floating_point():
        return None
    for path, t in leaves(batch):
        if t is image or t.dim() < 3 or t.shape[-2:] != image.shape[-2:]:
            continue
        if not t.is_floating_point() or len(t.unique()) <= _MAX_CLASSES:
            return found[id(image)], path
    return None


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two images' channel means (1 under brightness or contrast)."""
    x, y = (
        a.double().reshape(-1, *a.shape[-2:]).mean(0),
        b.double().reshape(-1, *b.shape[-2:]).mean(0),
    )
    x, y = x - x.mean(), y - y.mean()
    den = float(x.norm() * y.norm())
    return float((x * y).sum()) / den if den > 0 else 0.0


def _moved(ref: torch.Tensor, now: torch.Tensor, moves: dict[str, Move]) -> str | None:
    """The one move that turns `ref` into `now` (photometric changes aside), if exactly one."""
    if now.shape != ref.shape:
        return None
    scores = {name: _corr(move(ref), now) for name, move in moves.items()}
    best = max(scores, key=scores.__getitem__)
    rest = [v for k, v in scores.items() if k != best]
    return best if scores[best] >= _SAME and all(v < _APART for v in rest) else None


# NOTE [small turns]
# A rotation by an arbitrary angle (RandomRotation((-10, 10))) is found by turning read 1 about
# its centre by every whole degree in _ANGLES and keeping the angle whose channel mean best
# correlates with read k inside the central disc every turn keeps (photometric changes
# aside), on a copy at most _SIDE pixels wide. The angle counts only when it is clear: a
# correlation of _CLEAR or more, _PEAK above every angle _TURN degrees or more away from it
# (an image that looks the same turned, a blank one, says nothing). The image and its mask
# must come back turned by angles less than _TURN degrees apart.
_ANGLES = torch.arange(-30.0, 31.0)
_TURN, _CLEAR, _PEAK = 3.0, 0.98, 0.005
_SIDE = 64


def _turns(t: torch.Tensor) -> torch.Tensor:
    """(C, H, W) -> (len(_ANGLES), H, W): its channel mean turned by each angle (zeros outside)."""
    a = _ANGLES * math.pi / 180
    c, s, z = a.cos(), a.sin(), torch.zeros_like(a)
    theta = torch.stack([torch.stack([c, -s, z], -1), torch.stack([s, c, z], -1)], 1)
    grid = F.affine_grid(theta, [len(a), *t.shape], align_corners=False)
    return F.grid_sample(t.expand(len(a), *t.shape), grid, align_corners=False).mean(1)


def _small(t: torch.Tensor) -> torch.Tensor:
    """A float (C, H, W) copy at most _SIDE pixels on its longer side."""
    t = t.float().reshape(-1, *t.shape[-2:])
    scale = _SIDE / max(t.shape[-2:])
    if scale >= 1:
        return t
    size = (max(1, round(t.shape[-2] * scale)), max(1, round(t.shape[-1] * scale)))
    return F.interpolate(t[None], size=size, mode="area")[0]


def _angle(ref: torch.Tensor, now: torch.Tensor) -> float | None:
    """The whole-degree turn about the centre that maps `ref` onto `now`, if clear (NOTE
    [small turns])."""
    ref, now = _small(ref), _small(now)
    if ref.shape != now.shape:
        return None
    h, w = ref.shape[-2:]
    y, x = torch.meshgrid(torch.linspace(-1, 1, h), torch.linspace(-1, 1, w), indexing="ij")
    inside = x**2 + y**2 <= 0.8**2
    turned = _turns(ref).double()[:, inside]
    seen = now.double().mean(0)[inside]
    turned, seen = turned - turned.mean(1, keepdim=True), seen - seen.mean()
    den = turned.norm(dim=1) * seen.norm()
    if float(den.min()) <= 0:
        return None
    corr = (turned @ seen) / den
    best = int(corr.argmax())
    far = corr[(_ANGLES - _ANGLES[best]).abs() >= _TURN]
    clear = float(corr[best]) >= _CLEAR and float(far.max()) <= float(corr[best]) - _PEAK
    return float(_ANGLES[best]) if clear else None


def _mismatch(draws: list[Any], paths: tuple[Path, Path]) -> str | None:
    """How one sample's draws show the mask moved otherwise than its image, if they do: each
    against read 1, both moved by one clear flip or turn (small crops and angles keep the
    image near read 1 and are not judged), and not the same one."""
    pairs = [(at(b, paths[0])[0], at(b, paths[1])[0].float()) for b in draws]
    (image0, mask0) = pairs[0]
    square = image0.shape[-1] == image0.shape[-2]
    moves = {**_MOVES, **(_SQUARE if square else {})}
    for k, (image, mask) in enumerate(pairs[1:], 1):
        name, follows = _moved(image0, image, moves), _moved(mask0, mask, moves)
        if name is not None and follows is not None and name != follows:
            return f"read {k + 1}: the image came back {name} against read 1, the mask {follows}"
    for k, (image, mask) in enumerate(pairs[1:], 1):
        turn, follows_turn = _angle(image0, image), _angle(mask0, mask)
        if turn is not None and follows_turn is not None and abs(turn - follows_turn) >= _TURN:
            return (f"read {k + 1}: the image came back turned by {turn:+.0f} degrees against "
                    f"read 1, the mask by {follows_turn:+.0f}")  # fmt: skip
    return None


def check_pair_transform(ctx: Context) -> list[Finding]:
    """Reads of one sample whose image is flipped or turned while its mask is not (or not so)."""
    loader = map_style(ctx.source)
    if loader is None:
        return []
    try:
        image = ctx.main_input(ctx.batches[0])[0]
    except ValueError:
        return []
    paths = _pair(ctx.batches[0], image)
    if paths is None:
        return []
    n = len(loader.dataset)  # type: ignore[arg-type]
    samples = sorted({0, n // 2})
    draws = draw(loader, [i for i in samples for _ in range(_DRAWS)])
    for j, i in enumerate(samples):
        seen = _mismatch(draws[j * _DRAWS : (j + 1) * _DRAWS], paths)
        if seen is None:
            continue
        name = "".join(f"[{k!r}]" for k in paths[1])
        return [Finding(
            "pair_transform_mismatch", "error", getitem_at(loader.dataset),
            f"sample {i} read {_DRAWS} times: {seen} (mask: batch{name}); the model learns "
            "from labels that do not lie on their pixels",
            "draw each random geometric transform once per sample and apply it to image and "
            "mask together: torchvision.transforms.v2 with tv_tensors.Mask (v2.Compose(...)"
            "(image, mask)), albumentations' transform(image=..., mask=...), or one coin: "
            "if random.random() < 0.5: image, mask = TF.hflip(image), TF.hflip(mask)",
        )]  # fmt: skip
    return []


PAIRS = Check(
    "pair_transform_mismatch",
    (
        Kind(
            "pair_transform_mismatch",
            "an image and its label mask are flipped or turned (by any angle) by different "
            "transforms",
        ),
    ),
    check_pair_transform,
)
