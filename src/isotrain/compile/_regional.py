"""torch.compile in place, block by block, with an eager fallback and no silent eager runs.

Example::

    model = compile_model(model, dynamic=False)       # compiles each block of model.blocks
    shapes = [torch.zeros(8, L, dtype=torch.long) for L in default_buckets(256)]
    stats = warmup(model, shapes)                      # one compile per bucket, timed apart
    with no_recompiles():                              # any new graph or eager block raises
        train(model)
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import sysconfig
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from isotrain._shared import BlockSpec, ForwardWrapper, find_blocks, find_forward, install_forward
from isotrain._torch_private import (
    compiled_call,
    compiler_stance,
    dynamo_allows_rnn,
    dynamo_backends,
    dynamo_supported,
    eager_call,
    has_triton,
    is_dynamo_error,
    is_recompile_error,
    set_compiled_call,
)
from isotrain.compile._coverage import CountingBackend, note_coverage, rnn_layers
from isotrain.compile._stats import call_counts, eager_reason, note_call, note_eager

__all__ = [
    "CompileAvailability",
    "compile_available",
    "compile_model",
    "compiled_blocks",
    "compiled_modules",
]


@dataclass(frozen=True)
class CompileAvailability:
    """Whether a backend can compile here (truthy when it can) and why.

    Example: ``if not (avail := compile_available("inductor")): print(avail.reason)``
    """

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok

    def __iter__(self) -> Iterator[Any]:  # ok, reason = compile_available(...)
        return iter((self.ok, self.reason))


def _find_cxx() -> str | None:
    names = [os.environ.get("CXX"), "clang++" if sys.platform == "darwin" else "g++", "c++"]
    if sys.platform == "win32":
        names = [os.environ.get("CXX"), "cl"]
    return next((p for n in names if n and (p := shutil.which(n))), None)


def compile_available(
    backend: str | Callable[..., Any] = "inductor", *, device: str | torch.device = "cpu"
) -> CompileAvailability:
    """Check, without compiling anything, whether ``backend`` can run on ``device`` here.

    Example: ``ok, reason = compile_available("inductor", device="cpu")``.
    """
    if not dynamo_supported():
        return CompileAvailability(False, f"torch.compile is not supported on Python {sys.version}")
    if callable(backend):
        return CompileAvailability(True, f"custom backend {getattr(backend, '__name__', backend)}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a name or a callable, got {type(backend).__name__}")
    known = dynamo_backends()
    if backend not in known:
        return CompileAvailability(False, f"unknown backend {backend!r}; known: {known}")
    dev = torch.device(device).type
    if backend != "inductor":
        return CompileAvailability(True, f"backend {backend!r} needs no toolchain")
    if dev == "cpu":
        cxx = _find_cxx()
        if cxx is None:
            return CompileAvailability(False, "inductor on CPU needs a C++ compiler (set CXX)")
        header = os.path.join(sysconfig.get_paths()["include"], "Python.h")
        if not os.path.exists(header):
            return CompileAvailability(False, f"inductor on CPU needs Python headers ({header})")
        return CompileAvailability(True, f"inductor on CPU with {cxx}")
    if dev == "cuda":
        if not torch.cuda.is_available():
            return CompileAvailability(False, "device is cuda but torch.cuda is not available")
        if not has_triton():
            return CompileAvailability(False, "inductor on CUDA needs triton (pip install triton)")
        return CompileAvailability(True, "inductor on CUDA with triton")
    return CompileAvailability(True, f"inductor on {dev}: toolchain not checked")


# NOTE [eager fallback]
# block.compile() stores torch.compile(block._call_impl) in block._compiled_call_impl, which
# nn.Module.__call__ prefers; the parameters and state-dict keys stay where they were. We wrap
# that callable: when dynamo or the backend fails, we rerun the call eagerly. If the eager call
# fails too, the error is the user's (e.g. a shape bug): raise the eager error and keep the
# compiled path. If it succeeds, compiling is what broke: warn once and switch every module of
# the same compile_model call back to eager for good. Recompile errors of no_recompiles() are
# not compile failures and always propagate.
class _FallbackGroup:
    """The modules of one compile_model call: they fall back to eager together."""

    def __init__(self, backend: object) -> None:
        self.backend, self.failed, self.retrying = backend, False, False
        self.warned_eager = False  # an eager block call of this group was reported
        self.modules: list[nn.Module] = []
        self.compiler: CountingBackend | None = None  # shared: blocks share their graphs
        self.most: dict[tuple[type[nn.Module], bool], int] = {}  # NOTE [graphs that ran]

    def counting(self, options: dict[str, Any]) -> CountingBackend:
        """The group's backend, counting graph runs (NOTE [graphs that ran])."""
        if self.compiler is None:
            mode = options.get("mode")
            self.compiler = CountingBackend(options["backend"], mode, options["dynamic"])
        return self.compiler

    def disable(self, err: BaseException) -> None:
        for m in self.modules:
            set_compiled_call(m, None)
        if not self.failed:
            self.failed = True
            first = (str(err).strip().splitlines() or [""])[0][:300]
            warnings.warn(
                f"torch.compile failed with backend {self.backend!r} ({type(err).__name__}: "
                f"{first}); running {len(self.modules)} module(s) eagerly from now on. "
                "Fix the toolchain or pass fallback=False to compile_model to see the error.",
                RuntimeWarning,
                stacklevel=3,
            )


