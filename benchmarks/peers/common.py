"""The one job that the four implementations in this folder run, and the one way they all time it.

Job (gpt-stdlib, the default; ``--job digits`` is the digits recipe's CNN and data, same optimizer): scaletrain's gpt-stdlib model (models.GPT: 4 layers x 128, 4 heads, 128 tokens of context, byte vocab),
on the same data (data.stdlib_text: this Python's standard library sources), AdamW (lr 2e-3, betas 0.9/0.99,
weight decay 0.1 on matrices and embeddings only), gradient clipping at 1.0, a constant learning rate, 16
sequences per rank per step, one intra-op thread per rank (OMP_NUM_THREADS, set by run.py).

Timing, identical in all four (and the same as scaletrain's own loop, whose metrics.jsonl the scaletrain
variant is read from): the loss is summed on the device; every ``log_every`` steps it is reduced across ranks
and read back (the only host-device sync), and rank 0 records the wall time since the previous read. A log
interval's step time is that time / log_every; run.py drops the first interval (warm-up) and takes the median.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaletrain.data import digits, stdlib_text
from scaletrain.models import CNN, GPT
from scaletrain.observe.metrics import peak_memory_bytes

# Which job (run.py --job sets it for every process it starts): gpt-stdlib, or digits (the CNN on sklearn's
# 8x8 digits, 32 images per rank per step, where one all-reduce costs about as much as the compute).
# gpt2-124m: GPT-2 124M's shape (12 x 768, 12 heads, 1,024 tokens, vocab 50,304 = 50,257 padded to a multiple
# of 128) on the same bytes, 16 sequences per rank, bf16 autocast and torch.compile, fused AdamW: a GPU job. The
# hand-written loop is a one-GPU script's: the model and its loss compiled as one function, as nanoGPT does.
JOB = os.environ.get("SCALETRAIN_PEERS_JOB", "gpt-stdlib")
GPT_JOBS = ("gpt-stdlib", "gpt2-124m")
SEQ_LEN, SEED = (1024 if JOB == "gpt2-124m" else 128), 0
BATCH = 16 if JOB in GPT_JOBS else 32
N_LAYER, N_HEAD, N_EMBD, VOCAB = (12, 12, 768, 50304) if JOB == "gpt2-124m" else (4, 4, 128, 256)
FAST = JOB == "gpt2-124m"  # bf16 autocast + torch.compile + fused AdamW in every implementation
LR, BETAS, WEIGHT_DECAY, GRAD_CLIP = 2e-3, (0.9, 0.99), 0.1, 1.0

# The same job for scaletrain's CLI: the recipe with its schedule turned into a constant lr.
SCALETRAIN_OVERRIDES = {"data.batch_size": BATCH, "optim.name": "adamw", "optim.lr": LR, "optim.beta1": BETAS[0],
                        "optim.beta2": BETAS[1], "optim.weight_decay": WEIGHT_DECAY, "optim.grad_clip": GRAD_CLIP,
                        "schedule.warmup_steps": 0, "schedule.decay": "constant", "optim.scale_lr": "false",
                        "run.seed": SEED, "model.dropout": 0.0}
if JOB in GPT_JOBS:
    SCALETRAIN_OVERRIDES.update({"data.seq_len": SEQ_LEN, "model.n_layer": N_LAYER, "model.n_head": N_HEAD,
                                 "model.n_embd": N_EMBD, "model.vocab_size": VOCAB})
if FAST:  # the trainer with its defaults on a GPU (model.loss and model.residual auto: fused, bf16); biases kept
    SCALETRAIN_OVERRIDES.update({"train.precision": "bf16-mixed", "train.compile": "true", "model.bias": "true"})
# SCALETRAIN_PEERS_KEYS="train.attention=flash ...": more of the trainer's keys, to measure one against its default
SCALETRAIN_OVERRIDES.update(kv.split("=", 1) for kv in os.environ.get("SCALETRAIN_PEERS_KEYS", "").split())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one implementation of the peer-benchmark job (run it via run.py)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", required=True, help="rank 0 writes its result here (JSON)")
    return p.parse_args()


def local_device(kind: str) -> torch.device:
    if kind == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def train_data() -> torch.utils.data.Dataset:
    return stdlib_text(SEQ_LEN).train if JOB in GPT_JOBS else digits(0.2).train


def build_model() -> torch.nn.Module:
    torch.manual_seed(SEED)  # the same initial weights on every rank and in every implementation
    if JOB in GPT_JOBS:
        return GPT(VOCAB, SEQ_LEN, N_LAYER, N_HEAD, N_EMBD, dropout=0.0)
    return CNN((1, 8, 8), 10, channels=32, hidden=128, dropout=0.0)  # the digits recipe's model


def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=FAST)


def step_loss(model: torch.nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of a batch: forward and loss, under bf16 autocast and compiled as one function for FAST jobs."""
    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=FAST):
            return loss_fn(model(x), y)

    return torch.compile(loss_of) if FAST else loss_of


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))  # (B*T, vocab) vs (B*T,)


class IntervalTimer:
    """Log intervals as scaletrain's loop keeps them: records shaped like metrics.jsonl's train records."""

    def __init__(self, log_every: int, global_batch: int, world: int, device: torch.device,
                 reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.log_every, self.global_batch, self.world = log_every, global_batch, world
        self.reduce_sum = reduce_sum  # the implementation's own cross-rank sum
        self.loss_sum = torch.zeros((), device=device)
        self.steps, self.since = 0, 0
        self.records: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()

    def step_done(self, loss: torch.Tensor, total_steps: int) -> None:
        self.loss_sum += loss.detach()
        self.steps += 1
        self.since += 1
        if self.steps % self.log_every == 0 or self.steps == total_steps:
            loss_mean = self.reduce_sum(self.loss_sum).item() / (self.since * self.world)  # host-device sync
            elapsed = time.perf_counter() - self.t0
            self.records.append({"kind": "train", "step": self.steps, "loss": loss_mean,
                                 "samples_per_s": self.since * self.global_batch / elapsed,
                                 "step_time_s": elapsed / self.since})
            self.loss_sum.zero_()
            self.since, self.t0 = 0, time.perf_counter()


def finish(impl: str, timer: IntervalTimer, device: torch.device, out: str) -> None:
    """Peak memory as scaletrain measures it (CUDA allocator peak, or peak RSS), max over ranks; rank 0 writes."""
    peak = torch.tensor([peak_memory_bytes(device)], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps({"impl": impl, "world_size": timer.world, "device": str(device),
                                         "global_batch": timer.global_batch, "records": timer.records,
                                         "peak_mem_bytes": int(peak.item())}))
