"""Small training setups, each with one bug written the way users write it, and a clean twin.

Every `setup_*` function returns the keyword arguments of `isotrain.doctor.examine`. The
models are tiny (a classifier MLP, a two-layer attention LM) so one examine takes well under
a second on one thread.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from isotrain.contexts import eval_mode, rng_isolated

# -- models ---------------------------------------------------------------------------------


class MLP(nn.Module):
    """Classifier: 8 features -> 4 classes, with dropout (and optionally an unused layer)."""

    def __init__(self, *, unused: bool = False, head_std: float | None = None) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 32), nn.Dropout(0.2), nn.Linear(32, 4)
        if unused:
            self.extra = nn.Linear(32, 32)  # BUG: defined, never called in forward
        if head_std is not None:
            nn.init.normal_(self.fc2.weight, std=head_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.relu(self.fc1(x))))


class Attention(nn.Module):
    def __init__(self, d: int, *, mask: str = "tril", score_scale: str = "divide") -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mask, self.score_scale = mask, score_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, C = x.shape[1:]
        q, k, v = self.qkv(x).split(C, dim=2)  # (B, T, C) each
        att = q @ k.transpose(-2, -1)  # (B, T, T)
        scale = math.sqrt(C) if self.score_scale == "divide" else 1 / math.sqrt(C)  # BUG: x*sqrt
        att = att / scale
        ones = torch.ones(T, T, device=x.device)
        allowed = torch.tril(ones) if self.mask == "tril" else torch.triu(ones)  # BUG: triu
        att = att.masked_fill(allowed == 0, float("-inf"))
        return self.proj(F.softmax(att, dim=-1) @ v)


class Block(nn.Module):
    def __init__(self, d: int, **kw: Any) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, **kw)
        self.ln2, self.mlp = nn.LayerNorm(d), nn.Sequential(nn.Linear(d, 2 * d), nn.GELU())
        self.out = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(self.mlp(self.ln2(x))))


class TinyLM(nn.Module):
    """A two-block attention LM: model(ids) -> logits (B, T, vocab)."""

    def __init__(
        self, vocab: int = 16, d: int = 16, T: int = 32, n_layer: int = 2, **kw: Any
    ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(T, d)
        self.blocks = nn.ModuleList(Block(d, **kw) for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class SeqMixer(nn.Module):
    """Per-position features through a time-major op, as an RNN-style layer wants them."""

    def __init__(self, *, bug: bool) -> None:
        super().__init__()
        self.fc, self.mix, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.fc(x).transpose(0, 1)  # (T, B, C): time-major
        h = torch.cumsum(self.mix(h), dim=0)  # a running sum over time
        h = h.view(B, T, C) if self.bug else h.transpose(0, 1)  # BUG: view, not transpose
        return self.out(h.mean(1))


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class PaddedClassifier(nn.Module):
    """Token classifier whose padding embedding is zero: RMSNorm without eps divides 0 by 0."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, padding_idx=0)
        self.norm, self.head = RMSNorm(8, eps), nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(ids)).mean(1))


# -- batches and steps ----------------------------------------------------------------------


def features(n: int = 3, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)
    ]


