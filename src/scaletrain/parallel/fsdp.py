"""FSDP2: ``torch.distributed.fsdp.fully_shard`` per unit and at the root, with mixed precision and offload.

The units (which submodules get their own ``fully_shard``, hence their own all-gather and reduce-scatter) are
the model's repeated blocks as ``units.find_units`` finds them (parallel.fsdp_units, a ``blocks`` ModuleList,
transformers' ``_no_split_modules``, the largest run of same-class layers). Whatever no unit holds (the
embeddings, the final norm, a head tied to the embedding) belongs to the root's unit: fully_shard keeps a
parameter tied only among the modules of one call, and the root's call is the one that holds both ends of a
tie. Units are sharded bottom-up, as fully_shard requires, so each unit's parameters are gathered just before
it runs and freed after it (reshard_after_forward), which is what bounds the unsharded memory to about one unit.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from scaletrain.parallel.tensor import fsdp_placement
from scaletrain.parallel.units import Units, find_units
from scaletrain.sharded import stage_parts

log = logging.getLogger(__name__)

# The trainer's precision names (and the short forms used before the "-mixed" names): compute dtype.
_COMPUTE_DTYPE = {"fp32": None, "bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16,
                  "fp16-mixed": torch.float16, "fp16": torch.float16}


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """fp32 | bf16-mixed | fp16-mixed -> FSDP2's policy.

    Parameters are cast to the compute dtype for forward/backward (the sharded fp32 master copy is what the
    optimizer updates); gradients are reduce-scattered in fp32, as torchtitan does, so summing over many ranks
    loses no precision. (apply_fsdp also casts the root's output to fp32, so the loss sees fp32 logits.)
    """
    if precision not in _COMPUTE_DTYPE:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(_COMPUTE_DTYPE)}")
    dtype = _COMPUTE_DTYPE[precision]
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def fsdp_units(model: nn.Module, names: str = "") -> list[nn.Module]:
    """The submodules that become their own FSDP units (units.find_units; ``names``: parallel.fsdp_units)."""
    return list(find_units(model, names).modules)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, reshard_after_forward: bool = True,
               cpu_offload: bool = False, units: Units | None = None) -> nn.Module:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP); returns it.

    The root keeps its parameters gathered after forward (fully_shard's default for the root): backward
    needs them first. With ``cpu_offload`` the sharded parameters, gradients and optimizer state live in host
    memory and the optimizer step runs on the CPU (pinned only where there is an accelerator to copy to).
    ``units``: find_units(model) unless given (parallelize finds them once for FSDP, checkpointing and compile).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    units = units if units is not None else find_units(model)
    norms = _batch_norms(model) if param_dtype is not None else []
    for norm in norms:  # first: a unit's fully_shard leaves what a sharded submodule holds to it
        # BatchNorm keeps fp32 running statistics, and batch_norm refuses bf16 weights beside them ("expected
        # scalar type BFloat16 but found Float"): its own unit computes in fp32 and hands the compute dtype on,
        # as FSDP1 did for BatchNorm and Lightning and timm keep norms in fp32
        fully_shard(norm, mesh=mesh, offload_policy=offload, reshard_after_forward=reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=reduce_dtype,
                                                   output_dtype=param_dtype))
    # Complex parameters (a Fourier neural operator's spectral weights): the policy would cast them to the real
    # compute dtype, dropping their imaginary part, and reduce their complex gradients as fp32, which stopped the
    # first backward ("torch.cat(): input types can't be cast to the desired output type Float"). A unit holding
    # one keeps its dtypes; autocast, on top for models of one's own (precision.policy_casts), still computes in
    # the compute dtype.
    whole = MixedPrecisionPolicy()
    in_units = {id(p) for part in [*norms, *units] for p in part.parameters()}  # before fully_shard replaces them
    complex_root = any(p.is_complex() for p in model.parameters() if id(p) not in in_units)
    for unit in units:
        if any(unit is norm for norm in norms):  # a BatchNorm found as a unit: its own already, in fp32
            continue
        fully_shard(unit, mesh=mesh, mp_policy=whole if any(p.is_complex() for p in unit.parameters()) else mp,
                    offload_policy=offload, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=fsdp_placement)
    root_mp = MixedPrecisionPolicy(param_dtype=None if complex_root else param_dtype,
                                   reduce_dtype=None if complex_root else reduce_dtype,
                                   output_dtype=torch.float32 if param_dtype is not None else None)
    fully_shard(model, mesh=mesh, mp_policy=root_mp, offload_policy=offload, shard_placement_fn=fsdp_placement)
    dims = "x".join(str(s) for s in mesh.shape)
    log.info("FSDP: %s + root on mesh %s (%s), params %s, reduce %s, reshard_after_forward=%s%s%s",
             units.describe() or "no units", dims, "HSDP" if mesh.ndim == 2 else "FSDP", param_dtype or "fp32",
             reduce_dtype or "fp32", reshard_after_forward, ", CPU offload" if cpu_offload else "",
             f", {len(norms)} BatchNorm units in fp32" if norms else "")
    return model


def _batch_norms(model: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers with weights (affine) of ``model``."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and any(True for _ in m.parameters(recurse=False))]


def reduce_unused(model: nn.Module) -> bool:
    """Have every FSDP unit of ``model`` (each root of a rank's interleaved stages) reduce-scatter a zero gradient
    for a parameter that got none in a backward, as DDP's find_unused_parameters averages a zero for it (torch's
    set_reduce_scatter_unused_params). A unit's gradients are reduce-scattered as one collective: where the
    ranks' batches leave different parameters without a gradient (a mixture of experts, routing each rank's
    tokens to other experts), their collectives would differ in size (Gloo aborts the process, NCCL hangs or
    mixes the data up). A parameter no rank used gets a zero gradient rather than none (AdamW still decays it).
    False, with nothing changed, where this torch's FSDP has no such switch."""
    parts = stage_parts(model)
    if not all(hasattr(part, "set_reduce_scatter_unused_params") for part in parts):
        return False
    for part in parts:
        part.set_reduce_scatter_unused_params(True)
    return True