class _GuardedCall:
    """What `module(...)` runs once compiled: counts the call, falls back on compile failure."""

    __slots__ = ("compiled", "fallback", "group", "module")

    def __init__(
        self, module: nn.Module, compiled: Callable[..., Any], group: _FallbackGroup, fallback: bool
    ) -> None:
        self.module, self.compiled, self.group, self.fallback = module, compiled, group, fallback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        note_call()
        before = call_counts()
        if not self.fallback:
            out = self.compiled(*args, **kwargs)
            note_coverage(self.module, before, self.group)
            return out
        try:
            out = self.compiled(*args, **kwargs)
            note_coverage(self.module, before, self.group)
            return out
        except Exception as err:
            if not is_dynamo_error(err) or is_recompile_error(err):
                raise
            self.group.retrying = True  # the eager rerun below is ours, not dynamo's fallback
            try:
                out = eager_call(self.module, *args, **kwargs)
            except Exception as eager_err:
                raise eager_err from err  # the user's error: keep the compiled path
            finally:
                self.group.retrying = False
            self.group.disable(err)
            return out


# NOTE [eager block calls]
# Dynamo compiles the first frame past nn.Module's own call machinery, which is the module's
# forward; when that frame hits dynamo's recompile limit, later calls matching no cached graph
# run the Python forward with no word (4 of 12 GPT-2 blocks, 6 of 16 ResNet blocks). So
# compile_model puts a small forward in front of each block's (NOTE [instance forwards]): its
# first line `if not torch.compiler.is_compiling(): ...` is folded away when dynamo traces it,
# and runs only when the forward runs as Python, i.e. eagerly. Then it counts the call and says
# why (raising inside no_recompiles). Each block class gets its own copy of that code object,
# because dynamo keeps graphs and the recompile limit per code object, as it does per class
# forward without us. A copied or unpickled model (torch drops compiled code on both) compiles
# again with the same options at its first call.
class _Compiled(ForwardWrapper):
    """A compiled block's forward: notices when it runs eagerly (NOTE [eager block calls])."""

    def __init__(
        self, module: nn.Module, inner: Any, options: dict[str, Any] | None, group: Any
    ) -> None:
        super().__init__(module, inner)
        self.options, self.group = options, group

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            _eager_probe()(self)
        return self.call_inner(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        backend = (self.options or {}).get("backend")
        options = self.options if isinstance(backend, str) else None  # a callable may not pickle
        return (_rebuild, (self.module, self.inner, options))


_CLASSES: dict[type[nn.Module], type[_Compiled]] = {}


def _compiled_class(cls: type[nn.Module]) -> type[_Compiled]:
    """`_Compiled` with a `__call__` code object of its own for block class `cls`."""
    made = _CLASSES.get(cls)
    if made is None:
        call: Any = _Compiled.__call__
        name = f"{cls.__name__}_compiled_forward"
        code = call.__code__.replace(co_name=name)
        if hasattr(code, "co_qualname"):
            code = code.replace(co_qualname=name)
        fn = types.FunctionType(code, call.__globals__, name, call.__defaults__, call.__closure__)
        made = type(f"_Compiled_{cls.__name__}", (_Compiled,), {"__call__": fn})
        _CLASSES[cls] = made
    return made


def _rebuild(module: nn.Module, inner: Any, options: dict[str, Any] | None) -> _Compiled:
    return _compiled_class(type(module))(module, inner, options, None)


def _eager_probe_impl(wrapper: _Compiled) -> None:
    module, group = wrapper.module, wrapper.group
    if compiled_call(module) is not None:  # dynamo ran this forward as Python
        quiet = compiler_stance().startswith("force_eager") or getattr(group, "retrying", False)
        first = group is not None and not group.warned_eager
        note_eager(module, None if quiet else eager_reason(module), warn=first)
        if first and not quiet:
            group.warned_eager = True  # one warning per compile_model call; every call counted
        return
    note_call()  # this call did not pass _GuardedCall: count it here
    if group is None and wrapper.options is not None:  # a copy: torch dropped compiled code
        _compile(module, wrapper.options, _FallbackGroup(wrapper.options["backend"]), True)
        note_eager(module, None)  # compiled again from its next call
        return
    why = None  # else the compile failure was reported when it happened
    if group is None:
        why = (
            f"a copy of a compiled {type(module).__name__} block runs eagerly: copying and "
            "pickling drop compiled code, and its backend (not a name) cannot be pickled; "
            "call compile_model on the copy"
        )
        wrapper.group = _FallbackGroup(None)
        wrapper.group.failed = True  # said once
    note_eager(module, why)


@functools.cache
def _eager_probe() -> Callable[[_Compiled], None]:
    """The probe, never traced (the branch calling it folds away) and never compiled as a frame
    of its own; wrapped on first use, as `torch.compiler.disable` imports dynamo (2.5 s)."""
    return torch.compiler.disable(_eager_probe_impl)


def compiled_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`(name, module)` of every module compile_model compiled inside `model`."""
    return [(n, m) for n, m in model.named_modules() if find_forward(m, _Compiled) is not None]


def compiled_blocks(model: nn.Module) -> list[str]:
    """Names of the modules of `model` that `compile_model` compiled, in model order ("" is
    the model itself, with `regional=False`); empty when it compiled nothing (no backend).

    Example: ``compile_model(model, backend="eager"); compiled_blocks(model)  # ['blocks.0', ...]``
    """
    return [name for name, _ in compiled_modules(model)]


def _model_device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


# NOTE [buckets and dynamic]
# With dynamic=None torch compiles the first shape static, then on the second distinct length
# marks that dim dynamic and compiles one symbolic graph (automatic_dynamic_shapes). With a few
# length buckets we prefer dynamic=False: one static graph per bucket (best kernels, CUDA graphs
# possible), all compiled by warmup() up front; blocks share the graphs (same code, same
# shapes). Keep the batch size fixed (drop_last) or each short batch is one more shape, and
# eval under no_grad is one more graph per bucket (warmup(..., also_eval=True)).
def compile_model(
    model: nn.Module,
    *,
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    regional: bool = True,
    backend: str | Callable[..., Any] = "inductor",
    modules: BlockSpec = None,
    fallback: bool = True,
) -> nn.Module:
    """Compile ``model`` in place, block by block (``regional=True``) or whole; returns it.

    Blocks are the children of every outermost ``nn.ModuleList`` (e.g. ``model.blocks``)
    unless ``modules`` gives block types or a ``(name, module)`` predicate. In place means
    state-dict keys do not change. With ``fallback=True`` a backend that cannot run here, or a
    compile that fails at a call, gives one ``RuntimeWarning`` and eager execution instead of a
    crash. With length buckets pass ``dynamic=False``: each bucket gets its own static graph.

    Example: ``compile_model(model, dynamic=False, backend="inductor")``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not regional and modules is not None:
        raise ValueError("modules= selects blocks for regional=True; drop it or set regional=True")
    targets = (
        [m for _, m in find_blocks(model, modules, purpose="blocks to compile")]
        if regional
        else [model]
    )
    available = compile_available(backend, device=_model_device(model))
    if not available:
        if not fallback:
            raise RuntimeError(f"cannot compile with backend {backend!r}: {available.reason}")
        warnings.warn(
            f"not compiling: {available.reason}; the model runs eagerly",
            RuntimeWarning,
            stacklevel=2,
        )
        return model
    group = _FallbackGroup(backend)
    options: dict[str, Any] = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if mode is not None:
        options["mode"] = mode
    _warn_rnn(targets)
    for m in targets:
        _compile(m, options, group, fallback)
    return model


def _warn_rnn(targets: list[nn.Module]) -> None:
    """Say up front that recurrent layers stay eager while dynamo's allow_rnn is off."""
    rnn = [(m, n) for m in targets for n in rnn_layers(m)]
    if rnn and not dynamo_allows_rnn():
        m, n = rnn[0]
        layer = type(m.get_submodule(n)).__name__
        warnings.warn(
            f"compile_model: {len(rnn)} recurrent layer(s) ({layer} in a {type(m).__name__} "
            "block, ...) are not compiled: dynamo does not trace nn.RNN/GRU/LSTM while "
            "torch._dynamo.config.allow_rnn is off, so each runs eagerly with a graph break, "
            "and a block that is only that layer runs no compiled graph at all. To trace them, "
            "compile and warm up inside torch._dynamo.config.patch(allow_rnn=True)",
            RuntimeWarning,
            stacklevel=3,
        )


def _compile(
    module: nn.Module, options: dict[str, Any], group: _FallbackGroup, fallback: bool
) -> None:
    """module.compile(**options), behind the counting call and the probing forward."""
    backend = group.counting(options)  # carries the mode (NOTE [graphs that ran])
    module.compile(
        **{k: v for k, v in options.items() if k not in ("mode", "backend")}, backend=backend
    )
    compiled = compiled_call(module)
    assert compiled is not None  # module.compile() just installed it
    set_compiled_call(module, _GuardedCall(module, compiled, group, fallback))
    group.modules.append(module)
    if find_forward(module, _Compiled) is None:
        install_forward(module, _compiled_class(type(module)), dict(options), group)
    else:
        find_forward(module, _Compiled).group = group
