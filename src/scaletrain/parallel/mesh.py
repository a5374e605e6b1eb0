"""The DeviceMesh of a run's Layout (scaletrain/layout.py decides the degrees; this builds what they name)."""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scaletrain.layout import MESH_DIMS, Layout, resolve_degrees

log = logging.getLogger(__name__)


def build_mesh(device_type: str, layout: Layout) -> DeviceMesh | None:
    """A DeviceMesh over the default process group with the layout's axes, outermost first: pp, dp_replicate,
    dp_shard, tp (torchtitan's order: tensor-parallel ranks are neighbours, on one machine).

    As in torchtitan, an axis of degree 1 is left out (fewer sub-groups), except dp_shard under FSDP/HSDP,
    which fully_shard needs even at degree 1 (FSDP on one GPU is a 1-rank "dp_shard" mesh). None when no axis
    is left, or on one process without a process group (nothing to split across).
    """
    keep = {"dp_shard"} if layout.sharded else set()
    shape = [(name, n) for name, n in layout.mesh_shape if n > 1 or name in keep]
    if not shape or (layout.world_size == 1 and not dist.is_initialized()):
        return None
    mesh = init_device_mesh(device_type, tuple(n for _, n in shape), mesh_dim_names=tuple(name for name, _ in shape))
    log.info("device mesh: %s on %s", " x ".join(f"{k} {n}" for k, n in shape), device_type)
    return mesh


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part of ``mesh``: (dp_replicate, dp_shard) for HSDP, dp_shard for FSDP."""
    names = [n for n in ("dp_replicate", "dp_shard") if n in (mesh.mesh_dim_names or ())]
    return mesh[tuple(names)] if len(names) > 1 else mesh[names[0]]


__all__ = ["MESH_DIMS", "build_mesh", "dp_mesh", "resolve_degrees"]
