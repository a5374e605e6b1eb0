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

A block's recomputed forward leaves its running statistics as they were: BatchNorm (and an InstanceNorm that
tracks them) would otherwise fold the same batch into its running mean and variance twice per step, so the
evaluated model would differ from the one trained without checkpointing (measured: eval loss 1.1734 -> 1.1915
for a 2-layer MLP with BatchNorm after 6 steps). fairscale's checkpoint_wrapper guarded BatchNorm the same way;
torch.utils.checkpoint does not.
"""

from __future__ import annotations

import contextlib
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


def _tracking_norms(block: nn.Module) -> list[nn.modules.batchnorm._NormBase]:
    """The block's BatchNorm and InstanceNorm layers that keep running statistics."""
    return [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
            and m.track_running_stats and m.running_mean is not None]


def _stats(norm: nn.modules.batchnorm._NormBase) -> list[torch.Tensor]:
    return [b for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked) if b is not None]


@contextlib.contextmanager
def _stats_kept(norms: list[nn.modules.batchnorm._NormBase]) -> Any:
    """Around a recompute: the norms' running statistics as they were before it (also when checkpoint stops the
    recompute early, by raising, once it has what backward needs)."""
    kept = [[b.clone() for b in _stats(m)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, saved in zip(norms, kept):
                for now, before in zip(_stats(m), saved):
                    now.copy_(before)


def _context(selective: bool, norms: list[nn.modules.batchnorm._NormBase]) -> Callable[[], tuple[Any, Any]] | None:
    """checkpoint's context_fn: the selective policy, the running statistics kept through the recompute, both,
    or None (checkpoint's default) for a full checkpoint of a block without such norms."""
    if not norms:
        return _selective_context if selective else None

    def contexts() -> tuple[Any, Any]:
        forward, recompute = _selective_context() if selective else (contextlib.nullcontext(), contextlib.nullcontext())

        @contextlib.contextmanager
        def both() -> Any:
            with _stats_kept(norms), recompute:  # the copies made outside the selective policy's cache
                yield

        return forward, both()

    return contexts


def _checkpointed(block: nn.Module, selective: bool) -> Callable[..., Any]:
    forward = block.forward
    context_fn, traced_fn = _context(selective, _tracking_norms(block)), _context(selective, [])
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
        # traced by torch.compile, the running statistics are updated once in the forward graph and the recompute
        # in the backward graph leaves them alone (measured the same as uncheckpointed); compile takes a
        # context_fn only of dispatch modes
        fn = traced_fn if torch.compiler.is_compiling() else context_fn
        extra = {"context_fn": fn} if fn is not None else {}
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    run._scaletrain_checkpointed = True  # type: ignore[attr-defined]
    return run


def _uncheckpointed(model: nn.Module) -> None:
    """Give back the forward of every block an earlier run checkpointed: a model trained again in the same
    process (fit() twice) was checkpointed inside its checkpoint, recomputing twice, or still checkpointed
    under --memory.activation_checkpointing=none."""
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "_scaletrain_checkpointed", False):
            del module.forward


def apply_activation_checkpointing(model: nn.Module, mode: str, units: Units | None = None) -> None:
    """Checkpoint every block of ``model`` in place: none | full | selective (see the module docstring).
    ``units``: find_units(model) unless given."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: expected one of {AC_MODES}")
    _uncheckpointed(model)
    if mode == "none":
        return
    blocks = list(units if units is not None else find_units(model))
    if not blocks:  # a model without blocks: checkpoint it whole (keeps only its input)
        blocks = [model]
    for block in blocks:
        # An instance attribute: __call__, and the FSDP and compile hooks around it, stay the module's own.
        block.forward = _checkpointed(block, mode == "selective")  # type: ignore[method-assign]
    log.info("activation checkpointing: %s, %d blocks", mode, len(blocks))
