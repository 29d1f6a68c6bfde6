"""Training setups rebuilt from public repositories' own training code, each with the repo's
own way of calling its model, its optimizer wrapper and its step, on tiny synthetic data.

Every `real_*` function returns the keyword arguments of `isotrain.doctor.examine`; each is
correct code, so the doctor owes it no error and no warning (each docstring names the source
and what in it is unusual for a checker).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from tests.doctor.zoo_loops import LOOPS
from torch import nn

__all__ = ["REAL"]


def _seeded(setup: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """`setup` built under seed 0, the caller's RNG untouched."""

    @functools.wraps(setup)
    def built() -> dict[str, Any]:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return setup()

    return built


class WordRNN(nn.Module):
    """pytorch/examples word_language_model: an LSTM that takes and returns its hidden state."""

    def __init__(self, vocab: int = 50, hidden: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.rnn = nn.LSTM(hidden, hidden)
        self.drop = nn.Dropout(0.2)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor, hidden: Any) -> tuple[torch.Tensor, Any]:
        out, hidden = self.rnn(self.drop(self.emb(x)), hidden)
        return self.out(self.drop(out)), hidden


@_seeded
def real_rnn_carried_state() -> dict[str, Any]:
    """word_language_model's train(): hidden carried across batches and detached
    (repackage_hidden), clip_grad_norm_, time-major batches."""
    model = WordRNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    state: dict[str, Any] = {"hidden": (torch.zeros(1, 4, 16), torch.zeros(1, 4, 16))}

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        model.train()
        hidden = tuple(h.detach() for h in state["hidden"])
        opt.zero_grad()
        out, state["hidden"] = model(x, hidden)
        loss = F.cross_entropy(out.view(-1, out.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        return loss

    batches = [(torch.randint(0, 50, (6, 4)), torch.randint(0, 50, (6, 4))) for _ in range(3)]
    return {"model": model, "optimizer": opt, "batches": batches, "step": step}


class GCN(nn.Module):
    """tkipf/pygcn: two graph convolutions over a sparse, normalised adjacency."""

    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.w1 = nn.Linear(features, hidden)
        self.w2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = F.relu(torch.sparse.mm(adj, self.w1(x)))
        h = F.dropout(h, 0.5, self.training)
        return F.log_softmax(torch.sparse.mm(adj, self.w2(h)), dim=1)


@_seeded
def real_gcn_sparse_graph() -> dict[str, Any]:
    """pygcn's train(): the whole graph every step, a sparse adjacency, nll_loss on the training
    nodes only; nodes pass messages by design (samples_interact)."""
    n = 12
    dense = (torch.rand(n, n) < 0.3).float() + torch.eye(n)
    adj = (dense / dense.sum(1, keepdim=True)).to_sparse()
    graph = (torch.randn(n, 8), adj, torch.randint(0, 3, (n,)), torch.arange(8))
    model = GCN()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, adj, labels, idx = batch
        model.train()
        opt.zero_grad()
        loss = F.nll_loss(model(x, adj)[idx], labels[idx])
        loss.backward()
        opt.step()
        return loss

    return {"model": model, "optimizer": opt, "batches": [graph, graph], "step": step,
            "samples_interact": True}  # fmt: skip


class Seq2Seq(nn.Module):
    """A translation model on nn.Transformer, called with its padding and causal masks."""

    def __init__(self, vocab: int = 30, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.core = nn.Transformer(d, 2, 1, 1, 32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_pad: torch.Tensor,
                tgt_mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        h = self.core(self.emb(src), self.emb(tgt), tgt_mask=tgt_mask,
                      src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad)  # fmt: skip
        return self.out(h)


@_seeded
def real_seq2seq_masks() -> dict[str, Any]:
    """The PyTorch translation tutorial's train_epoch: target shifted by hand, a causal mask,
    padding masks, cross_entropy with ignore_index=PAD."""
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        src, tgt = batch
        tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
        mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
        logits = model(src, tgt_in, src == 0, mask)
        opt.zero_grad()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1),
                               ignore_index=0)  # fmt: skip
        loss.backward()
        opt.step()
        return loss

    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        src, tgt = torch.randint(1, 30, (4, 7)), torch.randint(1, 30, (4, 8))
        src[:, -2:] = 0
        tgt[:, -1] = 0
        return src, tgt

    return {"model": model, "optimizer": opt, "batches": [pair(), pair()], "step": step}


@_seeded
def real_contrastive_pair() -> dict[str, Any]:
    """SimCLR's train loop: two augmented views of each image through one encoder, the NT-Xent
    loss over the 2B embeddings (samples are compared with each other by design)."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 16))
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        v1, v2 = batch
        z = F.normalize(torch.cat([model(v1), model(v2)]), dim=1)
        sim = z @ z.T / 0.5
        sim.fill_diagonal_(float("-inf"))
        b = v1.shape[0]
        targets = torch.cat([torch.arange(b, 2 * b), torch.arange(b)])
        loss = F.cross_entropy(sim, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    def views() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(6, 3, 8, 8)
        return x + 0.1 * torch.randn_like(x), x.flip(-1)

    return {"model": model, "optimizer": opt, "batches": [views(), views()], "step": step}


@_seeded
def real_gan_two_networks() -> dict[str, Any]:
    """pytorch/examples DCGAN's loop: D then G, each with its own Adam; the step calls the two
    networks, never the container examine is given."""
    gan = nn.ModuleDict({
        "G": nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh()),
        "D": nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1)),
    })  # fmt: skip
    opt_d = torch.optim.Adam(gan["D"].parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(gan["G"].parameters(), lr=2e-4, betas=(0.5, 0.999))

    def step(model: nn.Module, opts: Any, batch: Any) -> torch.Tensor:
        opt_d, opt_g = opts
        real = batch
        noise = torch.randn(real.shape[0], 4)
        fake = model["G"](noise)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        opt_d.zero_grad()
        d_loss = F.binary_cross_entropy_with_logits(model["D"](real), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(model["D"](fake.detach()), zeros)
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss = F.binary_cross_entropy_with_logits(model["D"](fake), ones)
        g_loss.backward()
        opt_g.step()
        return g_loss

    batches = [torch.rand(6, 8) * 2 - 1 for _ in range(2)]
    return {"model": gan, "optimizer": [opt_d, opt_g], "batches": batches, "step": step}


class OwnLossGPT(nn.Module):
    """nanoGPT's GPT.forward(idx, targets): returns (logits, loss) and computes its own loss."""

    def __init__(self, vocab: int = 40, d: int = 16, context: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos(torch.arange(t))
        h = h + torch.tril(torch.ones(t, t)).div(torch.arange(1, t + 1)[:, None]) @ self.mix(h)
        logits = self.head(h)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


@_seeded
def real_model_returns_its_loss() -> dict[str, Any]:
    """nanoGPT's train.py: `logits, loss = model(X, Y)`, AdamW, clipping at 1.0."""
    model = OwnLossGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def window() -> tuple[torch.Tensor, torch.Tensor]:
        data = torch.randint(0, 40, (4, 9))
        return data[:, :-1].clone(), data[:, 1:].clone()  # get_batch stacks: contiguous

    return {"model": model, "optimizer": opt, "batches": [window(), window()], "step": step,
            "task": "lm"}  # fmt: skip


@_seeded
def real_accelerate_loop() -> dict[str, Any]:
    """A research repo trained through accelerate: model and optimizer from
    `accelerator.prepare`, `accelerator.backward(loss)`; examine is given what prepare gave."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss

    batches = [(torch.randn(6, 8), torch.randint(0, 3, (6,))) for _ in range(2)]
    return {"model": model, "optimizer": opt, "batches": batches, "step": step}


@_seeded
def real_lightning_optimizer() -> dict[str, Any]:
    """A loop handed Lightning's LightningOptimizer (manual optimization's `self.optimizers()`)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = LightningOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.optimizer.step()
        return loss

    batches = [(torch.randn(6, 8), torch.randint(0, 3, (6,))) for _ in range(2)]
    return {"model": model, "optimizer": opt, "batches": batches, "step": step}


def _classifier() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _classify(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
    """The plain classification step several setups share: zero_grad, loss, backward, step."""
    x, y = batch
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _labelled(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(6, 8), torch.randint(0, 3, (6,))) for _ in range(n)]


@_seeded
def real_gradscaler_loop() -> dict[str, Any]:
    """The AMP recipe: scaler.scale(loss).backward(), unscale_ before clipping, scaler.step,
    scaler.update (the scaler's own sync is inside torch)."""
    model = _classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return loss

    return {"model": model, "optimizer": opt, "batches": _labelled(), "step": step}


class SineLSTM(nn.Module):
    """pytorch/examples time_sequence_prediction: two LSTMCells unrolled over the sequence."""

    def __init__(self, hidden: int = 51) -> None:
        super().__init__()
        self.hidden = hidden
        self.lstm1, self.lstm2 = nn.LSTMCell(1, hidden), nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = c1 = h2 = c2 = torch.zeros(x.shape[0], self.hidden)
        outputs = []
        for x_t in x.split(1, dim=1):
            h1, c1 = self.lstm1(x_t, (h1, c1))
            h2, c2 = self.lstm2(h1, (h2, c2))
            outputs.append(self.linear(h2))
        return torch.cat(outputs, dim=1)


@_seeded
def real_lbfgs_loop() -> dict[str, Any]:
    """time_sequence_prediction's train loop: LBFGS (up to 20 closure evaluations a step) over
    an LSTMCell model unrolled over 50 steps of sine waves."""
    model = SineLSTM()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.8)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x, y = batch

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        return opt.step(closure)

    waves = torch.sin(torch.arange(51.0)[None] / 5 + torch.rand(8, 1) * 6)
    return {"model": model, "optimizer": opt, "batches": [(waves[:, :-1], waves[:, 1:])] * 2,
            "step": step}  # fmt: skip


class EMA:
    """timm's ModelEmaV2 shape: shadow copies updated in place after each step, and a counter."""

    def __init__(self, model: nn.Module, decay: float = 0.9) -> None:
        self.decay, self.updates = decay, 0
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        for n, p in model.named_parameters():
            self.shadow[n].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)


