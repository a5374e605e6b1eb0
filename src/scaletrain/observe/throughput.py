"""Model FLOPs per sample, device peaks, and model FLOPs utilization (MFU).

MFU = achieved model FLOP/s / (world size x the device's peak), with the model's FLOPs counted once per
sample the way the field does: a model that states its own count (the GPT: PaLM's 6N + 12*L*H*Q*T per token,
as torchtitan and nanoGPT count it) uses it; any other model is counted once, forward and backward of one
sample, with torch.utils.flop_counter (matmuls and convolutions). Recomputation by activation checkpointing
is not model FLOPs: it lowers MFU, as it should.

Peaks (observe/peaks.py) are dense tensor-core rates from the vendors' data sheets, for the number format
the run's matmuls compute in: bf16/fp16 for the mixed modes; for fp32 the TF32 rate when train.tf32 lets the
matmuls use TF32 tensor cores, else the fp32 rate. On a CPU no peak is claimed: achieved FLOP/s only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from scaletrain.batch import Batch, backward_scalar
from scaletrain.observe.peaks import PEAKS, compute_format, peak_flops

__all__ = ["PEAKS", "compute_format", "device_peak", "flops_per_sample", "peak_flops", "throughput"]

def device_peak(device: torch.device, precision: str, *, tf32: bool) -> tuple[str, float | None]:
    """(device name, peak FLOP/s for this precision or None when unknown); ``tf32``: the run's train.tf32,
    which train.precision.set_tf32 applied (passed, not read back: torch's legacy allow_tf32 getter raises
    once code has used the newer fp32_precision API)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, peak_flops(name, precision, tf32=tf32)


def flops_per_sample(model: nn.Module, one: Batch | torch.Tensor,
                     seen: Callable[[Any, Batch], None] | None = None) -> float:
    """Training FLOPs (forward + backward) of one sample: the model's own count if it states one, else
    counted once with torch.utils.flop_counter on ``one``, a batch of one sample (or one input tensor without
    its batch dimension), run as two. The model may return a tensor, a tuple, a dict or a ModelOutput: backward runs from
    its own loss if it computed one, else from the sum of every differentiable tensor it returned. ``seen``: shown
    the output of that forward and the batch it ran on (the two copies: a check of the targets against it, before
    training), when there is one."""
    stated = getattr(model, "flops_per_sample", None)
    if callable(stated):
        return float(stated())
    from torch.utils.flop_counter import FlopCounterMode

    # Two copies of the sample, counted and halved: a training-mode BatchNorm1d refuses a batch of one.
    batch = (one if isinstance(one, Batch) else Batch((one.unsqueeze(0),), {}, None)).repeat(2)
    device = next(batch.tensors()).device
    buffers = [b.detach().clone() for b in model.buffers()]  # a train-mode forward may update them (BN)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        counter = FlopCounterMode(display=False)
        with counter:
            output = batch(model)
            backward_scalar(output).backward()
    for p in model.parameters():
        p.grad = None
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    if seen is not None:
        seen(output, batch)
    return counter.get_total_flops() / 2


def per_second(rate: float) -> str:
    """A rate for the console: whole numbers with thousands separators, three significant digits below 100 (a
    detection model on a CPU trains 0.27 samples/s, which ",.0f" showed as 0)."""
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


def throughput(samples_per_s: float, *, flops: float, tokens_per_sample: int, world_size: int,
               peak: float | None) -> dict[str, Any]:
    """The throughput keys of a train record (docs/metrics.md)."""
    out: dict[str, Any] = {"samples_per_s_per_rank": samples_per_s / world_size}
    if tokens_per_sample:
        out["tokens_per_s"] = samples_per_s * tokens_per_sample
    if flops:
        out["flops_per_s"] = samples_per_s * flops
        if peak:
            out["mfu"] = out["flops_per_s"] / (world_size * peak)
    return out
