"""The seed's loop shape with isotrain's pieces: a causal 1-D CNN learns the next byte of
Python's own standard library sources.

    python examples/seed_loop.py            # minutes: see below (--no-amp for float32)
    python examples/seed_loop.py --smoke    # a few seconds

Measured once on 2 CPU cores shared with other jobs (Intel Xeon, bf16 autocast): the full run
(300 steps, a line every 50) took 322 s of CPU time, 729 s wall; val loss 5.651 -> 1.519.

Patterns: ``autocast_if_available`` (bf16 where the device supports it, else a no-op),
``safe_backward`` (skip a step whose loss or gradient is non-finite), ``eval_mode`` (validation
that restores every submodule's train flag) and ``rng_isolated`` (sampling that leaves the
training RNG untouched).
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from isotrain.contexts import autocast_if_available, eval_mode, resolve_autocast, rng_isolated
from isotrain.guard import safe_backward

FILES = ("contextlib.py", "functools.py", "textwrap.py", "argparse.py", "dataclasses.py")


def load_bytes() -> torch.Tensor:
    """A few stdlib files as one 1-D tensor of byte values (0..255)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((root / n).read_bytes() for n in FILES if (root / n).is_file())
    if len(data) < 20_000:  # an unusual install without sources: fall back to synthetic code
        data = b"".join(b"def f%d(x):\n    return x * %d\n" % (i, i) for i in range(2000))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class CausalConvNet(nn.Module):
    """Byte embedding -> dilated causal Conv1d residual blocks -> next-byte logits."""

    def __init__(self, width: int, layers: int, kernel: int = 3, dropout: float = 0.1) -> None:
        super().__init__()
        self.kernel = kernel
        self.embed = nn.Embedding(256, width)
        self.convs = nn.ModuleList(
            nn.Conv1d(width, width, kernel, dilation=2**i) for i in range(layers)
        )
        self.drop = nn.Dropout(dropout)  # uses the global RNG: see rng_isolated below
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).transpose(1, 2)  # (B, C, T)
        for conv in self.convs:
            pad = (self.kernel - 1) * conv.dilation[0]
            h = h + self.drop(F.gelu(conv(F.pad(h, (pad, 0)))))  # left pad: t sees only <= t
        return self.head(self.norm(h.transpose(1, 2)))  # (B, T, 256)


def get_batch(data: torch.Tensor, gen: torch.Generator, batch: int, seq: int):
    starts = torch.randint(len(data) - seq - 1, (batch, 1), generator=gen)
    chunk = data[starts + torch.arange(seq + 1)]  # (B, T + 1)
    return chunk[:, :-1], chunk[:, 1:]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def sample(model: nn.Module, prompt: bytes, n: int) -> bytes:
    ids = torch.tensor([list(prompt)])
    for _ in range(n):
        probs = model(ids)[0, -1].float().softmax(-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1)[None]], dim=1)
    return bytes(ids[0].tolist())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--no-amp", dest="amp", action="store_false", help="stay in float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.smoke:
        steps, width, layers, batch, seq, n_val, eval_every = 25, 32, 3, 8, 64, 2, 12
    else:
        steps, width, layers, batch, seq, n_val, eval_every = args.steps, 96, 6, 32, 128, 8, 50

    torch.manual_seed(args.seed)  # model init and dropout
    data = load_bytes()
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    gens = [torch.Generator().manual_seed(i) for i in range(n_val)]
    val_batches = [get_batch(val, g, batch, seq) for g in gens]  # the same batches every time
    model = CausalConvNet(width, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    amp = resolve_autocast(enabled=args.amp)  # decide once: does float16 need a GradScaler?
    scaler = torch.amp.GradScaler(amp.device_type) if amp.needs_grad_scaler else None
    print(f"{len(data):,} bytes of stdlib source; autocast: {amp.reason}", flush=True)

    gen = torch.Generator().manual_seed(args.seed)  # the data order, apart from dropout's RNG
    val_losses, skipped = [], 0
    for step in range(steps + 1):
        if step % eval_every == 0 or step == steps:
            with eval_mode(model) as m, autocast_if_available(enabled=args.amp):
                val_loss = sum(loss_fn(m, x, y).item() for x, y in val_batches) / len(val_batches)
            val_losses.append(val_loss)
            print(f"step {step:4d}  val loss {val_loss:.3f}", flush=True)
        if step == steps:
            break
        x, y = get_batch(train, gen, batch, seq)
        with autocast_if_available(enabled=args.amp):
            loss = loss_fn(model, x, y)
        skipped += not safe_backward(loss, opt, scaler, max_norm=1.0)  # backward, clip, step

    with eval_mode(model) as m, rng_isolated(seed=0):  # same sample every run; training RNG intact
        text = sample(m, b"def ", 8 if args.smoke else 120)
    print("sample:", text.decode("utf-8", errors="replace"))
    print(f"val loss {val_losses[0]:.3f} -> {val_losses[-1]:.3f}, skipped steps {skipped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
