"""Cross-entropy over a large vocabulary fused with the output projection.

``F.cross_entropy(h @ W.T, y)`` writes the (N, V) logits, reads them for the loss, keeps them for backward,
and backward reads them again to write their gradient: at GPT-2's 50,304 tokens and 64 x 1024 tokens per
step the logits are 6.6 GB in bf16 (13 GB if upcast). ``linear_cross_entropy``
computes the loss and the gradient of the logits in the same pass, per chunk of rows, and turns that gradient
into the gradients of ``h`` and ``W`` at once (the two backward matrix products, moved into forward); what
backward keeps is those two small gradients, never the logits. The FLOPs are the same three products.

Backward then only scales the kept gradients by the loss's incoming gradient, so the function must be called
once per backward (it is: a loss is differentiated once).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor


def _chunks(hc: Tensor, wc: Tensor, target: Tensor, chunk_rows: int,
            acc: torch.dtype) -> Iterator[tuple[slice, Tensor, Tensor]]:
    """(rows, logits of those rows in ``acc``, their targets), chunk by chunk."""
    for start in range(0, hc.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        yield rows, (hc[rows] @ wc.T).to(acc), target[rows]  # compiled, the upcast stays inside one fused pass


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, target: Tensor, chunk_rows: int,  # type: ignore[override]
                dtype: torch.dtype) -> Tensor:
        n, vocab = h.shape[0], weight.shape[0]
        hc, wc = h.to(dtype), weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)  # the softmax's and the accumulators' dtype
        columns = torch.arange(vocab, device=h.device)
        grad_h = torch.empty_like(hc)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        for rows, logits, t in _chunks(hc, wc, target, chunk_rows, acc):
            lse = torch.logsumexp(logits, dim=-1)
            total = total + (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
            # d(mean loss)/d logits = (softmax - one_hot) / n
            prob = torch.exp(logits - lse[:, None])
            grad = (torch.where(columns[None, :] == t[:, None], prob - 1.0, prob) / n).to(dtype)
            grad_h[rows] = grad @ wc
            grad_w += (grad.T @ hc[rows]).to(acc)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = (h.dtype, weight.dtype)
        return total / n

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, Tensor, None, None, None]:  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return (grad_h * grad_loss).to(h_dtype), (grad_w * grad_loss).to(w_dtype), None, None, None


def linear_cross_entropy(h: Tensor, weight: Tensor, target: Tensor, *, chunk_rows: int = 8192,
                         dtype: torch.dtype | None = None) -> Tensor:
    """Mean cross-entropy of ``h @ weight.T`` against ``target``, without keeping the logits.

    h (..., C), weight (V, C), target (...) of class ids. ``dtype``: the dtype of the matrix products (bf16
    for mixed precision; default: the autocast dtype when autocast is on, else h's); the softmax is in fp32.
    Peak extra memory is one chunk of logits (chunk_rows x V), not all of them (in eager mode; a compiled
    graph schedules its own buffers). Every target must be a class id: there is no ignore_index. Without
    gradients to compute (evaluation, torch.no_grad) it computes the loss alone.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if dtype is None:
        device = h.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h.dtype
    h, target = h.flatten(0, -2), target.flatten()
    with torch.autocast(h.device.type, enabled=False):
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            return _LinearCrossEntropy.apply(h, weight, target, chunk_rows, dtype)
        acc = torch.promote_types(dtype, torch.float32)  # evaluation: the loss alone, chunk by chunk
        chunks = _chunks(h.to(dtype), weight.to(dtype), target, chunk_rows, acc)
        return sum(F.cross_entropy(logits, t, reduction="sum") for _, logits, t in chunks) / h.shape[0]
