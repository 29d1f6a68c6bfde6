"""Correct training setups that do unusual but right things, each as `examine` keyword args.

An encoder-decoder with labels, LoRA with PEFT's default init, a GAN with two optimizers, a
graph network whose nodes exchange messages over dim 0, spectral_norm (both APIs), a biased
Linear before BatchNorm, LBFGS with a closure, a mixture of experts with a capacity, a GRU
under torch.compile, inverse-frequency class weights built from a count dict and indexed by
class id, an image and its mask turned together by a random angle. None of them has a bug:
the doctor must raise no error and no warning.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from tests.doctor import zoo_data, zoo_weights
from tests.doctor.zoo import adamw, features, seeded
from torch import nn

# -- LoRA: a frozen base Linear plus B @ A, B zero at init (PEFT's default) ------------------


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * 2.0


class LoRAMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = LoRALinear(nn.Linear(8, 32))
        self.fc2 = LoRALinear(nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


def lora() -> dict[str, Any]:
    model = seeded(LoRAMLP)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, weight_decay=0.0)
    return dict(model=model, optimizer=opt, batches=features(), task="classification",
                loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))  # fmt: skip


# -- a GAN: generator and discriminator, two optimizers, adversarial losses ------------------


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, real: torch.Tensor) -> torch.Tensor:
        return self.D(real)


def gan_step(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
    opt_g, opt_d = opts
    real = batch[0]
    z = torch.randn(real.shape[0], 4)
    fake = model.G(z)
    bce = F.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    opt_d.zero_grad(set_to_none=True)
    d_loss = bce(model.D(real), ones) + bce(model.D(fake.detach()), zeros)
    d_loss.backward()
    opt_d.step()
    opt_g.zero_grad(set_to_none=True)
    g_loss = bce(model.D(fake), ones)
    g_loss.backward()
    opt_g.step()
    return g_loss.detach()


def gan() -> dict[str, Any]:
    model = seeded(GAN)
    opts = [torch.optim.Adam(model.G.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(model.D.parameters(), lr=2e-4, betas=(0.5, 0.999))]  # fmt: skip
    return dict(model=model, optimizer=opts, batches=features(), step=gan_step)


# -- a graph network: nodes along dim 0 exchange messages over edges -------------------------


class GNN(nn.Module):
    def __init__(self, edges: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("edges", edges)  # (2, E): source, target node
        self.msg, self.upd, self.out = nn.Linear(8, 16), nn.Linear(24, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (nodes, features)
        src, dst = self.edges
        agg = torch.zeros(x.shape[0], 16).index_add_(0, dst, self.msg(x)[src])
        return self.out(F.relu(self.upd(torch.cat([x, agg], dim=1))))


def gnn(**kw: Any) -> dict[str, Any]:
    edges = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 0]])
    model = seeded(lambda: GNN(edges))
    return dict(model=model, optimizer=adamw(model), batches=features(), task="classification",
                loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]), **kw)  # fmt: skip


# -- spectral norm: power iteration writes buffers in every training forward ----------------


def spectral(legacy: bool) -> dict[str, Any]:
    sn = nn.utils.spectral_norm if legacy else nn.utils.parametrizations.spectral_norm

    def build() -> nn.Module:
        return nn.Sequential(sn(nn.Linear(8, 32)), nn.ReLU(), sn(nn.Linear(32, 4)))

    model = seeded(build)
    return dict(model=model, optimizer=adamw(model), batches=features(), task="classification",
                loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))  # fmt: skip


# -- a biased Linear before BatchNorm: the norm removes the bias's gradient ----------------


def bias_before_batchnorm() -> dict[str, Any]:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))

    model = seeded(build)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return dict(model=model, optimizer=opt, batches=features(), task="classification",
                loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))  # fmt: skip


# -- LBFGS: a closure evaluated several times per step -----------------------------------


def lbfgs_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    x, y = batch

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return opt.step(closure).detach()


def lbfgs() -> dict[str, Any]:
    model = seeded(lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=4)
    return dict(model=model, optimizer=opt, batches=features(), step=lbfgs_step,
                task="classification")  # fmt: skip


# -- a mixture of experts: top-1 routing with a capacity per expert ----------------------


class MoE(nn.Module):
    def __init__(self, d: int = 8, experts: int = 4, capacity_factor: float = 1.25) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.capacity_factor, self.head = capacity_factor, nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.softmax(self.router(x), dim=-1)  # (N, E)
        weight, choice = gate.max(dim=-1)
        load = torch.bincount(choice, minlength=len(self.experts)).float()
        capacity = int(torch.ceil(self.capacity_factor * load.mean()))  # a sync, by design
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().flatten()[:capacity]  # tokens over capacity drop
            out[idx] = expert(x[idx]) * weight[idx, None]
        return self.head(x + out)


def moe() -> dict[str, Any]:
    model = seeded(MoE)
    return dict(model=model, optimizer=adamw(model), batches=features(), task="classification",
                loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))  # fmt: skip


# -- a GRU encoder under torch.compile ---------------------------------------------------


class GRUClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru, self.head = nn.GRU(8, 16, batch_first=True), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, 8)
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def gru_compiled() -> dict[str, Any]:
    model = seeded(GRUClassifier)
    model.compile(backend="eager")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 5, 8, generator=g), torch.randint(0, 4, (4,), generator=g))] * 2
    return dict(model=model, optimizer=adamw(model), batches=batches, task="classification",
                loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]))  # fmt: skip


# -- an encoder-decoder (T5) with labels -------------------------------------------------


def t5() -> dict[str, Any]:
    import transformers

    cfg = transformers.T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                num_heads=2, decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    model = seeded(lambda: transformers.T5ForConditionalGeneration(cfg))
    g = torch.Generator().manual_seed(0)
    batches = [
        {"input_ids": torch.randint(1, 32, (4, 8), generator=g),
         "attention_mask": torch.ones(4, 8, dtype=torch.long),
         "labels": torch.randint(1, 32, (4, 6), generator=g)}
        for _ in range(2)
    ]  # fmt: skip
    return dict(model=model, optimizer=adamw(model, 1e-3), batches=batches,
                loss_fn=lambda m, b: m(**b).loss)  # fmt: skip


SETUPS = {
    "t5": t5, "lora": lora, "gan": gan, "gnn": lambda: gnn(samples_interact=True),
    "spectral_norm": lambda: spectral(False), "spectral_norm_legacy": lambda: spectral(True),
    "bias_before_batchnorm": bias_before_batchnorm, "lbfgs": lbfgs, "moe": moe,
    "gru_compiled": gru_compiled,
    "class_weights": lambda: zoo_weights.setup_weights_in_count_order(True),
    "turned_pairs": lambda: zoo_data.setup_turned_image_only(True),
}  # fmt: skip
