"""Evaluation on the held-out split, aggregated exactly across ranks."""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset

from scaletrain import runtime
from scaletrain.batch import IGNORE_INDEX, Batch, aligned, describe, leaves, logits_of, loss_of
from scaletrain.data import eval_indices, eval_loader
from scaletrain.data.loader import StreamLoader
from scaletrain.errors import UserError, said_of
from scaletrain.sharded import is_dtensor, loss_context, plain
from scaletrain.train.job import Job
from scaletrain.train.precision import autocast, policy_casts


@torch.no_grad()
def evaluate(job: Job) -> dict[str, float]:
    """Mean loss and (for integer class targets) accuracy over the held-out split.

    Each rank sums loss x count, correct and count over its own samples; one all-reduce adds the sums, so
    the result is sum(correct) / sum(count) over the whole split: no mean of means, no sample twice.
    Accuracy is exact at any world size; the loss agrees to float32 rounding (batch means are float32).
    Runs on the bare module: DDP's forward is not needed without gradients, and ranks may see one sample
    more or less than each other. Under FSDP the module's forward is collective, so a rank with fewer
    batches runs uncounted forwards until every rank has run as many. The ranks of a tensor-parallel group
    evaluate the same samples together (their forward is collective too); the group's first rank counts them.
    Pipeline stages pass each whole batch on (PipelineRunner.forward: any batch size); the last stage counts.
    """
    cfg, rt, module, layout = job.cfg, job.rt, job.module, job.layout
    assert job.eval_data is not None
    batch_size = cfg.data.eval_batch_size or cfg.data.batch_size
    rank, world = layout.dp_rank(rt.rank), layout.dp_size  # the data-parallel readers
    if job.eval_loader is None and isinstance(job.eval_data, IterableDataset):  # read whole at every evaluation
        job.eval_loader = StreamLoader(job.eval_data, batch_size=batch_size, rank=rank, world=world, accum=1,
                                       pin_memory=rt.device.type == "cuda", collate_fn=job.collate_fn)
    elif job.eval_loader is None:  # the same samples every time: one loader, its workers kept between evaluations
        job.eval_loader = eval_loader(job.eval_data, batch_size=batch_size, rank=rank, world=world,
                                      num_workers=cfg.data.num_workers, pin_memory=rt.device.type == "cuda",
                                      max_batches=cfg.train.eval_batches, collate_fn=job.collate_fn,
                                      worker_init_fn=job.worker_init_fn, seed=cfg.run.seed)
        if job.st is not None:
            job.st.held_loaders.append(job.eval_loader)
    loader = job.eval_loader
    if isinstance(loader, StreamLoader):  # as many items on every rank (None: an empty share), eval_batches first
        passed = loader.whole_pass(pad=True)
        batches = itertools.islice(passed, cfg.train.eval_batches) if cfg.train.eval_batches else passed
    elif job.sharded:
        # FSDP's forward is collective (it all-gathers parameters): every rank must run the same number of
        # forwards, though one rank may hold one sample more. The extra forwards are not counted.
        chosen = eval_indices(len(job.eval_data), batch_size=batch_size, world=world,  # type: ignore[arg-type]
                              max_batches=cfg.train.eval_batches)
        batches = _padded(loader, -(-len(chosen[::world]) // batch_size))  # rank 0's share is the largest
    else:
        batches = iter(loader)
    module.eval()
    with _rank0_buffers(job):
        totals = _evaluated(job, batches)
    module.train()
    if not layout.counts_eval(rt.rank):
        totals.zero_()  # counted by its group's first rank
    if rt.distributed:
        dist.all_reduce(totals)  # one collective: every rank gets the same sums, so the same metrics
    loss_sum, correct, count, other, *own = totals.tolist()  # host-device sync: once per evaluation
    metrics = {"loss": loss_sum / max(count, 1.0), "count": count}
    if not other:  # accuracy only where every batch of every rank had class targets for the logits
        metrics["accuracy"] = correct / max(count, 1.0)
        metrics["correct"] = correct
    for name, total, n in zip(job.metrics, own[::2], own[1::2]):
        metrics[name] = total / n if n else math.nan
    return metrics


@contextlib.contextmanager
def _rank0_buffers(job: Job) -> Iterator[None]:
    """Within: every data-parallel rank holds rank 0's running statistics (BatchNorm's, InstanceNorm's), its own
    back after. Between steps a rank's are those of its own batches (DDP hands out rank 0's only at the next
    forward; FSDP never), so each rank evaluated its share with other statistics than model.safetensors has
    (rank 0's), and the summary's held-out loss was not the saved model's. One broadcast per dtype."""
    rt, layout = job.rt, job.layout
    buffers = [b for m in job.module.modules() if isinstance(m, nn.modules.batchnorm._NormBase)
               for b in m.buffers(recurse=False) if b.is_floating_point() and not is_dtensor(b)]
    if not rt.distributed or not buffers or layout.tp > 1 or layout.pp > 1:
        yield
        return
    saved = [b.detach().clone() for b in buffers]
    with torch.no_grad():
        for b, rank0s in zip(buffers, runtime.rank0_values(buffers)):
            b.copy_(rank0s)
    try:
        yield
    finally:
        with torch.no_grad():
            for b, own in zip(buffers, saved):
                b.copy_(own)


def _evaluated(job: Job, batches: Iterator[Any]) -> torch.Tensor:
    """This rank's (loss x count, correct, count, no-accuracy) sums over its share of the held-out split, then
    (sum, count) of each of fit()'s metrics' values. A None in ``batches``: this rank is out of samples, and
    runs an uncounted forward (of the first training sample) to keep FSDP's collectives in step."""
    cfg, rt, module = job.cfg, job.rt, job.module
    policy = job.model is not None and policy_casts(job.model)
    totals = torch.zeros(4 + 2 * len(job.metrics), dtype=torch.float64, device=rt.device)
    for i, raw in enumerate(batches):
        if raw is None:
            assert job.first is not None
            batch = job.first.to(rt.device)
        else:
            batch = job.batcher(raw).to(rt.device)
        with autocast(cfg.train.precision, rt.device, policy=policy), loss_context(module):
            try:
                out = batch(module) if job.pipeline is None else job.pipeline.forward(batch.pipeline_inputs())
            except RuntimeError as err:
                if i == 0 and raw is not None:
                    _check_layout(job.first, batch, err)
                raise
            if raw is None or out is None:  # padding, or a pipeline stage before the last
                continue
            try:
                loss = plain(job.loss_fn(out, batch.target))
            except Exception as err:
                if i == 0 and job.user_loss and not isinstance(err, UserError):
                    raise _eval_output(job, out, err) from err
                raise
            totals[:4] += _sums(out, batch, loss, shift=_shift(job, out))
            if job.metrics:
                totals[4:] += _metric_sums(job, out, batch.target, batch.size())
    return totals


def _check_layout(first: Batch | None, batch: Batch, err: RuntimeError) -> None:
    """A UserError where the model's forward failed on the first held-out batch, which training's first sample
    passed, and the held-out inputs are laid out otherwise (another feature count, dtype or number of inputs):
    eval_data built another way than train_data, found at the evaluation before step 1. Else the error is the
    model's own, traceback and all."""
    def layout(b: Batch) -> list[str]:
        return [f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape[1:])}" for t in leaves((b.args, b.kwargs))]

    if first is None or layout(first) == layout(batch):
        return
    raise UserError(f"eval_data: the model's forward failed on the first held-out batch ({said_of(err)}): its "
                    f"inputs are {', '.join(layout(batch)) or 'none'} per sample, and the training samples' "
                    f"{', '.join(layout(first)) or 'none'}; fix: give eval_data the training data's layout (the same "
                    "features, inputs and dtypes)") from err


def _eval_output(job: Job, out: Any, err: Exception) -> UserError:
    """The user's loss_fn, which took the training output, failing on the first held-out batch's: the model's
    output in eval mode is another kind (torchvision's detection models return their predictions there, a
    loss only in training): one line naming it and the way to train without evaluation."""
    name = getattr(job.loss_fn, "__name__", "loss_fn")
    return UserError(f"loss_fn: {name} failed on the first held-out batch ({type(err).__name__}: {said_of(err)}), "
                     f"whose output from the model in eval mode is {describe(out)}; the held-out loss is "
                     "loss_fn(output, target) in eval mode, where some models return their predictions instead "
                     "(torchvision's detection models); fix: data.val_fraction=0 and no eval_data to train without "
                     "evaluation, or a loss_fn that takes the eval-mode output too")


def _metric_sums(job: Job, out: Any, target: Any, samples: int) -> torch.Tensor:
    """(sum, count) of each of fit()'s metrics' values on one batch of ``samples``, on the device. A metric that
    returns one number (a 0-dim tensor: the batch's mean, as torchmetrics-style code and Lightning's self.log
    return it) counts for each of the batch's samples, as Lightning weighs a logged batch mean: the split's mean
    of per-sample values is then exact whatever the batches, where a plain mean of batch means weighs the last,
    smaller batch (and each rank's) as a whole one."""
    whole = plain(out)  # logits split by vocabulary: whole
    sums = []
    for name, fn in job.metrics.items():
        values = fn(whole, target)
        if not isinstance(values, torch.Tensor):
            raise UserError(f"fit(metrics={{{name!r}: ...}}) returned a {type(values).__name__}; expected a tensor "
                            "of per-sample values (their mean over the held-out split is the metric); fix: return "
                            "a tensor, e.g. (out.argmax(-1) == y).float()")
        values = plain(values).detach().double()
        weight = samples if values.dim() == 0 else 1
        sums += [values.sum() * weight, torch.tensor(float(values.numel() * weight), dtype=torch.float64,
                                                     device=values.device)]
    return torch.stack(sums).to(job.rt.device)


def _shift(job: Job, out: Any) -> int | None:
    """How the loss lines sequence logits up with their targets (batch.label_shift): scaletrain's own
    cross-entropy position for position (0), a pipeline's shifted one (1), else what the first training
    sample's output showed of the model's own loss or the user's loss_fn (None: unknown)."""
    if job.shifted:
        return 1
    if not job.user_loss and loss_of(out) is None:
        return 0
    return job.label_shift


def _sums(out: Any, batch: Batch, loss: torch.Tensor, *, shift: int | None = 0) -> torch.Tensor:
    """(loss x count, correct, count, 1 if accuracy cannot be counted) of one batch, on the device.

    count: the targets the loss averages over (class targets other than -100, as cross-entropy counts them;
    with ``shift`` 1, those from the second position on, as a causal LM's own loss counts them), else the
    batch's samples. Accuracy needs integer class targets of the logits' shape, and either one class per sample
    or a known ``shift`` between the logits and the targets (_shift): argmax at position t against target t +
    shift. A loss over a sequence that matched neither alignment (label smoothing, weights) gets none: ~0%
    for a model that predicts every next token would be wrong, and so was 93% for an untrained GPT-2 whose
    tied embedding predicts the current one.
    """
    y, logits = batch.target, logits_of(out)
    if is_dtensor(logits):  # split by vocabulary (loss parallel): whole for the argmax, at evaluation only
        logits = logits.full_tensor()
    classes = isinstance(y, torch.Tensor) and not y.is_floating_point() and logits is not None \
        and logits.shape[:-1] == y.shape and (shift is not None or y.dim() == 1)
    if classes and shift and y.dim() >= 2:  # position t predicts target t + shift
        logits, y = aligned(logits, y, shift)
    if isinstance(y, torch.Tensor) and not y.is_floating_point():
        valid = y != IGNORE_INDEX
        n = valid.sum().double()
    else:
        valid, n = None, torch.tensor(float(batch.size()), dtype=torch.float64, device=loss.device)
    correct = ((logits.argmax(-1) == y) & valid).sum().double() if classes and valid is not None else n * 0
    return torch.stack([loss.double() * n, correct, n, n * 0 + (0.0 if classes else 1.0)])


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