def tokens(n: int = 3, *, lengths: tuple[int, ...] = (16,), vocab: int = 16) -> list[Any]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (4, lengths[i % len(lengths)] + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def good_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = ce(model, batch)
    loss.backward()
    opt.step()
    return loss.detach()


def good_eval(model: nn.Module, batches: Any) -> float:
    with eval_mode(model):
        total = sum(ce(model, b) for b in batches)
    return float(total)


def adamw(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr)


def seeded(factory: Any, seed: int = 0) -> Any:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory()


def mlp_setup(**overrides: Any) -> dict[str, Any]:
    model = seeded(MLP)
    setup = dict(model=model, optimizer=adamw(model), batches=features(), step=good_step,
                 eval_fn=good_eval, task="classification")  # fmt: skip
    return setup | overrides


def lm_setup(**overrides: Any) -> dict[str, Any]:
    kw = overrides.pop("model_kw", {})
    model = seeded(lambda: TinyLM(**kw))
    setup = dict(model=model, optimizer=adamw(model), batches=tokens(), step=good_step,
                 eval_fn=good_eval, task="lm")  # fmt: skip
    return setup | overrides


# -- the bugs, as users write them ----------------------------------------------------------

LOGGED: list[float] = []


def step_with_item(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    opt.zero_grad()
    loss = ce(model, batch)
    loss.backward()
    opt.step()
    LOGGED.append(loss.item())  # BUG: a host sync every step
    return loss


def step_with_to_cpu(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    opt.zero_grad()
    loss = ce(model, batch)
    loss.backward()
    opt.step()
    LOGGED.append(loss.detach().to("cpu"))  # BUG: a host copy every step (a sync on a GPU)
    return loss.detach()


DEVICE = torch.device("cpu")  # where the model lives; on a GPU run, "cuda"


def step_moving_its_batch(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    x, y = (t.to(DEVICE) for t in batch)  # to the model's device: no sync on any device
    return good_step(model, opt, (x, y))


def step_with_mask(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    x, y = batch
    opt.zero_grad()
    logits = model(x)
    keep = y != 0
    loss = F.cross_entropy(logits[keep], y[keep])  # BUG: boolean-mask indexing
    loss.backward()
    opt.step()
    return loss


def eval_forgets_train(model: nn.Module, batches: Any) -> float:
    model.eval()  # BUG: never model.train() afterwards
    with torch.no_grad():
        return float(sum(ce(model, b) for b in batches))


def eval_without_eval(model: nn.Module, batches: Any) -> float:
    with torch.no_grad():  # BUG: no model.eval(): dropout on, BatchNorm statistics updated
        return float(sum(ce(model, b) for b in batches))


def eval_grad_off(model: nn.Module, batches: Any) -> float:
    with eval_mode(model, no_grad=False):
        torch.set_grad_enabled(False)  # BUG: never set back
        return float(sum(ce(model, b) for b in batches))


def eval_autocast_on(model: nn.Module, batches: Any) -> float:
    with eval_mode(model):
        torch.set_autocast_enabled("cpu", True)  # BUG: "faster eval", never turned off
        return float(sum(ce(model, b) for b in batches))


def eval_deterministic(model: nn.Module, batches: Any) -> float:
    torch.use_deterministic_algorithms(True)  # BUG: a global flag set for "reproducible eval"
    with eval_mode(model):
        return float(sum(ce(model, b) for b in batches))


def estimate_loss(model: nn.Module, batches: Any) -> float:
    """nanoGPT's estimate_loss: random validation batches from the global RNG."""
    with eval_mode(model):
        picks = torch.randint(len(batches), (4,))  # BUG: draws from the training RNG
        return float(sum(ce(model, batches[int(i)]) for i in picks))


def estimate_loss_isolated(model: nn.Module, batches: Any) -> float:
    with rng_isolated(seed=0):
        return estimate_loss(model, batches)


def step_zero_grad_late(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    loss = ce(model, batch)
    loss.backward()
    opt.zero_grad()  # BUG: clears the gradients before the update
    opt.step()
    return loss


_NOISE = np.random.default_rng()  # BUG: unseeded, and outside every RNG the run controls


def step_with_numpy_noise(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    x, y = batch
    noise = torch.from_numpy(_NOISE.normal(0.0, 0.1, size=x.shape).astype(np.float32))
    return good_step(model, opt, (x + noise, y))


def step_with_torch_noise(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    x, y = batch
    return good_step(model, opt, (x + 0.1 * torch.randn_like(x), y))


def step_raises(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    raise RuntimeError("shape mismatch in my step")


class BranchyBlock(nn.Module):
    """A block that picks its path with a Python `if` on a tensor: dynamo breaks the graph."""

    def __init__(self, d: int, *, bug: bool) -> None:
        super().__init__()
        self.fc, self.bug = nn.Linear(d, d), bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.bug:
            if h.mean() > 0:  # BUG: data-dependent Python branch
                return x + h
            return x - h
        return x + torch.where(h.mean() > 0, h, -h)


class BranchyNet(nn.Module):
    def __init__(self, *, bug: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BranchyBlock(8, bug=bug) for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)
