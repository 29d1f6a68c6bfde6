"""unregistered_parameter: a forward that computes with an `nn.Parameter` the model does not own.

A module kept in a plain list, dict or tuple (or closed over, or global) runs in the forward,
but `model.parameters()`, `state_dict()`, `.to()`, `train()`/`eval()` and DDP never see it.
One forward with grad on, watched by a TorchFunctionMode, lists every Parameter an op reads;
those the model does not hold are named by where they hang (`layers[0].weight`) or the line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from isotrain._shared import buffers_restored
from isotrain.doctor.ground.context import CannotRun, Context
from isotrain.doctor.ground.finding import Finding
from isotrain.doctor.ground.kinds import Check, Kind
from isotrain.doctor.ground.watch import user_site

__all__ = ["UNREGISTERED", "check_unregistered"]

_DEPTH = 4  # how deep in nested lists/dicts an attribute's modules are looked for
_REGISTRIES = ("_parameters", "_buffers", "_modules")  # what the model registers itself


class _ParamReads(TorchFunctionMode):
    """Every nn.Parameter an op reads while grad mode is on, with the first user line."""

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[int, tuple[nn.Parameter, str]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            for t in (*args, *kwargs.values()):
                if isinstance(t, nn.Parameter) and t.requires_grad and id(t) not in self.read:
                    self.read[id(t)] = (t, user_site().where)
        return func(*args, **kwargs)


def _hidden(obj: Any, path: str, depth: int, out: dict[int, str]) -> None:
    """Names of the Parameters inside a plain container (modules' ones included)."""
    if isinstance(obj, nn.Parameter):
        out.setdefault(id(obj), path)
    elif isinstance(obj, nn.Module):
        for name, p in obj.named_parameters():
            out.setdefault(id(p), f"{path}.{name}")
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _hidden(v, f"{path}[{i}]", depth - 1, out)
    elif depth > 0 and isinstance(obj, dict):
        for k, v in obj.items():
            _hidden(v, f"{path}[{k!r}]", depth - 1, out)


def _names(model: nn.Module) -> dict[int, str]:
    """Where each Parameter held in a module's plain attributes (not registered) hangs."""
    out: dict[int, str] = {}
    for mname, module in model.named_modules():
        for attr, value in vars(module).items():
            if attr not in _REGISTRIES and isinstance(value, (list, tuple, dict)):
                _hidden(value, f"{mname}.{attr}" if mname else attr, _DEPTH, out)
    return out


def _fully_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards some module of `model` (torch builds without distributed: never)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def check_unregistered(ctx: Context) -> list[Finding]:
    """unregistered_parameter: Parameters the forward computes with that the model lacks."""
    model, _ = ctx.fresh()
    if _fully_sharded(model):
        raise CannotRun(
            "FSDP2 computes with unsharded copies of the parameters it registers: run the "
            "doctor on the model before fully_shard"
        )
    call = ctx.call(ctx.batches[0])
    mode = _ParamReads()
    with torch.enable_grad(), buffers_restored([model]), mode:
        ctx.run_model(model, call)
    owned = {id(p) for p in model.parameters()}
    stray = [(p, where) for i, (p, where) in mode.read.items() if i not in owned]
    if not stray:
        return []
    names, held = _names(model), {id(p) for o in ctx.optimizers for g in o.param_groups
                                  for p in g["params"]}  # fmt: skip
    trained = [(p, w) for p, w in stray if id(p) in held]
    untrained = [(p, w) for p, w in stray if id(p) not in held]
    found = []
    for group, trains in ((untrained, False), (trained, True)):
        if group:
            found.append(_finding(group, names, trains=trains))
    return found


def _finding(
    group: list[tuple[nn.Parameter, str]], names: dict[int, str], *, trains: bool
) -> Finding:
    """One finding for the stray Parameters an optimizer holds (trains) or does not."""
    shown = [names.get(id(p), f"a {tuple(p.shape)} Parameter at {w}") for p, w in group]
    numel = sum(p.numel() for p, _ in group)
    where = ", ".join(shown[:3]) + (f" (+{len(shown) - 3})" if len(shown) > 3 else "")
    head = (
        f"the forward computes with {len(group)} Parameter(s) ({numel} values) the model does "
        "not register (model.parameters() and state_dict() lack them"
    )
    if trains:
        return Finding(
            "unregistered_parameter", "info", where,
            f"{head}); an optimizer holds them, so they train, but a checkpoint of the model "
            "loses them and .to(), train()/eval() and DDP do not reach them",
            "keep modules in nn.ModuleList / nn.ModuleDict and tensors in nn.ParameterList / "
            "nn.ParameterDict (or assign them as attributes) so the model owns them",
        )  # fmt: skip
    return Finding(
        "unregistered_parameter", "error", where,
        f"{head}), and no optimizer holds them: they never train, and a checkpoint, .to() and "
        "train()/eval() miss them",
        "keep modules in nn.ModuleList / nn.ModuleDict and tensors in nn.ParameterList / "
        "nn.ParameterDict (a plain list or dict hides them), then build the optimizer",
    )  # fmt: skip


UNREGISTERED = Check(
    "unregistered_parameter",
    (Kind("unregistered_parameter",
          "the forward computes with a Parameter the model does not register (a plain list)"),),
    check_unregistered,
)  # fmt: skip
