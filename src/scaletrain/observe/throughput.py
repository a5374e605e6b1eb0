"""Model FLOPs per sample, device peaks, and model FLOPs utilization (MFU).

MFU = achieved model FLOP/s / (world size x the device's peak), with the model's FLOPs counted once per
sample the way the field does: a model that states its own count (the GPT: PaLM's 6N + 12*L*H*Q*T per token,
as torchtitan and nanoGPT count it) uses it; any other model is counted once, forward and backward of one
sample, with torch.utils.flop_counter (matmuls and convolutions). Recomputation by activation checkpointing
is not model FLOPs: it lowers MFU, as it should.

Peaks are dense tensor-core rates from the vendors' data sheets, for the precision the run computes in:
bf16/fp16 for the mixed modes, TF32 for fp32 (PyTorch's matmuls use TF32 only when allowed; the fp32 rate is
then used). On a CPU no peak is claimed: achieved FLOP/s only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# (name fragment, {precision: FLOP/s}), the first match wins (so "H100 PCIe" before "H100").
PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("H100", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),  # SXM
    ("H200", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    ("GH200", {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    ("A100", {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("A10", {"bf16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("V100", {"bf16": 0.0, "fp16": 125e12, "fp32": 15.7e12}),
]


def peak_flops(name: str, precision: str, *, tf32: bool) -> float | None:
    """Dense peak FLOP/s of the GPU called ``name`` for the precision a run computes in (fp32: TF32 tensor
    cores when ``tf32``), or None when the GPU or its rate is not in PEAKS."""
    table = next((peaks for key, peaks in PEAKS if key in name), None)
    if table is None:
        return None
    if precision == "bf16-mixed":
        key = "bf16"
    elif precision == "fp16-mixed":
        key = "fp16" if "fp16" in table else "bf16"
    else:
        key = "tf32" if tf32 else "fp32"
    return table.get(key) or None


def device_peak(device: torch.device, precision: str) -> tuple[str, float | None]:
    """(device name, peak FLOP/s for this precision or None when unknown)."""
    if device.type != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name(device)
    return name, peak_flops(name, precision, tf32=torch.backends.cuda.matmul.allow_tf32)


def flops_per_sample(model: nn.Module, sample: torch.Tensor) -> float:
    """Training FLOPs (forward + backward) of one sample: the model's own count if it states one, else
    counted once with torch.utils.flop_counter on a copy of the sample."""
    stated = getattr(model, "flops_per_sample", None)
    if callable(stated):
        return float(stated())
    from torch.utils.flop_counter import FlopCounterMode

    x = sample.unsqueeze(0)
    buffers = [b.detach().clone() for b in model.buffers()]  # a train-mode forward may update them (BN)
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
        counter = FlopCounterMode(display=False)
        with counter:
            out = model(x)
            out.float().sum().backward()
    for p in model.parameters():
        p.grad = None
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    return float(counter.get_total_flops())


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
