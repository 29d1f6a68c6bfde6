"""The precision family's zoo: each public report rebuilt as a small setup, with its correct
twin (`make(fixed)`: False is the report's bug, True the same step done right). The reports
are listed in precision_reports.md."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from tests.doctor.zoo import MLP, ce, features, seeded
from torch import nn
from torch.func import functional_call


def _regressor() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def near_fit(model: nn.Module, n: int = 2, rows: int = 1024) -> list[Any]:
    """Batches whose targets the model already fits to within 1e-3: late training, where
    gradients are small."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randn(rows, 8, generator=g)
        with torch.no_grad():
            y = model(x) + 1e-3 * torch.randn(rows, 4, generator=g)
        out.append((x, y))
    return out


def setup_adam_eps_in_half(fixed: bool) -> dict[str, Any]:
    """https://github.com/afiaka87/glide-finetune/issues/5: a model cast to float16 trained with
    Adam's default eps=1e-8, which is 0 in float16: NaN after the first step (the fix there,
    https://github.com/afiaka87/glide-finetune/pull/6, passes eps=1e-4)."""
    model = seeded(MLP).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4 if fixed else 1e-8)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x.half()).float(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=features(), step=step)


def setup_fp16_autocast_without_scaler(fixed: bool) -> dict[str, Any]:
    """https://github.com/engichang1467/Open-Rig3R/issues/35: autocast in float16 with no
    GradScaler anywhere; late in training the small gradients lose their low bits or flush to
    0 in the float16 backward."""
    model = seeded(_regressor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=fixed)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
        loss = F.mse_loss(pred.float(), y)
        scaler.scale(loss).backward()  # BUG (unfixed): a disabled scaler scales nothing
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=near_fit(model), step=step)


class Bf16Compute(nn.Module):
    """FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16) in short: float32 parameters, each
    cast to bfloat16 for the forward, no autocast region; the output stays bfloat16."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cast = {n: p.to(torch.bfloat16) for n, p in self.inner.named_parameters()}
        return functional_call(self.inner, cast, (x.to(torch.bfloat16),))


def setup_bf16_logits_cross_entropy(fixed: bool) -> dict[str, Any]:
    """https://github.com/Modalities/modalities/pull/464: the causal-LM cross-entropy gets the
    model's bfloat16 logits with no autocast region open, so the loss is bfloat16."""
    model = seeded(lambda: Bf16Compute(MLP()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        if fixed:
            logits = logits.float()
        loss = F.cross_entropy(logits, y)  # BUG (unfixed): bfloat16 logits
        loss.backward()
        opt.step()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=features(), step=step)


class HappyNet(nn.Module):
    """pytorch#8860's network in short: convolutions, two fully connected layers, a softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.fc1, self.fc2 = nn.Linear(16 * 2 * 2, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(self.convs(x).flatten(1)))
        return F.softmax(self.fc2(h), dim=1)


def _images(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(n)]  # fmt: skip


def setup_pytorch_8860_half_adam(fixed: bool) -> dict[str, Any]:
    """https://github.com/pytorch/pytorch/issues/8860 (held out): NaN loss when training in
    half precision: a convnet cast with .half(), Adam, a softmax output. The twin keeps the
    parameters in float32 under float16 autocast with a GradScaler, Adam's eps as it was."""
    model = seeded(HappyNet)
    if not fixed:
        model.half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=fixed)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16, enabled=fixed):
            probs = model(x if fixed else x.half())
        loss = F.nll_loss(torch.log(probs.float().clamp_min(1e-6)), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=_images(), step=step)


def setup_so_74092624_half_model_and_data(fixed: bool) -> dict[str, Any]:
    """https://stackoverflow.com/questions/74092624 (held out): the model and the data cast
    with .half() for training, results "not good at all"; automatic mixed precision (float32
    parameters, autocast, a GradScaler) trained well."""
    model = seeded(MLP)
    if not fixed:
        model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=fixed)
    criterion = nn.CrossEntropyLoss()

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fixed):
            loss = criterion(model(x if fixed else x.half()), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=features(), step=step)


