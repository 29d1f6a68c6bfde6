"""Every private PyTorch API isotrain touches, each behind one named helper.

PyTorch may change these without notice. Each was read from, and is tested on, torch 2.13.0
(the version CI installs and the floor in pyproject.toml); when a newer torch breaks one, this
file is the only place to fix. Nothing else in isotrain reaches into `torch._*`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

# -- dispatch modes (torch.utils._python_dispatch) -------------------------------------------
# The base class of a mode that sees every aten op below autograd (the doctor's op watch).
DispatchMode = TorchDispatchMode

__all__ = [
    "DataLoaderIter",
    "DispatchMode",
    "backend_compiler",
    "compile_metrics",
    "compiled_call",
    "compiler_stance",
    "conv_forward",
    "ddp_reduction_pending",
    "ddp_reset_reduction",
    "ddp_wrapped_params",
    "default_store",
    "dynamo_allows_rnn",
    "dynamo_backends",
    "dynamo_supported",
    "eager_call",
    "foreach_copy_",
    "foreach_norms",
    "function_modes",
    "group_by_device_and_dtype",
    "has_triton",
    "in_backward",
    "is_dynamo_error",
    "is_recompile_error",
    "non_persistent_buffer_names",
    "optimizer_set_up",
    "recompile_limit",
    "recompile_limit_at_least",
    "scaler_has_unscaled",
    "scaler_optimizer_state",
    "scaler_pending",
    "scaler_scale",
    "set_compiled_call",
    "set_grad_mode",
    "supports_found_inf",
    "tensor_version",
    "tree_leaves",
]


# -- DataLoader iterators (torch.utils.data.dataloader) ---------------------------------------
# The base of every DataLoader iterator: its __init__ draws the iterator's base seed from the
# loader's generator, the global RNG when it has none (shuffle=False too).
DataLoaderIter = torch.utils.data.dataloader._BaseDataLoaderIter


# -- torch function modes (torch.overrides) ---------------------------------------------------
def function_modes() -> list[Any]:
    """The torch function modes active now, outermost first (`with torch.device(...)`,
    `autocast_if_available(attention="fp32")`, a user's TorchFunctionMode)."""
    return list(torch.overrides._get_current_function_mode_stack())


# -- grad mode (torch._C) ---------------------------------------------------------------------
# The C setter itself: `with torch.no_grad()` builds Python objects worth ~2 us a call, which
# the guarded step (a fixed cost of every training step) avoids with a try/finally around this.
set_grad_mode: Callable[[bool], None] = torch._C._set_grad_enabled


# -- foreach kernels (torch.utils._foreach_utils, torch._foreach_*) ---------------------------
def group_by_device_and_dtype(
    tensors: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]]:
    """`tensors` grouped as `nn.utils.get_total_norm` groups them: {(device, dtype): (ts, idx)}."""
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

    groups = _group_tensors_by_device_and_dtype([tensors], with_indices=True)  # type: ignore[list-item]
    return {key: ([t for t in ts[0] if t is not None], idx) for key, (ts, idx) in groups.items()}


