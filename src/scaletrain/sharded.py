"""Is it sharded? DTensor and FSDP2 checks that import neither torch.distributed.tensor nor .fsdp.

Importing torch's DTensor (and FSDP2, DCP's state_dict helpers, tensor parallelism: all built on it) costs a
process ~0.5 s, on a CPU about a seventh of a short run's start (torch itself ~1.2 s). A run that never shards
never needs it. No DTensor or FSDP module can exist before torch's module defining it is imported, so each check
looks the class up where it is imported and answers False where it is not: the same answer, for free.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
from torch import nn


def _imported(module: str, name: str) -> type | tuple[()]:
    """torch's class ``module.name`` where ``module`` is imported, else () (an isinstance of nothing)."""
    found = sys.modules.get(module)
    return getattr(found, name) if found is not None else ()


def dtensor_class() -> type | tuple[()]:
    """DTensor, or () where no DTensor can exist yet: for isinstance in a loop (look it up once)."""
    return _imported("torch.distributed.tensor", "DTensor")


def fsdp_class() -> type | tuple[()]:
    """FSDP2's FSDPModule (fully_shard's modules are of a subclass of it), or () where none can exist yet."""
    return _imported("torch.distributed.fsdp", "FSDPModule")


def is_dtensor(obj: Any) -> bool:
    return isinstance(obj, dtensor_class())


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP shard's rows, a tensor-parallel split); any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t


def plain(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_context() is a replicated DTensor: its value as an ordinary tensor."""
    return t.full_tensor() if is_dtensor(t) else t


def loss_context(model: nn.Module) -> contextlib.AbstractContextManager:
    """torch's loss_parallel() where ``model``'s logits stay split by vocabulary (parallel/tensor.py's apply_tp
    with ``loss_parallel``): the cross-entropy and its backward run on the shards inside it. A no-op context
    for any other model."""
    if not getattr(model, "loss_parallel", False):
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def stage_parts(module: nn.Module) -> list[nn.Module]:
    """The stage modules a rank runs: a pipeline's _Stages' parts, or the module itself."""
    return list(getattr(module, "parts", None) or [module])


def is_fsdp(model: nn.Module) -> bool:
    """True when ``model`` was sharded by fully_shard (its forward casts for mixed precision by itself), or,
    a rank's interleaved pipeline stages, each of them was."""
    kind = fsdp_class()
    return all(isinstance(part, kind) for part in stage_parts(model))


def has_dtensors(model: nn.Module) -> bool:
    """True when ``model``'s parameters are DTensors (FSDP's shards, tensor parallelism's splits): its state is
    saved and loaded through DCP by every rank, and an optimizer built before must take the new parameters."""
    kind = dtensor_class()
    return is_fsdp(model) or any(isinstance(p, kind) for p in model.parameters())
