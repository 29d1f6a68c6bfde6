"""Muon for the hidden matrices, AdamW for the rest, as one `torch.optim.Optimizer`.

One optimizer object, so that everything built for one (the guard's skip, the rollback copy,
snapshots, the doctor, the LR schedule) sees every parameter and all state: its parameter
groups and its `state` are those of two torch optimizers it holds, `torch.optim.Muon` and
`torch.optim.AdamW`, each stepping its own groups. Muon's step is scaled to AdamW's RMS
(`adjust_lr_fn="match_rms_adamw"`), so one learning rate and schedule serve both rules.

`Muon` is `torch.optim.Muon` (same state, groups and arguments) with its Newton-Schulz
iteration in the gradient's own dtype: torch's runs it in bf16, which CPUs without native
bf16 emulate (on an AVX2 core it took 1.06 s of a 1.5 s tiny-preset step; in fp32, 0.08 s).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["Muon", "MuonAdamW", "newton_schulz", "split_params"]

HIDDEN = re.compile(r"(^|\.)blocks\.")  # the transformer blocks, under any wrapper's prefix


def newton_schulz(
    g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The quintic Newton-Schulz iteration of Muon on g (..., rows, cols), in g's dtype:
    about U V^T of g's SVD (singular values pushed into roughly [0.5, 1.5])."""
    a, b, c = coefficients
    wide = g.size(-2) <= g.size(-1)
    x = g if wide else g.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x if wide else x.mT


class Muon(torch.optim.Muon):
    """`torch.optim.Muon` with the orthogonalisation in the gradient's dtype (fp32 for fp32
    weights) and same-shape matrices orthogonalised together, in one batched product."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Nesterov momentum, orthogonalise, decay and update, as torch's Muon does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                by_shape.setdefault(tuple(p.shape), []).append(
                    p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                )
            done = {
                shape: newton_schulz(
                    torch.stack(us), group["ns_coefficients"], group["ns_steps"], group["eps"]
                ).unbind(0)
                for shape, us in by_shape.items()
            }
            seen: dict[tuple[int, ...], int] = {}
            for p in params:
                shape = tuple(p.shape)
                i = seen[shape] = seen.get(shape, -1) + 1
                scale = 0.2 * max(shape) ** 0.5  # RMS matched to AdamW's ("match_rms_adamw")
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(done[shape][i], alpha=-group["lr"] * scale)
        return loss


def split_params(
    model: nn.Module,
) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's decayed, AdamW's not decayed): the blocks' 2-D matrices go to Muon;
    embeddings and the head (decayed) and every norm gain and bias (not decayed) to AdamW."""
    muon: list[nn.Parameter] = []
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dim() == 2 and HIDDEN.search(name):
            muon.append(p)
        else:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return muon, decay, no_decay


class MuonAdamW(torch.optim.Optimizer):
    """Muon on `model`'s hidden matrices and AdamW on the rest (`split_params`), one lr.

    Example:
        >>> opt = MuonAdamW(model, lr=4e-3, weight_decay=0.1)  # doctest: +SKIP
        >>> [g["rule"] for g in opt.param_groups]  # doctest: +SKIP
        ['muon', 'adamw', 'adamw']
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.95,
        fused: bool | None = None,
    ) -> None:
        muon_params, decay, no_decay = split_params(model)
        if not muon_params:
            raise ValueError("MuonAdamW found no 2-D matrix under a `blocks` module for Muon")
        muon = Muon(
            muon_params,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            adjust_lr_fn="match_rms_adamw",
        )
        adamw = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=betas,
            fused=fused,
        )
        for rule, opt in (("muon", muon), ("adamw", adamw)):
            for group in opt.param_groups:
                group["rule"] = rule
        self._rules = {"muon": muon, "adamw": adamw}
        # the very group dicts of both: a change of lr here reaches the optimizer that steps
        super().__init__([*muon.param_groups, *adamw.param_groups], {"lr": lr})
        self._share()

    def _share(self) -> None:
        """Point both torch optimizers at this object's groups and state (after every load)."""
        for rule, opt in self._rules.items():
            opt.param_groups = [g for g in self.param_groups if g["rule"] == rule]
            opt.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Muon's step on the hidden matrices, then AdamW's on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._rules.values():
            opt.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as any optimizer does, then share the new groups and state again."""
        super().load_state_dict(state_dict)
        self._share()