# -- autocast_not_applied: a float32 island inside the region (NOTE [float32 islands]) ---------
D, T = 32, 16  # model width and tokens of the block below


class FP32MLP(torch.autograd.Function):
    """The AMP examples' "MyMM" recipe (custom_fwd(cast_inputs=torch.float32)) applied to a
    whole MLP: its forward runs with autocast off, on float32 inputs."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w1, w2)
        return F.gelu(x @ w1.t()) @ w2.t()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w1, w2 = ctx.saved_tensors
        with torch.enable_grad():
            x_, w1_, w2_ = (t.detach().requires_grad_() for t in (x, w1, w2))
            out = F.gelu(x_ @ w1_.t()) @ w2_.t()
        return torch.autograd.grad(out, (x_, w1_, w2_), g.to(out.dtype))


class AutocastMLP(FP32MLP):
    """The same Function with custom_fwd and no cast_inputs: autocast casts its matmuls."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w1, w2)
        return F.gelu(x @ w1.t()) @ w2.t()


class FP32LogSumExp(torch.autograd.Function):
    """custom_fwd(cast_inputs=torch.float32) around a small reduction (a z-loss's logsumexp):
    float32 on purpose, no matmul."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = torch.logsumexp(x, dim=-1)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        x, out = ctx.saved_tensors
        return g.unsqueeze(-1) * torch.exp(x - out.unsqueeze(-1))


@torch.library.custom_op("isotrain_tests::input_proj", mutates_args=())
def input_proj(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A custom op whose body multiplies: inside an autocast region torch casts that matmul."""
    return x @ w.t()


