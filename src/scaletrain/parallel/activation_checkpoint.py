"""Activation checkpointing per block: keep less from forward, recompute it in backward.

- ``full``: each block keeps only its input; its forward runs again during backward (about one extra forward,
  ~33% more compute, for activation memory of one block plus the block inputs).
- ``selective``: torchtitan's op-level selective checkpointing. Inside each block, the outputs of attention
  (SDPA) and of every other matrix multiply are saved; everything else -- the other half of the matmuls,
  layer norms, GELU, residual adds, dropout -- is recomputed in backward. Saving attention avoids its
  quadratic recompute, and pointwise ops are cheap to redo but their outputs (e.g. the 4C-wide MLP input to
  GELU) are a large share of activation memory. It is the middle point between none and full in both memory
  and compute. (torchtitan's other selective option, ``selective_ac_option = n``, fully checkpoints every
  n-th block; op-level keeps the choice inside every block, which suits models with few blocks too.)

The blocks are the same units as FSDP's (``units.find_units``); a model without any is checkpointed whole.
Checkpointing wraps each block's ``forward`` in place with ``torch.utils.checkpoint.checkpoint``
(non-reentrant), so module names and state_dict keys do not change and FSDP/compile see the same modules.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from scaletrain.parallel.units import Units, find_units

log = logging.getLogger(__name__)

AC_MODES = ("none", "full", "selective")

_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default}
# Ops whose outputs selective checkpointing saves (every other matmul among them, see _policy).
_SAVE = _MATMULS | {
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _selective_context() -> tuple[Any, Any]:
    """A fresh pair of contexts per checkpointed call; counts matmuls separately in forward and recompute so
    both passes agree on which outputs were saved."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = "recompute" if ctx.is_recompute else "forward"
        if func in _MATMULS:
            counts[key] += 1
            if counts[key] % 2 == 0:  # every second matmul is recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


# Arguments (besides use_cache) through which a Hugging Face block fills a key/value cache: a forward that updates a cache is
# not the same forward when recomputed (checkpoint's "A different number of tensors was saved"), and training
# reads no cache. transformers' own GradientCheckpointingLayer drops them the same way (transformers 5 names the
# cache ``cache``, 4.x ``past_key_value(s)``, GPT-2 of old ``layer_past``); a block that only reads its cache
# says so (_can_checkpoint_with_cache) and keeps it.
_CACHES = ("cache", "past_key_value", "past_key_values", "layer_past")


def _checkpointed(block: nn.Module, selective: bool) -> Callable[..., Any]:
    forward = block.forward
    extra = {"context_fn": _selective_context} if selective else {}
    caches = () if getattr(block, "_can_checkpoint_with_cache", False) else _CACHES
    try:  # where a cache comes by position (GPT-2 passes its cache second)
        names = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        names = []
    at = [i for i, name in enumerate(names) if name in caches]

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation or generation: nothing to recompute, caches welcome
            return forward(*args, **kwargs)
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        kwargs.update({k: None for k in caches if kwargs.get(k) is not None})
        if any(i < len(args) and args[i] is not None for i in at):
            args = tuple(None if i in at else a for i, a in enumerate(args))
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    return run


def apply_activation_checkpointing(model: nn.Module, mode: str, units: Units | None = None) -> None:
    """Checkpoint every block of ``model`` in place: none | full | selective (see the module docstring).
    ``units``: find_units(model) unless given."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: expected one of {AC_MODES}")
    if mode == "none":
        return
    blocks = list(units if units is not None else find_units(model))
    if not blocks:  # a model without blocks: checkpoint it whole (keeps only its input)
        blocks = [model]
    for block in blocks:
        # An instance attribute: __call__, and the FSDP and compile hooks around it, stay the module's own.
        block.forward = _checkpointed(block, mode == "selective")  # type: ignore[method-assign]
    log.info("activation checkpointing: %s, %d blocks", mode, len(blocks))
