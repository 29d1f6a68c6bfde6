"""A seconds-long stand-in for nanoGPT's train.py with its interface, for bench_vs_nanogpt --quick.

Same inputs (globals overridden by configurator.py; data/<dataset>/train.bin, val.bin, uint16),
same seed line for the benchmark to patch, same log lines ("step N: train loss A, val loss B",
"iter N: loss X, time Yms") and the same ckpt.pt (nanoGPT's tensor names, nn.Linear layouts).
It trains isotrain's GPT with a plain AdamW loop: a stand-in, not a reference.
"""

import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from isotrain.train.model.gpt import GPT, GPTConfig
from isotrain.train.model.hf import to_gpt2_state

out_dir = "out"
eval_interval = 2000
log_interval = 1
eval_iters = 200
always_save_checkpoint = True
dataset = "openwebtext"
gradient_accumulation_steps = 1
batch_size = 12
block_size = 1024
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
learning_rate = 6e-4
max_iters = 600000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 2000
lr_decay_iters = 600000
min_lr = 6e-5
device = "cpu"
dtype = "float32"
compile = False
exec(Path("configurator.py").read_text())

seed_offset = 0
torch.manual_seed(1337 + seed_offset)
os.makedirs(out_dir, exist_ok=True)
data_dir = os.path.join("data", dataset)
LINEAR = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def get_batch(split):
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack(
        [torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix]
    )
    return x, y


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    ratio = min((it - warmup_iters) / max(lr_decay_iters - warmup_iters, 1), 1.0)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss():
    model.eval()
    out = {}
    for split in ("train", "val"):
        out[split] = sum(model(*get_batch(split)).item() for _ in range(eval_iters)) / eval_iters
    model.train()
    return out


def nanogpt_state():
    """The model's tensors under nanoGPT's names, Linear weights as (out, in)."""
    state = to_gpt2_state(model)
    state = {k: v.t().contiguous() if k.endswith(LINEAR) else v for k, v in state.items()}
    return {**state, "lm_head.weight": state["transformer.wte.weight"]}


cfg = GPTConfig(
    n_layer=n_layer,
    n_head=n_head,
    d_model=n_embd,
    block_size=block_size,
    bias=bias,
    dropout=dropout,
)
model = GPT(cfg)
decay = [p for p in model.parameters() if p.dim() >= 2]
rest = [p for p in model.parameters() if p.dim() < 2]
groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2))
iter_num, t0 = 0, time.time()
while True:
    for group in optimizer.param_groups:
        group["lr"] = get_lr(iter_num) if decay_lr else learning_rate
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if iter_num > 0 and always_save_checkpoint:
            ckpt = {"model": nanogpt_state(), "iter_num": iter_num, "best_val_loss": losses["val"]}
            torch.save(ckpt, os.path.join(out_dir, "ckpt.pt"))
    loss = model(*get_batch("train"))
    loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0:
        print(f"iter {iter_num}: loss {loss.item():.4f}, time {dt * 1000:.2f}ms, mfu -100.00%")
    iter_num += 1
    if iter_num > max_iters:
        break