def foreach_norms(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The 2-norm of each tensor: one foreach kernel where supported, a loop otherwise."""
    from torch.utils._foreach_utils import _has_foreach_support

    if _has_foreach_support(tensors, device):
        return list(torch._foreach_norm(tensors, 2.0))
    return [torch.linalg.vector_norm(t, 2.0) for t in tensors]


def foreach_copy_(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copy each `src` tensor into its `dst` twin in one foreach kernel."""
    torch._foreach_copy_(dst, src)


# -- GradScaler and the fused optimizers' found_inf protocol ----------------------------------
def scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scaler's current scale tensor (None before its first `scale()` call)."""
    return scaler._scale


def scaler_optimizer_state(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The scaler's per-optimizer record: `stage` and `found_inf_per_device`."""
    return scaler._per_optimizer_states[id(optimizer)]


def scaler_has_unscaled(scaler: torch.amp.GradScaler, optimizer: Any) -> bool:
    """Whether `scaler.unscale_(optimizer)` ran since the last update (reads, never creates)."""
    state = scaler._per_optimizer_states.get(id(optimizer))
    return state is not None and state["stage"].name == "UNSCALED"


def scaler_pending(scaler: torch.amp.GradScaler) -> bool:
    """Whether the scaler recorded inf checks that `update()` has not consumed yet."""
    return any(s["found_inf_per_device"] for s in scaler._per_optimizer_states.values())


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` honours `optimizer.found_inf` (the fused Adam/AdamW/SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in optimizer.param_groups
    )


def optimizer_set_up(optimizer: Any) -> bool:
    """Whether torch.optim.Optimizer.__init__ ran on `optimizer` (a framework's wrapper that
    subclasses it only to delegate, such as accelerate's, never runs it: no step hooks)."""
    return hasattr(optimizer, "_optimizer_step_pre_hooks")


# -- tensors ----------------------------------------------------------------------------------
def tensor_version(t: torch.Tensor) -> int:
    """The tensor's in-place write counter (BatchNorm kernels update statistics without it)."""
    return t._version


def non_persistent_buffer_names(module: nn.Module) -> set[str]:
    """Names of `module`'s own buffers registered with persistent=False (not in its state dict)."""
    return set(module._non_persistent_buffers_set)


def conv_forward(conv: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`conv`'s convolution (padding mode, stride, groups...) of `x` with another `weight`."""
    return conv._conv_forward(x, weight, conv.bias)  # type: ignore[operator]


# -- Tensor.to arguments ----------------------------------------------------------------------
def to_target_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device a `Tensor.to(*args, **kwargs)` call moves to (None: it names none), read
    with torch's own parser of those arguments."""
    try:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
    except (TypeError, RuntimeError, ValueError):
        return None
    return device if isinstance(device, torch.device) else None


# -- pytrees ----------------------------------------------------------------------------------
def tree_leaves(obj: Any) -> list[Any]:
    """The leaves of nested tuples, lists, dicts and registered containers (model outputs)."""
    from torch.utils._pytree import tree_leaves as leaves

    return leaves(obj)


# -- dynamo and inductor ------------------------------------------------------------------------
def dynamo_supported() -> bool:
    """Whether torch.compile runs on this Python at all."""
    from torch._dynamo.eval_frame import is_dynamo_supported

    return is_dynamo_supported()


def dynamo_backends() -> list[str]:
    """Every registered torch.compile backend name, debug ones included."""
    return list(torch._dynamo.list_backends(exclude_tags=()))


def has_triton() -> bool:
    """Whether inductor can generate CUDA kernels here."""
    from torch.utils._triton import has_triton as triton

    return triton()


def is_dynamo_error(err: BaseException) -> bool:
    """Whether `err` came from dynamo or a compile backend, not from the user's code."""
    return isinstance(err, torch._dynamo.exc.TorchDynamoException)


def is_recompile_error(err: BaseException) -> bool:
    """Whether `err` is `fail_on_recompile` refusing a new graph (never a compile failure)."""
    names = ("RecompileError", "FailOnRecompileLimitHit")
    return isinstance(err, tuple(getattr(torch._dynamo.exc, n, ()) for n in names))


def compile_metrics() -> tuple[Any, dict[str, list[float]], Sequence[Any]]:
    """Dynamo's process-wide counters, timed sections and recent compilation metrics."""
    from torch._dynamo import utils

    return utils.counters, utils.compilation_time_metrics, tuple(utils.get_compilation_metrics())


def recompile_limit_at_least(n: int) -> contextlib.AbstractContextManager[Any]:
    """Raise dynamo's recompile limits (per frame, and accumulated) to at least `n` inside."""
    cfg = torch._dynamo.config
    return cfg.patch(
        recompile_limit=max(cfg.recompile_limit, n),
        accumulated_recompile_limit=max(cfg.accumulated_recompile_limit, n),
    )


def backend_compiler(
    backend: str | Callable[..., Any], mode: str | None, dynamic: bool | None
) -> Callable[..., Any]:
    """The `(gm, example_inputs) -> callable` compiler torch.compile builds from its
    `backend` and `mode` (inductor's mode-aware wrapper, or the registered backend)."""
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode, None, dynamic)
    return torch._TorchCompileWrapper(backend, mode, None, dynamic)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpoint recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


def dynamo_allows_rnn() -> bool:
    """`torch._dynamo.config.allow_rnn`: whether dynamo traces nn.RNN/GRU/LSTM (off by default)."""
    return bool(torch._dynamo.config.allow_rnn)


def recompile_limit() -> int:
    """Dynamo's per-frame recompile limit now (8 unless configured)."""
    return int(torch._dynamo.config.recompile_limit)


def compiler_stance() -> str:
    """The active `torch.compiler.set_stance` as text; "default" when dynamo never loaded."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never import it just to read
    stance = getattr(eval_frame, "_stance", None)
    if stance is None:
        return "default"
    text = str(stance.stance)
    if stance.skip_guard_eval_unsafe:
        text += " (skip_guard_eval_unsafe)"
    if stance.backend is not None:
        text += f" (backend={stance.backend!r})"
    return text


# -- nn.Module.compile() internals ------------------------------------------------------------
# `module.compile()` stores torch.compile(module._call_impl) in `module._compiled_call_impl`,
# which nn.Module.__call__ prefers; parameters and state-dict keys stay where they were.
def compiled_call(module: nn.Module) -> Callable[..., Any] | None:
    """The compiled callable `module.compile()` installed, or None."""
    return module._compiled_call_impl


def set_compiled_call(module: nn.Module, fn: Callable[..., Any] | None) -> None:
    """Install `fn` as what `module(...)` runs (None: the eager forward again)."""
    module._compiled_call_impl = fn


def eager_call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Call `module` eagerly (hooks included), bypassing its compiled callable."""
    return module._call_impl(*args, **kwargs)


# -- torch.distributed internals --------------------------------------------------------------
def default_store() -> Any:
    """The rendezvous store of the default process group (torchrun's TCPStore)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def ddp_wrapped_params(ddp: nn.Module) -> list[torch.Tensor] | None:
    """The parameters DistributedDataParallel put its gradient hooks on when it was built
    (None when this torch keeps them elsewhere)."""
    params = getattr(ddp, "_module_parameters", None)
    return list(params) if isinstance(params, list) else None


def ddp_reduction_pending(ddp: nn.Module) -> bool:
    """Whether DDP's reducer still waits for gradients of its last backward (its hooks sit on
    tensors that got none: the next forward would raise "Expected to have finished reduction")."""
    reducer = getattr(ddp, "reducer", None)
    try:
        reducer._check_reducer_finalized()  # type: ignore[union-attr]
    except RuntimeError:
        return True
    except AttributeError:
        return False
    return False


def ddp_reset_reduction(ddp: nn.Module) -> None:
    """Drop the reduction DDP's reducer waits for (what `_update_process_group` does first)."""
    ddp.reducer._reset_state()  # type: ignore[union-attr, operator]
