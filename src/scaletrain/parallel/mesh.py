"""The DeviceMesh of a layout's data-parallel degrees (scaletrain/layout.py decides the degrees)."""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scaletrain.layout import MESH_DIMS, resolve_degrees

log = logging.getLogger(__name__)

def build_mesh(device_type: str, replicate: int, shard: int) -> DeviceMesh | None:
    """A DeviceMesh over the default process group with the axes ("dp_replicate", "dp_shard").

    As in torchtitan, an axis of degree 1 is left out (a 1-D mesh reuses the default group instead of
    creating sub-groups), but one axis always stays: FSDP on one GPU is a 1-rank "dp_shard" mesh.
    None on one process without a process group (nothing to replicate or shard across).
    """
    if replicate * shard == 1 and not dist.is_initialized():
        return None
    shape = [(name, n) for name, n in zip(MESH_DIMS, (replicate, shard)) if n > 1] or [("dp_shard", 1)]
    mesh = init_device_mesh(device_type, tuple(n for _, n in shape),
                            mesh_dim_names=tuple(name for name, _ in shape))
    log.info("device mesh: %s on %s", " x ".join(f"{k} {n}" for k, n in shape), device_type)
    return mesh


__all__ = ["MESH_DIMS", "build_mesh", "resolve_degrees"]
