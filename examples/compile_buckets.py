"""Variable-length batches under torch.compile without a recompile storm.

Documents of every length would give torch.compile a new shape (a new graph) almost every
batch. We pad each batch to one of a few bucket lengths (the loss ignores the padding), compile
each block in place, warm up one graph per bucket, then forbid compiling: a recompile raises.

    python examples/compile_buckets.py --backend inductor   # real kernels (needs a C++ compiler)
    python examples/compile_buckets.py --smoke              # backend "eager": seconds
Measured on 2 shared CPU cores (Xeon), eager: the full run (123 steps) took 49 s of CPU time,
167 s wall; 8 warm-up graphs, train loss 3.027 -> 1.078, then 0 compilations, 0 recompiles.

Patterns: ``compile_model`` / ``warmup`` / ``no_recompiles`` / ``track_compiles`` and the
bucketing helpers ``BucketBatchSampler`` / ``pad_to_bucket`` (isotrain.compile), plus
``StepGuard`` and ``eval_mode``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from isotrain.compile import (
    BucketBatchSampler,
    compile_model,
    default_buckets,
    no_recompiles,
    pad_to_bucket,
    track_compiles,
    warmup,
)
from isotrain.contexts import eval_mode
from isotrain.guard import StepGuard

VOCAB = 16


class Block(nn.Module):
    """Pre-norm causal self-attention + MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, -1).unbind(2)  # (B, T, H, Dh)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, H, T, Dh)
        x = x + self.proj(att.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, d: int, heads: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))  # compiled units
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, T, VOCAB)


def make_docs(n: int, max_len: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Repeats of a short random pattern, of random length."""
    docs = []
    for _ in range(n):
        length = int(torch.randint(8, max_len + 2, (), generator=gen))
        period = int(torch.randint(2, 5, (), generator=gen))
        pattern = torch.randint(1, VOCAB, (period,), generator=gen)
        docs.append(pattern.repeat(length // len(pattern) + 1)[:length])
    return docs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a few seconds on CPU")
    p.add_argument("--backend", default="eager", help='"eager", "aot_eager" or "inductor"')
    p.add_argument("--epochs", type=int, default=1)
    args = p.parse_args(argv)
    max_len, n_docs, epochs, batch = (64, 96, 1, 8) if args.smoke else (128, 2000, args.epochs, 16)

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    docs = make_docs(n_docs, max_len, gen)
    buckets = default_buckets(max_len, min_len=16)  # e.g. (16, 32, 64): one graph per bucket
    sampler = BucketBatchSampler([len(d) for d in docs], batch_size=batch, buckets=buckets)
    model = compile_model(TinyLM(32, 2, 2, max_len), backend=args.backend, dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = StepGuard(opt, model, max_norm=1.0)

    shapes = [torch.zeros(batch, n, dtype=torch.long) for n in buckets]
    stats = warmup(model, shapes, also_eval=True)  # compiles now; timed apart from training
    print(f"warm-up: {stats.compilations} compilations in {stats.compile_seconds:.1f}s "
          f"for buckets {buckets} (backend {args.backend!r})")  # fmt: skip

    losses = []
    with track_compiles() as steady, no_recompiles():  # a new shape here would raise
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for indices in sampler:  # every batch is (batch, one of the buckets)
                x, y, _ = pad_to_bucket([docs[i] for i in indices], buckets=buckets)
                logits = model(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
                loss.backward()
                losses.append(guard.step(loss.detach()).loss)  # device tensors: no sync
                if len(losses) % 25 == 0:  # progress without reading a tensor
                    print(f"  {len(losses)} steps", flush=True)
            with eval_mode(model) as m:  # eval graphs were warmed up too
                x, y, _ = pad_to_bucket(docs[:batch], buckets=buckets)
                val = F.cross_entropy(m(x).flatten(0, 1), y.flatten(), ignore_index=-100)
            print(f"epoch {epoch}: val loss {val.item():.3f}")
    first, last = torch.stack(losses[:3]).mean().item(), torch.stack(losses[-3:]).mean().item()
    print(f"train loss {first:.3f} -> {last:.3f} over {len(losses)} steps; after warm-up: "
          f"{steady.compilations} compilations, {steady.recompiles} recompiles")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
