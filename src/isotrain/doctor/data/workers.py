"""dataloader_worker_seed: DataLoader workers that share their random state.

The DataLoader seeds torch, `random` and `numpy.random` in each worker, but a generator the
dataset holds (numpy.random.default_rng(), random.Random(), a torch.Generator, a
RandomState) is copied into every worker as it is: each worker then draws the same
"random" augmentations, and every epoch again. The check asks the user's dataset for one
sample twice in each worker of a loader built like theirs (workers, worker_init_fn,
multiprocessing context), twice over, and compares what came back.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from isotrain.doctor.data.draw import getitem_at
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind

__all__ = ["WORKERS", "check_worker_seed"]

_NUMPY_GENERATORS = ("Generator", "RandomState")  # numpy.random's (numpy is not imported here)
_TIMEOUT_S = 60.0


def _digest(obj: Any) -> bytes:
    """A stable digest of a sample: tensors and arrays by bytes, containers by their items."""
    h = hashlib.sha1()

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            x = x.detach().cpu().contiguous().numpy()
        if isinstance(x, dict):
            for k in sorted(x, key=repr):
                feed(k)
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                feed(v)
        elif hasattr(x, "tobytes"):  # numpy arrays, PIL images
            h.update(x.tobytes())
        else:
            h.update(repr(x).encode())

    feed(obj)
    return h.digest()


def _as_is(sample: Any) -> Any:
    return sample


def _epoch(loader: DataLoader[Any], seeds: torch.Generator) -> dict[int, list[bytes]]:
    """One epoch of a probe loader over the user's own dataset, asking each of its workers
    twice for sample 0 (indices go round robin: ask j is worker j % workers): worker id ->
    the digests of what it returned, in order. `seeds` gives each epoch its base seed, as
    the global RNG gives the user's loader a new one per epoch."""
    n = loader.num_workers
    probe = DataLoader(
        loader.dataset, batch_size=None, sampler=[0] * (2 * n), num_workers=n,
        worker_init_fn=loader.worker_init_fn, collate_fn=_as_is,
        multiprocessing_context=loader.multiprocessing_context,
        generator=seeds, timeout=_TIMEOUT_S,
    )  # fmt: skip
    seen: dict[int, list[bytes]] = {}
    for j, sample in enumerate(probe):
        seen.setdefault(j % n, []).append(_digest(sample))
    return seen


def _is_generator(v: Any) -> bool:
    kind = type(v)
    from_numpy = kind.__module__.startswith("numpy.random") and kind.__name__ in _NUMPY_GENERATORS
    return from_numpy or isinstance(v, (random.Random, torch.Generator))


def _held(dataset: Any) -> list[str]:
    """The dataset's attributes that hold a random generator of their own."""
    return [
        f"{k} ({type(v).__module__.split('.')[0]}.{type(v).__name__})"
        for k, v in getattr(dataset, "__dict__", {}).items() if _is_generator(v)
    ]  # fmt: skip


def check_worker_seed(ctx: Context) -> list[Finding]:
    """Do the workers of the user's DataLoader draw the same random numbers?"""
    loader = ctx.source
    if not isinstance(loader, DataLoader) or loader.num_workers == 0:
        return []
    if isinstance(loader.dataset, IterableDataset):
        raise CannotRun("an IterableDataset: each worker iterates its own copy of the stream")
    if len(loader.dataset) == 0:  # type: ignore[arg-type]
        return []
    seeds = torch.Generator().manual_seed(0)
    first, second = _epoch(loader, seeds), _epoch(loader, seeds)
    draws = [d for d in first.values() if len(d) == 2]
    if not draws or all(a == b for a, b in draws):
        return []  # the sample is the same on every ask: nothing random to repeat
    firsts = [d[0] for d in draws]
    shared = len(draws) > 1 and len(set(firsts)) == 1
    again = not loader.persistent_workers and any(
        first[w][0] == second.get(w, [b""])[0] for w in first
    )
    if not shared and not again:
        return []
    what = []
    if shared:
        what.append(f"all {len(draws)} workers returned the same augmented sample 0")
    if again:
        what.append("each new epoch's workers return the same draws again")
    held = _held(loader.dataset)
    owner = f" (the dataset holds its own generator: {', '.join(held)})" if held else ""
    return [Finding(
        "dataloader_worker_seed", "warning", getitem_at(loader.dataset),
        f"asked twice for sample 0, each worker returned two different samples (random "
        f"augmentation), but {' and '.join(what)}: the workers share one random state{owner}",
        "draw from the generators the DataLoader seeds in each worker (torch, numpy.random, "
        "random), or seed the dataset's own per worker with torch.utils.data.get_worker_info"
        "(): def seed_worker(_): info = get_worker_info(); info.dataset.rng = "
        "np.random.default_rng(info.seed), then DataLoader(..., worker_init_fn=seed_worker)",
    )]  # fmt: skip


WORKERS = Check(
    "workers",
    (
        Kind(
            "dataloader_worker_seed",
            "DataLoader workers share a random state: augmentations repeat",
        ),
    ),
    check_worker_seed,
)
