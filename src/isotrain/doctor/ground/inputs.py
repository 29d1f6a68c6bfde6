"""How the user's code calls the model: taken from their own step, never guessed.

NOTE [the user's call]
A check that runs a forward of its own (batch_mixing, causal_leak, nonfinite_forward, memory,
loss_at_init, the compile checks) calls the model exactly as the user's step does for that
batch: the step runs with a forward pre-hook on the model that records the first call's
arguments and stops the step right there (nothing after the call runs, and `Context.reset`
puts back what ran before it). So an RNN gets its hidden state, a graph model its adjacency,
a seq2seq model its masks, a model that computes its own loss its labels. Where the step calls
only the model's parts (a GAN's two networks), the user passes `forward=(model, batch) ->
output`; without it those checks say "not checked" and what to pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

__all__ = [
    "EpochStep", "Loader", "ModelCall", "Stop", "describe", "main_path", "rebuilt", "replaced",
    "swap_token",
]  # fmt: skip

Path = tuple[Any, ...]
_TARGETS = ("labels", "label", "targets", "target", "y")


class Stop(BaseException):
    """Raised by the recording hook to end the user's step at its model call (a BaseException,
    so a step's own `except Exception` does not swallow it)."""


@dataclass(frozen=True)
class ModelCall:
    """One batch's call of the model: the arguments the user's step passed it, or the user's
    `forward(model, batch)` with `args == (batch,)`."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    forward: Callable[[Any, Any], Any] | None = None

    def __call__(self, model: torch.nn.Module) -> Any:
        """The model's output for this call."""
        if self.forward is not None:
            return self.forward(model, *self.args)
        return model(*self.args, **self.kwargs)

    def main_input(self) -> torch.Tensor:
        """The input a perturbation changes: `input_ids` where there is one, else the first
        tensor of at least one dimension; ValueError when the call holds none."""
        return _get((self.args, self.kwargs), main_path(self.args, self.kwargs))

    def without_targets(self) -> ModelCall | None:
        """The call with what looks like its targets left out (positional arguments after the
        first, keywords named like labels), for a model that returns only its loss when given
        them; None when nothing would be left out."""
        kwargs = {k: v for k, v in self.kwargs.items() if k not in _TARGETS}
        if len(self.args) <= 1 and len(kwargs) == len(self.kwargs):
            return None
        return ModelCall(self.args[:1], kwargs)

    def with_main(self, x: torch.Tensor) -> ModelCall:
        """The same call with its main input replaced by `x`."""
        return self.with_at(main_path(self.args, self.kwargs), x)

    def with_at(self, path: Path, x: torch.Tensor) -> ModelCall:
        """The same call with the tensor at `path` (of `token_inputs`) replaced by `x`."""
        args, kwargs = replaced((self.args, self.kwargs), path, x)
        return ModelCall(args, kwargs, self.forward)

    def token_inputs(self) -> list[tuple[Path, torch.Tensor]]:
        """(path, ids) of each (batch, time) integer tensor the call passes, the main input
        first, arguments named like targets (`labels=`) left out: what a model may read as
        tokens (a decoder's input beside its encoder's)."""
        main = main_path(self.args, self.kwargs) if self.args or self.kwargs else ()
        found = [(p, t) for p, t in _leaves((self.args, self.kwargs))
                 if t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool
                 and not (p[0] == 1 and p[1] in _TARGETS)]  # fmt: skip
        return sorted(found, key=lambda pt: pt[0] != main)


def describe(path: Path) -> str:
    """A `token_inputs` path as the user wrote the call: `decoder_input_ids`, `argument 2`."""
    if not path:
        return "the batch"
    head = str(path[1]) if path[0] == 1 else f"argument {path[1] + 1}"
    return head + "".join(f"[{k!r}]" for k in path[2:])


def swap_token(ids: torch.Tensor, t: int) -> torch.Tensor | None:
    """`ids` (batch, time) with position `t` changed in every row, to the batch's largest
    token id or, where it is that already, its smallest (ids the model knows); None when
    every token is the same."""
    hi, lo = ids.max(), ids.min()
    if bool(hi == lo):
        return None
    y = ids.clone()
    y[:, t] = torch.where(ids[:, t] == hi, lo, hi)
    return y


def _leaves(obj: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """(path, tensor) of every tensor in nested tuples, lists and mappings, in order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))


def main_path(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Path:
    """Where the main input sits in (args, kwargs)."""
    found = [(p, t) for p, t in _leaves((args, kwargs)) if t.dim() >= 1]
    for p, _ in found:
        if p and p[-1] == "input_ids":
            return p
    if not found:
        raise ValueError("the model is called with no tensor of at least one dimension")
    return found[0][0]


def _get(obj: Any, path: Path) -> Any:
    for k in path:
        obj = obj[k]
    return obj


def rebuilt(like: Any, items: Any) -> Any:
    """`items` (a dict for a mapping, a list for a sequence) in the container type of `like`:
    its own class where that class takes them (a named tuple, a dict subclass), else a plain
    dict or tuple."""
    if isinstance(like, Mapping):
        try:
            return cast(Any, type(like))(items)
        except TypeError:
            return items
    if isinstance(like, list):
        return items
    return type(like)(*items) if hasattr(like, "_fields") else tuple(items)


def replaced(obj: Any, path: Path, new: Any) -> Any:
    """`obj` rebuilt with the value at `path` replaced (containers copied, never changed)."""
    if not path:
        return new
    key, rest = path[0], path[1:]
    if isinstance(obj, Mapping):
        return rebuilt(obj, {k: replaced(v, rest, new) if k == key else v for k, v in obj.items()})
    return rebuilt(obj, [replaced(v, rest, new) if i == key else v for i, v in enumerate(obj)])


class Loader(list):  # type: ignore[type-arg]
    """Batches handed to the user's epoch function or eval_fn, with the attributes of the
    loader they passed (dataset, sampler, batch_size) for code that reads them."""

    def __init__(self, batches: list[Any], source: Any) -> None:
        super().__init__(batches)
        self._source = source

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or self._source is None:
            raise AttributeError(name)
        return getattr(self._source, name)


class EpochStep:
    """The user's `epoch(model, optimizer, loader)` driven as a step over one batch (their own
    model.train(), zero_grad placement and per-batch schedule, as their loop runs them), and
    over several batches (`over`), to tell what runs once a batch from what runs once a call."""

    def __init__(self, epoch: Callable[[torch.nn.Module, Any, Any], Any], source: Any) -> None:
        self.__wrapped__ = epoch  # StepState reads the user's globals through it
        self.source = source

    def __call__(self, model: torch.nn.Module, optimizer: Any, batch: Any) -> Any:
        return self.over(model, optimizer, [batch])

    def over(self, model: torch.nn.Module, optimizer: Any, batches: list[Any]) -> Any:
        """One call of the user's epoch function over `batches`, as their own loader."""
        return self.__wrapped__(model, optimizer, Loader(list(batches), self.source))
