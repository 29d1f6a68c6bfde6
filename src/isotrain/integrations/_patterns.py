"""Activation checkpointing and per-block compile for a model that a framework's trainer runs.

``GuardedTrainer`` and ``GuardCallback`` take ``checkpointing=`` and ``compile_blocks=`` and
apply them in place, in isotrain's build order: NOTE [patterns in trainers].
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from isotrain.checkpointing import ACPolicy, apply_activation_checkpointing, parse_policy
from isotrain.compile import compile_model, compiled_blocks

__all__ = ["CheckpointingOption", "CompileOption", "Patterns"]

CheckpointingOption = str | ACPolicy | dict[str, Any] | None
CompileOption = bool | dict[str, Any]

# NOTE [patterns in trainers]
# The five patterns in a trainer we do not own. The guard and isolated evaluation are the
# integration itself. QAT converts the model in place with its keys unchanged, so
# `quantize_layers(model, bits=...)` before handing the model over is the whole recipe (tested).
# Activation checkpointing and per-block compile are options, applied in place once the
# framework holds the model and before it runs a step: GuardedTrainer at construction (Trainer
# has put the model on its device; accelerate wraps it for DDP only in train()), GuardCallback
# in `on_fit_start` (after the module's own setup and configure_model). Checkpointing first,
# then compile, as the isotrain trainer builds. `checkpointing` is a policy ("full", "every:2",
# "selective") or apply_activation_checkpointing's keywords as a dict (`modules=` for blocks
# that are not an nn.ModuleList's children; `budget:` needs `example_inputs`, a real batch);
# `compile_blocks` is True or compile_model's keywords as a dict ({"backend": "aot_eager"}).
# Both stay on the model after training, as if the user had applied them; blocks compiled
# already (a second fit) are not compiled again.


def _checkpointing(option: CheckpointingOption, where: str) -> dict[str, Any] | None:
    if option is None:
        return None
    kwargs = dict(option) if isinstance(option, dict) else {"policy": option}
    policy = kwargs.get("policy")
    if policy is None:
        raise ValueError(f"{where}(checkpointing={{...}}) needs a 'policy', as in 'full'")
    policy = kwargs["policy"] = policy if isinstance(policy, ACPolicy) else parse_policy(policy)
    if (
        policy.kind == "budget"
        and "example_inputs" not in kwargs
        and "example_kwargs" not in kwargs
    ):
        raise ValueError(
            f"{where}(checkpointing='{policy}') needs a real batch to profile the blocks: pass "
            "checkpointing={'policy': ..., 'example_inputs': (batch,)} or call "
            "isotrain.checkpointing.apply_activation_checkpointing on the model first"
        )
    _check_keywords(apply_activation_checkpointing, kwargs, where, "checkpointing")
    return kwargs


def _compile(option: CompileOption, where: str) -> dict[str, Any] | None:
    if option is False:
        return None
    kwargs = {} if option is True else dict(option)
    _check_keywords(compile_model, kwargs, where, "compile_blocks")
    return kwargs


def _check_keywords(fn: Any, kwargs: dict[str, Any], where: str, option: str) -> None:
    known = set(inspect.signature(fn).parameters) - {"model"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"{where}({option}=...) got {', '.join(unknown)}, which {fn.__name__} does not "
            f"take; it takes {', '.join(sorted(known))}"
        )


class Patterns:
    """The checkpointing and compile options a trainer integration was given, validated.

    Example: ``Patterns("full", {"backend": "eager"}, "GuardedTrainer").apply(model)``
    """

    def __init__(
        self, checkpointing: CheckpointingOption, compile_blocks: CompileOption, where: str
    ) -> None:
        self.checkpointing = _checkpointing(checkpointing, where)
        self.compile = _compile(compile_blocks, where)

    def __bool__(self) -> bool:
        return self.checkpointing is not None or self.compile is not None

    def apply(self, model: nn.Module) -> None:
        """Checkpoint, then compile `model`'s blocks in place (NOTE [patterns in trainers])."""
        if self.checkpointing is not None:
            apply_activation_checkpointing(model, **self.checkpointing)
        if self.compile is not None and not compiled_blocks(model):  # never twice (a 2nd fit)
            compile_model(model, **self.compile)