def _input_proj_setup(ctx: Any, inputs: Any, output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _input_proj_backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = ctx.saved_tensors  # x (B, T, I), w (O, I), g (B, T, O); any of them 16-bit
    g = g.float()
    gx = g @ w.float()
    gw = g.flatten(0, -2).t() @ x.float().flatten(0, -2)
    return gx.to(x.dtype), gw.to(w.dtype)


input_proj.register_autograd(_input_proj_backward, setup_context=_input_proj_setup)


@input_proj.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


class Block(nn.Module):
    """A pre-norm transformer block over (B, T, D) tokens and a classifier head; `form` says
    which part runs where (each a form a user writes)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.inp = nn.Linear(8, D, bias=form != "custom_op")  # custom_op: its weight alone
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)
        if form == "router_fp32":
            self.router = nn.Linear(D, 2)
        if form == "custom_op_mixed":  # the op gets inp's bfloat16 output and this float32 weight
            self.mix = nn.Linear(D, D, bias=False)
        self.head = nn.Linear(D, 4)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, D) each
        if self.form == "attention_fp32":  # pytorch#40497's fix: the scores in float32
            with torch.autocast("cpu", enabled=False):
                att = (q.float() @ k.float().transpose(-2, -1)) / D**0.5  # (B, T, T)
                y = att.softmax(-1) @ v.float()
        else:
            y = (q @ k.transpose(-2, -1) / D**0.5).softmax(-1) @ v
        return self.proj(y)

    @torch.autocast("cpu", enabled=False)
    def mlp_fp32(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x.float())))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm2(x)
        if self.form == "mlp_fp32":
            with torch.autocast("cpu", enabled=False):  # BUG: the block's matmuls in float32
                return self.down(F.gelu(self.up(self.norm2(x.float()))))
        if self.form == "norm_fp32":  # the norm alone in float32 (pytorch#188955's workaround)
            with torch.autocast("cpu", enabled=False):
                h = self.norm2(x.float())
        if self.form == "mlp_decorated":
            return self.mlp_fp32(h)  # BUG: the decorator turns autocast off for the whole MLP
        if self.form in ("custom_fwd", "custom_fwd_autocast"):
            fn = FP32MLP if self.form == "custom_fwd" else AutocastMLP
            return fn.apply(h, self.up.weight, self.down.weight)
        if self.form == "router_fp32":  # a router's logits in float32 (as MoE code keeps them)
            with torch.autocast("cpu", enabled=False):
                gate = self.router(h.float()).softmax(-1)[..., :1]
            return gate * self.down(F.gelu(self.up(h)))
        return self.down(F.gelu(self.up(h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = input_proj(x, self.inp.weight) if self.form == "custom_op" else self.inp(x)  # (B, T, D)
        if self.form == "custom_op_mixed":
            h = input_proj(h, self.mix.weight)
        h = h + self.attend(self.norm1(h))
        h = h + self.mlp(h)
        return self.head(h.mean(1))


def _tokens(n: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, T, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
            for _ in range(n)]  # fmt: skip


def block_setup(form: str) -> dict[str, Any]:
    """The block trained under CPU bfloat16 autocast, its loss in float32."""
    model = seeded(lambda: Block(form))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        extra = FP32LogSumExp.apply(logits).pow(2).mean() if form == "zloss_fp32" else 0.0
        loss = F.cross_entropy(logits.float(), y) + 1e-4 * extra
        loss.backward()
        opt.step()
        return loss.detach()

    return dict(model=model, optimizer=opt, batches=_tokens(), step=step)


def setup_block_in_fp32(fixed: bool) -> dict[str, Any]:
    """Planted (pytorch#40497 shows the pattern for attention): autocast(enabled=False) meant
    for the norm wraps the whole MLP. Twin: only the norm runs in float32."""
    return block_setup("norm_fp32" if fixed else "mlp_fp32")


def setup_custom_fwd_mlp(fixed: bool) -> dict[str, Any]:
    """Planted from the AMP examples' recipe: custom_fwd(cast_inputs=torch.float32) on an MLP's
    Function. Twin: custom_fwd without cast_inputs."""
    return block_setup("custom_fwd_autocast" if fixed else "custom_fwd")


def setup_decorated_mlp(fixed: bool) -> dict[str, Any]:
    """Planted: @torch.autocast("cpu", enabled=False) on the MLP method. Twin: no decorator."""
    return block_setup("plain" if fixed else "mlp_decorated")


# kind, setup, the severity the bug earns (each `make(False)` a bug, `make(True)` its twin)
ISLANDS: list[tuple[str, Any, str]] = [
    ("autocast_not_applied", setup_block_in_fp32, "warning"),
    ("autocast_not_applied", setup_custom_fwd_mlp, "warning"),
    ("autocast_not_applied", setup_decorated_mlp, "warning"),
]
# correct code that runs float32 on purpose inside the region
DELIBERATE = ["attention_fp32", "norm_fp32", "router_fp32", "zloss_fp32", "custom_op"]


BUGS: list[tuple[str, Any, str]] = [
    ("optimizer_eps_underflow", setup_adam_eps_in_half, "error"),
    ("grad_underflow", setup_fp16_autocast_without_scaler, "warning"),
    ("loss_in_low_precision", setup_bf16_logits_cross_entropy, "warning"),
]
# rebuilt once after the checks were done, tested once (precision_reports.md)
HELD_OUT: list[tuple[str, Any, str]] = [
    ("optimizer_eps_underflow", setup_pytorch_8860_half_adam, "error"),
    ("loss_in_low_precision", setup_so_74092624_half_model_and_data, "warning"),
]

# (kind, bug, clean twin, severity), as tests/doctor/test_zoo.py's CASES
CASES: list[tuple[str, Any, Any, str]] = [
    (kind, partial(make, False), partial(make, True), severity)
    for kind, make, severity in BUGS + HELD_OUT
]

__all__ = ["BUGS", "CASES", "DELIBERATE", "HELD_OUT", "ISLANDS", "block_setup", "ce", "near_fit"]