@_seeded
def real_ema_loop() -> dict[str, Any]:
    """A classifier whose step updates an EMA of its weights, an object the step closes over."""
    model = _classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = EMA(model)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        loss = _classify(model, opt, batch)
        ema.update(model)
        return loss

    return {"model": model, "optimizer": opt, "batches": _labelled(), "step": step, "ema": ema}


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update (B starts at zero), as peft does."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.T @ self.b.T


@_seeded
def real_lora_finetune() -> dict[str, Any]:
    """A LoRA fine-tune at its usual learning rate (2e-4): only the adapters train."""
    model = nn.Sequential(LoRALinear(nn.Linear(8, 16)), nn.ReLU(), LoRALinear(nn.Linear(16, 3)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)

    return {"model": model, "optimizer": opt, "batches": _labelled(), "step": _classify}


@_seeded
def real_warmup_cosine() -> dict[str, Any]:
    """A linear warmup then cosine decay (LambdaLR over 40 steps), stepped once per step."""
    import math

    model = _classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    total, warmup = 40, 4

    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (i - warmup) / (total - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        loss = _classify(model, opt, batch)
        sched.step()
        return loss

    return {"model": model, "optimizer": opt, "batches": _labelled(), "step": step,
            "scheduler": sched}  # fmt: skip


@_seeded
def real_step_counter_lr() -> dict[str, Any]:
    """nanoGPT's get_lr(it): the step sets each group's lr from a global iteration counter."""
    model = _classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counter = {"iter": 0}

    def get_lr(it: int) -> float:
        return 1e-3 * min(1.0, (it + 1) / 10)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        for g in opt.param_groups:
            g["lr"] = get_lr(counter["iter"])
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        counter["iter"] += 1
        return loss

    def evaluate(model: nn.Module, batches: Any) -> float:
        model.eval()
        with torch.no_grad():
            out = sum(float(F.cross_entropy(model(x), y)) for x, y in batches)
        model.train()
        return out

    return {"model": model, "optimizer": opt, "batches": _labelled(), "step": step,
            "eval_fn": evaluate, "counter": counter}  # fmt: skip


@_seeded
def real_diffusion_noise() -> dict[str, Any]:
    """A DDPM training step: a new timestep and new noise at every call, the model predicts
    the noise (mse); the loss on one batch is a different draw each time."""
    model = nn.Sequential(nn.Linear(9, 32), nn.SiLU(), nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    betas = torch.linspace(1e-4, 0.02, 100)
    alphas = torch.cumprod(1 - betas, 0)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        x0 = batch
        t = torch.randint(0, 100, (x0.shape[0],))
        noise = torch.randn_like(x0)
        a = alphas[t][:, None]
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        loss = F.mse_loss(model(torch.cat([xt, t[:, None] / 100], 1)), noise)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return {"model": model, "optimizer": opt, "batches": [torch.randn(8, 8) for _ in range(2)],
            "step": step}  # fmt: skip


@_seeded
def real_long_warmup() -> dict[str, Any]:
    """A fine-tune whose linear warmup spans 2000 steps: the lr stays near 0 for every step
    the doctor runs."""
    model = _classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 2000))

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        loss = _classify(model, opt, batch)
        sched.step()
        return loss

    return {"model": model, "optimizer": opt, "batches": _labelled(), "step": step,
            "scheduler": sched}  # fmt: skip


class Flow(nn.Module):
    """A RealNVP-style flow whose prior is a torch.distributions object it holds (a Gaussian
    pushed through an affine transform), trained by maximum likelihood; its argument checks off
    (validate_args=False: on by default they sync on every log_prob)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d // 2, 16), nn.Tanh(), nn.Linear(16, d))
        base = torch.distributions.Normal(torch.zeros(d), torch.ones(d), validate_args=False)
        shift = torch.distributions.transforms.AffineTransform(0.0, 1.0, cache_size=1)
        self.prior = torch.distributions.TransformedDistribution(base, [shift], validate_args=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=1)
        s, t = self.net(a).chunk(2, dim=1)
        z = torch.cat([a, b * torch.exp(s) + t], dim=1)
        return -(self.prior.log_prob(z).sum(1) + s.sum(1))


@_seeded
def real_normalizing_flow() -> dict[str, Any]:
    """A normalizing flow's negative log-likelihood, its prior a distributions object."""
    model = Flow()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        loss = model(batch).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return {"model": model, "optimizer": opt, "batches": [torch.randn(8, 4) for _ in range(2)],
            "step": step}  # fmt: skip


@_seeded
def real_compiled_model() -> dict[str, Any]:
    """A model wrapped by torch.compile before training (the wrapper is what the loop calls)."""
    model = torch.compile(_classifier(), backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    return {"model": model, "optimizer": opt, "batches": _labelled(), "step": _classify}


@_seeded
def real_vae_summed_loss() -> dict[str, Any]:
    """pytorch/examples VAE: a summed reconstruction loss plus KL, a new reparameterisation
    draw every call, on images that are noise."""
    enc, dec = nn.Linear(16, 8), nn.Linear(4, 16)
    model = nn.ModuleDict({"enc": enc, "dec": dec})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        mu, logvar = model["enc"](batch).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        recon = torch.sigmoid(model["dec"](z))
        bce = F.binary_cross_entropy(recon, batch, reduction="sum")
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
        loss = bce + kld
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return {"model": model, "optimizer": opt, "batches": [torch.rand(8, 16) for _ in range(2)],
            "step": step}  # fmt: skip


@_seeded
def real_policy_gradient() -> dict[str, Any]:
    """pytorch/examples reinforce.py's update: actions sampled from the policy each call, the
    surrogate -(log_prob * normalised return), which is not a loss meant to fall."""
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        states, rewards = batch
        # validation on, the default until torch.compile turns it off for the whole process
        dist = torch.distributions.Categorical(logits=model(states), validate_args=True)
        actions = dist.sample()
        returns = rewards * (actions.float() * 2 - 1)  # the environment's answer to the action
        returns = (returns - returns.mean()) / (returns.std() + 1e-6)
        loss = -(dist.log_prob(actions) * returns).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    batches = [(torch.randn(16, 4), torch.rand(16)) for _ in range(2)]
    return {"model": model, "optimizer": opt, "batches": batches, "step": step}


class OneModuleGAN(nn.Module):
    """A GAN in one module with one optimizer: the discriminator's loss and the generator's
    summed, the generator's gradient reversed into the discriminator (a common shortcut)."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.d = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, real: torch.Tensor) -> torch.Tensor:
        fake = self.g(torch.randn(real.shape[0], 4))
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        d_loss = F.binary_cross_entropy_with_logits(self.d(real), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(self.d(fake.detach()), zeros)
        g_loss = F.binary_cross_entropy_with_logits(self.d(fake), ones)
        return d_loss + g_loss


@_seeded
def real_one_module_gan() -> dict[str, Any]:
    """The one-module GAN above, trained with one Adam on d_loss + g_loss, declared
    adversarial (task="gan")."""
    model = OneModuleGAN()
    opt = torch.optim.Adam(model.parameters(), lr=2e-4, betas=(0.5, 0.999))

    def step(model: nn.Module, opt: Any, batch: Any) -> torch.Tensor:
        loss = model(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return {"model": model, "optimizer": opt, "batches": [torch.rand(6, 8) for _ in range(2)],
            "step": step, "task": "gan"}  # fmt: skip


REAL = {
    "rnn_carried_state": real_rnn_carried_state,
    "gcn_sparse_graph": real_gcn_sparse_graph,
    "seq2seq_masks": real_seq2seq_masks,
    "contrastive_pair": real_contrastive_pair,
    "gan_two_networks": real_gan_two_networks,
    "model_returns_its_loss": real_model_returns_its_loss,
    "accelerate_loop": real_accelerate_loop,
    "lightning_optimizer": real_lightning_optimizer,
    "gradscaler_loop": real_gradscaler_loop,
    "lbfgs_loop": real_lbfgs_loop,
    "ema_loop": real_ema_loop,
    "lora_finetune": real_lora_finetune,
    "warmup_cosine": real_warmup_cosine,
    "step_counter_lr": real_step_counter_lr,
    "diffusion_noise": real_diffusion_noise,
    "long_warmup": real_long_warmup,
    "normalizing_flow": real_normalizing_flow,
    "compiled_model": real_compiled_model,
    "vae_summed_loss": real_vae_summed_loss,
    "policy_gradient": real_policy_gradient,
    "one_module_gan": real_one_module_gan,
    **LOOPS,
}
