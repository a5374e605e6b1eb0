"""Evaluation on the held-out split, aggregated exactly across ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from scaletrain.data import eval_loader
from scaletrain.train.job import Job
from scaletrain.train.precision import autocast


@torch.no_grad()
def evaluate(job: Job) -> dict[str, float]:
    """Mean loss and (for integer class targets) accuracy over the held-out split.

    Each rank sums loss x count, correct and count over its own samples; one all-reduce adds the sums, so
    the result is sum(correct) / sum(count) over the whole split: no mean of means, no sample twice.
    Accuracy is exact at any world size; the loss agrees to float32 rounding (batch means are float32).
    Runs on the bare module: DDP's forward is not needed without gradients, and ranks may see one sample
    more or less than each other. Under FSDP the module's forward is collective, so a rank with fewer
    batches runs uncounted forwards until every rank has run as many.
    """
    cfg, rt, module = job.cfg, job.rt, job.module
    assert job.eval_data is not None
    loader = eval_loader(job.eval_data, batch_size=cfg.data.eval_batch_size or cfg.data.batch_size,
                         rank=rt.rank, world=rt.world_size, num_workers=cfg.data.num_workers,
                         pin_memory=rt.device.type == "cuda")
    module.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss x count, correct
    count, other = 0, 0  # targets seen (tokens for a language model), batches without class targets
    forwards = len(loader)
    if job.sharded:
        # FSDP's forward is collective (it all-gathers parameters): every rank must run the same number of
        # forwards, though one rank may hold one sample more. The extra forwards are not counted.
        most = -(-len(job.eval_data) // rt.world_size)  # type: ignore[arg-type]
        forwards = -(-most // loader.batch_size)  # type: ignore[operator]
    if cfg.train.eval_batches:
        forwards = min(forwards, cfg.train.eval_batches)
    for batch in _padded(loader, forwards):
        if batch is None:  # this rank is out of samples; keep FSDP's collectives in step, count nothing
            x = job.eval_data[0][0].unsqueeze(0).to(rt.device)
            with autocast(cfg.train.precision, rt.device, sharded=job.sharded):
                module(x)
            continue
        x, y = (t.to(rt.device, non_blocking=True) for t in batch)
        with autocast(cfg.train.precision, rt.device, sharded=job.sharded):
            out = module(x)
        n = y.numel() if not y.is_floating_point() else y.shape[0]
        totals[0] += job.loss_fn(out, y).double() * n
        if y.is_floating_point() or out.shape[:-1] != y.shape:
            other += 1
        else:
            totals[1] += (out.argmax(-1) == y).sum()
        count += n
    module.train()
    totals = torch.cat([totals, torch.tensor([count, other], dtype=torch.float64, device=rt.device)])
    if rt.distributed:
        dist.all_reduce(totals)  # one collective: every rank gets the same sums, so the same metrics
    loss_sum, correct, count, other = totals.tolist()  # host-device sync: once per evaluation
    metrics = {"loss": loss_sum / max(count, 1.0), "count": count}
    if not other:  # accuracy only where every rank saw integer class targets
        metrics["accuracy"] = correct / max(count, 1.0)
        metrics["correct"] = correct
    return metrics


def _padded(loader: Any, forwards: int) -> Any:
    """The loader's batches, then None until ``forwards`` items were given."""
    given = 0
    for batch in loader:
        if given == forwards:
            return
        yield batch
        given += 1
    while given < forwards:
        yield None
        given += 1
