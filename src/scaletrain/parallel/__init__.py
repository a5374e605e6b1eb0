"""One function per technique, composed by parallelize() in a fixed order: compile, then data parallelism.

Compiling before wrapping follows torchtitan: DDP's gradient hooks then see the compiled module's parameters,
and a model with a ``blocks`` ModuleList is compiled block by block so that gradients of late blocks are
ready (and their all-reduce can start) while earlier blocks are still in backward.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scaletrain.config import ParallelConfig

log = logging.getLogger(__name__)


def apply_compile(model: nn.Module) -> None:
    """torch.compile in place (state_dict keys unchanged), per transformer block when there are blocks."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        for block in blocks:
            block.compile()
        log.info("compiled %d blocks", len(blocks))
    else:
        model.compile()
        log.info("compiled the whole model")


def apply_ddp(model: nn.Module, device: torch.device, *, bucket_mb: float, find_unused: bool) -> DDP:
    """Replicate the model; gradients are averaged by bucketed all-reduce overlapping backward."""
    ids = [device.index] if device.type == "cuda" else None
    wrapped = DDP(model, device_ids=ids, bucket_cap_mb=bucket_mb, find_unused_parameters=find_unused,
                  gradient_as_bucket_view=True)
    log.info("DDP: buckets of %.0f MB", bucket_mb)
    return wrapped


def parallelize(model: nn.Module, device: torch.device, world_size: int, cfg: ParallelConfig, *,
                compile: bool) -> nn.Module:
    """Returns the module that forward/backward go through; ``model`` itself stays the bare module."""
    if compile:
        apply_compile(model)
    if world_size > 1:
        return apply_ddp(model, device, bucket_mb=cfg.bucket_mb, find_unused=cfg.find_unused)
    return model
