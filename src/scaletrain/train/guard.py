"""The non-finite guard: a step whose loss or gradients are not finite is never applied, decided on the device.

The decision uses the total gradient norm, which is the same number on every rank (DDP averages gradients
before it is computed; under sharding the norm is all-reduced), so every rank makes the same decision
without an extra collective. A fused optimizer reads the decision from ``optimizer.found_inf`` and skips
the update inside its kernel (the step counter is left unchanged), the mechanism torch's GradScaler uses:
no host-device sync per step. What happened is read back at the loop's sync points (log steps,
checkpoints): the number of skipped steps, the first one, and the first step whose loss was not finite on
this rank, so that ``train.nonfinite=raise`` can name the rank and step.

With fp16 the GradScaler owns skipping (an overflow there is routine, not an error); the guard then only
watches the loss.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from scaletrain.sharded import plain


def supports_device_skip(optimizer: Optimizer) -> bool:
    """True for torch's fused optimizers, which skip a step on ``found_inf`` inside the kernel."""
    return bool(optimizer.defaults.get("fused")) and getattr(optimizer, "_step_supports_amp_scaling", False)


def clipped_norm(params: list[torch.Tensor], clip: float, scaler: torch.amp.GradScaler,
                 optimizer: Optimizer) -> torch.Tensor | None:
    """The total gradient norm of ``params`` (the optimizer's, with gradients), clipping them to ``clip`` if it is
    positive (the gradients unscaled first under fp16); None under fp16 without clipping, where the scaler checks
    the gradients itself. Sharded gradients give a DTensor norm: its full value (one small all-reduce) is
    returned, the same on every rank."""
    if clip > 0:
        scaler.unscale_(optimizer)  # a no-op unless the scaler is enabled (fp16)
        if any(p.grad is not None and p.grad.is_sparse for p in params):
            return _clipped_sparse(params, clip)
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    elif scaler.is_enabled():
        return None
    elif any(p.grad is not None and p.grad.is_sparse for p in params):
        return _clipped_sparse(params, 0.0)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return plain(norm)


def sparse_gradient_modules(model: torch.nn.Module) -> list[str]:
    """The modules of ``model`` whose weight gets a sparse gradient (an nn.Embedding or nn.EmbeddingBag made
    with sparse=True, as word2vec-style and recommender models are): torch's clip_grad_norm_ has no kernel for
    them, AdamW and the fused optimizers refuse them, and FSDP cannot shard them."""
    return [f"{name or 'the model'} ({type(m).__name__}(sparse=True))" for name, m in model.named_modules()
            if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag) and m.sparse and m.weight.requires_grad]


def _clipped_sparse(params: list[torch.Tensor], clip: float) -> torch.Tensor:
    """clip_grad_norm_ over gradients some of which are sparse (torch's has no sparse kernel): the norm of a
    sparse gradient is that of its coalesced values; each gradient, sparse or dense, is scaled in place."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    for p in params:  # coalesced: a row drawn twice in a batch is one value, its norm counted once
        if p.grad is not None and p.grad.is_sparse:
            p.grad = p.grad.coalesce()
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([
        torch.linalg.vector_norm(g.values() if g.is_sparse else g, dtype=torch.float32) for g in grads]))
    if clip > 0:
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm


def nonfinite_where(first_skips: list[float], first_bad_losses: list[float]) -> str:
    """Where a non-finite step was, from every rank's guard counters: the first rank and step whose loss was
    NaN or infinite, else the first step whose gradients were."""
    bad = [(int(s), rank) for rank, s in enumerate(first_bad_losses) if s >= 0]
    if bad:
        step, rank = min(bad)
        return f"non-finite loss on rank {rank} at step {step}"
    return f"non-finite gradients at step {int(min(s for s in first_skips if s >= 0))} (the loss was finite on every rank)"


class NonFiniteGuard:
    def __init__(self, device: torch.device, *, scaler_owns_skips: bool, device_skip: bool) -> None:
        self.scaler_owns_skips = scaler_owns_skips
        self.device_skip = device_skip
        self.skipped = torch.zeros((), device=device)  # steps not applied (the same on every rank)
        self.first_skip = torch.full((), -1.0, device=device)  # the first of them
        self.first_bad_loss = torch.full((), -1.0, device=device)  # first step with a non-finite loss, this rank

    def watch_loss(self, step: int, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss)
        self.first_bad_loss = torch.where((self.first_bad_loss < 0) & bad, float(step), self.first_bad_loss)

    def gate(self, step: int, optimizer: Optimizer, grad_norm: torch.Tensor, *, device_skip: bool | None = None,
             may_sync: bool = True) -> bool:
        """Arm the optimizer for this step; returns False when the caller must not call step() (the
        host-side fallback for a non-fused optimizer, which costs a sync). ``device_skip``: this optimizer's
        (supports_device_skip), where one guard serves several optimizers; default the guard's. Without
        ``may_sync`` an optimizer that cannot skip on the device is not held back: the step is counted (the
        sync points see it) and applied."""
        device_skip = self.device_skip if device_skip is None else device_skip
        if self.scaler_owns_skips:
            return True
        found = (~torch.isfinite(grad_norm)).to(self.skipped.dtype)
        self.skipped += found
        self.first_skip = torch.where((self.first_skip < 0) & (found > 0), float(step), self.first_skip)
        if device_skip:
            optimizer.found_inf = found  # type: ignore[attr-defined]
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            return True
        if not may_sync:
            return True
        return not bool(found.item())  # host-device sync: only for optimizers that cannot skip on the device

    @staticmethod
    def disarm(optimizer: Optimizer) -> None:
        for attr in ("found_inf", "grad_scale"):
            if hasattr(optimizer, attr):
                delattr(optimizer, attr)

    def state(self) -> list[torch.Tensor]:
        """What the sync points gather from each rank: skipped, first skipped step, first bad loss step."""
        return [self.skipped, self.first_skip, self.first_bad_loss]

    def state_dict(self) -> dict[str, float]:
        return {"skipped": float(self.skipped.item()), "first_skip": float(self.first_skip.item()),
                "first_bad_loss": float(self.first_bad_loss.item())}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.skipped.fill_(state["skipped"])
        self.first_skip.fill_(state["first_skip"])
        self.first_bad_loss.fill_(state["first_bad_loss"])
