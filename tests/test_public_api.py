"""The public API: every exported name is documented; the seed's names work as it calls them."""

import ast
import importlib
from pathlib import Path

import torch

import isotrain


def test_every_exported_name_exists_and_is_documented() -> None:
    for name in isotrain.__all__:
        obj = getattr(isotrain, name)
        if name == "quantize":  # the seed's alias `StraightThroughEstimator.apply`
            obj = isotrain.StraightThroughEstimator
        if name != "__version__":
            assert (obj.__doc__ or "").strip(), f"isotrain.{name} has no docstring"


def test_seed_names_are_public() -> None:
    for name in (
        "StraightThroughEstimator",
        "quantize",
        "CheckpointedTransformerBlock",
        "safe_backward",
        "eval_mode",
        "autocast_if_available",
    ):
        assert name in isotrain.__all__


def test_seed_quantize_call_shapes() -> None:
    x = torch.rand(4, 16, requires_grad=True)
    y = isotrain.quantize(x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert torch.allclose(y * 255, (y * 255).round())
    assert torch.allclose(isotrain.quantize(x, 4) * 3, (isotrain.quantize(x, 4) * 3).round())


def test_the_lazy_api_and_its_typed_imports_name_the_same_homes() -> None:
    """NOTE [lazy public API]: `_EXPORTS` (run time), the `if TYPE_CHECKING:` imports (type
    checkers) and `__all__` list the same names, each from the package that defines it."""
    tree = ast.parse(Path(isotrain.__file__).read_text())
    typed = {
        alias.name: node.module
        for block in tree.body
        if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == isotrain._HOME
    assert sorted(typed) == sorted(n for n in isotrain.__all__ if n != "__version__")
    for name, home in typed.items():
        assert getattr(isotrain, name) is getattr(importlib.import_module(home), name), name
    assert isotrain.guard is importlib.import_module("isotrain.guard")
