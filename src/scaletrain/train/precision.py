"""Mixed precision: autocast contexts and the fp16 gradient scaler."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch

from scaletrain.errors import ConfigError


def check_precision(precision: str, device: torch.device) -> None:
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision", "fp16", "fp32 or bf16 on a CPU (fp16 with loss scaling needs CUDA)",
                          "--train.precision=bf16")


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """The forward-pass context: fp32 runs as is; bf16/fp16 autocast matmuls and keep fp32 master weights."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A scaler that is a no-op unless the run is fp16 (bf16 has fp32's range and needs none)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
