"""Where memory goes: model state counted from the live tensors, activations measured, peaks, and advice.

The four consumers of training memory on a rank are parameters, gradients, optimizer state (AdamW: two
tensors per parameter) and activations (what forward keeps for backward; grows with the batch). The first
three are counted here from the tensors that exist, as sharded on this rank (an FSDP parameter is a DTensor
whose local shard is what this rank holds). Activations are measured by running forward on a small batch
while a dispatch mode watches every tensor storage the step allocates and frees; what is still alive after
forward is what backward will need (saved tensors, activation-checkpointing caches, the output): exact for
the eager model at that batch size. (Tensors saved for backward, via saved_tensors_hooks, would miss what
selective checkpointing caches and count a view as its own tensor; live storages see both right.)
"""

from __future__ import annotations

import math
import os
import resource
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from scaletrain.batch import Batch, backward_scalar, logits_of, loss_logits, loss_of
from scaletrain.sharded import dtensor_class, local_shard

GB = 1e9

# The precision name the advice suggests (the trainer's train.precision value for bf16 autocast/FSDP policy).
BF16_MIXED = "bf16-mixed"


def fmt_bytes(n: float) -> str:
    """Bytes in the unit that reads best: 3.21 GB, 812 MB, 1.1 MB, 598 kB."""
    if abs(n) >= GB:
        return f"{n / GB:.2f} GB"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.0f} MB" if abs(n) >= 1e8 else f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.0f} kB"


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one rank: parameters, gradients, optimizer state, activations."""

    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    activations_bytes: int = 0

    @property
    def model_state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optim_bytes

    @property
    def total_bytes(self) -> int:
        return self.model_state_bytes + self.activations_bytes

    def largest(self, other: MemoryBreakdown) -> MemoryBreakdown:
        """Each part's larger of the two."""
        return MemoryBreakdown(max(self.params_bytes, other.params_bytes), max(self.grads_bytes, other.grads_bytes),
                               max(self.optim_bytes, other.optim_bytes),
                               max(self.activations_bytes, other.activations_bytes))

    def with_activations(self, activations_bytes: int) -> MemoryBreakdown:
        return MemoryBreakdown(self.params_bytes, self.grads_bytes, self.optim_bytes, activations_bytes)

    def as_dict(self) -> dict[str, int]:
        """The keys of metrics.jsonl's ``mem`` record (docs/metrics.md)."""
        return asdict(self)

    def describe(self) -> str:
        """params 0.50 GB + grads 0.50 GB + optimizer 1.00 GB + activations 3.20 GB = 5.20 GB"""
        return (f"params {fmt_bytes(self.params_bytes)} + grads {fmt_bytes(self.grads_bytes)} + optimizer "
                f"{fmt_bytes(self.optim_bytes)} + activations {fmt_bytes(self.activations_bytes)} = "
                f"{fmt_bytes(self.total_bytes)}")


# ---------------------------------------------------------------------------------------------- model state


def _storage_key(t: torch.Tensor) -> int:
    """One key per allocation: views, tied weights and DDP's gradient buckets share their storage."""
    return local_shard(t).untyped_storage()._cdata


def _unique_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (and not if already in ``seen``).

    Counting storages rather than elements includes FSDP's padding of each shard to an equal size, and counts
    a DDP gradient (a view into its bucket, gradient_as_bucket_view) as the bucket memory it really is.
    """
    total = 0
    for t in tensors:
        if t.is_sparse:  # a sparse gradient (nn.Embedding(sparse=True)) or SGD's buffer of one: its two parts
            total += _unique_bytes((t._indices(), t._values()), seen)
            continue
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            total += local_shard(t).untyped_storage().nbytes()
    return total


def model_state_bytes(module: nn.Module, optimizer: Optimizer | list[Optimizer] | None = None) -> MemoryBreakdown:
    """Parameters, gradients and optimizer state held by this rank, from the live tensors (activations 0)."""
    seen: set[int] = set()
    params = list(module.parameters())
    p_bytes = _unique_bytes(params, seen)
    g_bytes = _unique_bytes((p.grad for p in params if p.grad is not None), seen)
    optimizers = [] if optimizer is None else optimizer if isinstance(optimizer, list) else [optimizer]
    states = (v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    o_bytes = _unique_bytes(states, seen)
    return MemoryBreakdown(p_bytes, g_bytes, o_bytes)


OPTIM_STATES = {"adamw": 2, "adam": 2, "sgd": 1}  # state tensors per parameter (sgd: momentum buffer)


def estimate_model_state(module: nn.Module, optimizer: str, *, shard: int = 1) -> MemoryBreakdown:
    """Model state before training has made it: gradients as large as the parameters, and ``optimizer``'s
    per-parameter state tensors (AdamW 2, SGD with momentum 1), divided over ``shard`` ranks."""
    seen: set[int] = set()
    p_bytes = _unique_bytes(module.parameters(), seen)
    trainable = _unique_bytes((p for p in module.parameters() if p.requires_grad), set())
    k = OPTIM_STATES.get(optimizer, 2)
    return MemoryBreakdown(math.ceil(p_bytes / shard), math.ceil(trainable / shard),
                           math.ceil(k * trainable / shard))


# ---------------------------------------------------------------------------------------------- peaks


def peak_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on a GPU, peak resident set size on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, Linux KiB


def reset_peak(device: torch.device) -> None:
    """Start a new CUDA peak (a CPU's peak RSS is a high-water mark for the process's life: it cannot)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_capacity_bytes(device: torch.device, ranks_on_host: int = 1) -> int:
    """What one rank may use: the GPU's memory, or on a CPU the host's RAM divided by the ranks sharing it."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(ram // max(ranks_on_host, 1))


# ---------------------------------------------------------------------------------------------- activations


class LiveBytes(TorchDispatchMode):
    """Watches every storage an op allocates under this mode: ``current`` live bytes and their ``peak``.

    Storages that existed before (parameters, inputs: pass them as ``existing``) are not counted; a storage is
    counted from the op that first returns it until Python frees it (a weakref finalizer). ``trace``: also keep
    ``rises``, (op, live bytes after it) for every op that allocated, the only moments a peak can come.
    """

    def __init__(self, existing: Iterable[torch.Tensor] = (), *, trace: bool = False) -> None:
        super().__init__()
        self._skip = {_storage_key(t) for t in existing}
        self._dtensor = dtensor_class()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.rises: list[tuple[Any, int]] | None = [] if trace else None

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        before = self.current
        for t in tree_flatten(out)[0]:
            if isinstance(t, self._dtensor):  # a tensor-parallel op's result: its local shard is this rank's memory
                t = t._local_tensor  # to_local() without its autograd node: 2.3 s of the 405B plan's 14.7
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self._skip or key in self._live:
                    continue
                self._live[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        if self.rises is not None and self.current > before:
            self.rises.append((func, self.current))
        return out


def default_loss(output: Any, target: Any = None) -> torch.Tensor:
    """The memory a cross-entropy loss holds (scaletrain's default loss), against class 0 (``target`` unused: a
    sample measured may have none, and a class's value does not change the bytes); a model that computes its own
    loss, or returns no logits, is measured from its own outputs."""
    logits = logits_of(output)
    if loss_of(output) is not None or logits is None:
        return backward_scalar(output)
    logits = loss_logits(logits).reshape(-1, logits.shape[-1])
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))


AUTOCAST_DTYPE = {"bf16-mixed": torch.bfloat16, "bf16": torch.bfloat16, "fp16-mixed": torch.float16,
                  "fp16": torch.float16}


@dataclass(frozen=True)
class StepMemory:
    activations_bytes: int  # live after forward and loss: what backward will consume
    peak_bytes: int  # most bytes live at once over forward and backward (gradients included)
    rises: tuple[tuple[Any, int], ...] = ()  # with measure_step's trace: LiveBytes.rises


Line = tuple[int, int]  # (a, s): a + s x batch bytes


class StepCurve:
    """A step's memory as a function of its batch size b, from the step measured at two batch sizes.

    What forward keeps is one moment of the step, a + s b. The peak is not: it is the highest of the moments,
    each its own line in b (the same ops allocate in the same order at every batch, some of a size that grows
    with it, some not), so it is the upper envelope of those lines. The one line through the two measured peaks
    was 2.4x low at batch 8 for timm's ConvNeXt-T under bf16 autocast with full checkpointing: at batch 1 and 2
    the peak is where autocast's bf16 copies of the weights live (no batch in them), beyond it where a
    recomputed stage's activations do.

    ``lines``: the lines, as (kept, peak envelope), or a function that measures them, called the first time a
    batch beyond the ``measured`` ones is asked: where batch 1 runs other ops than batch 2 (a dimension of size
    1 spares a copy: timm's ViT and ConvNeXt, Llama's pipeline stages), the lines come from batch 2 and 3,
    and a plan that asks for batch 1 and 2 only (a pipeline's micro-batch of one) does not pay for batch 3."""

    def __init__(self, lines: tuple[Line, tuple[Line, ...]] | Callable[[], tuple[Line, tuple[Line, ...]]],
                 measured: dict[int, StepMemory] | None = None) -> None:
        self._lines = lines
        self.measured = measured or {}

    def lines(self) -> tuple[Line, tuple[Line, ...]]:
        if callable(self._lines):
            self._lines = self._lines()  # measured once; the model and sample it held are let go
        return self._lines

    def at(self, batch_size: int) -> StepMemory:
        if batch_size in self.measured:
            one = self.measured[batch_size]
            return StepMemory(one.activations_bytes, one.peak_bytes)
        (a, s), peak = self.lines()
        return StepMemory(max(a + s * batch_size, 0), max((a + s * batch_size for a, s in peak), default=0))


def _line(b: int, at_b: int, at_next: int) -> Line:
    """The line through ``at_b`` at batch ``b`` and ``at_next`` at batch b + 1."""
    return at_b - b * (at_next - at_b), at_next - at_b


def _envelope(lines: Iterable[Line]) -> tuple[Line, ...]:
    """The lines that are the highest of ``lines`` somewhere at batch >= 1, by slope (their upper hull)."""
    best: dict[int, int] = {}
    for a, s in lines:
        best[s] = max(best.get(s, a), a)
    hull: list[Line] = []
    for s3 in sorted(best):
        a3 = best[s3]
        # the last line is never the highest if the new one overtakes the one before it no later than it does
        while len(hull) >= 2 and (hull[-2][0] - a3) * (hull[-1][1] - hull[-2][1]) <= \
                (hull[-2][0] - hull[-1][0]) * (s3 - hull[-2][1]):
            hull.pop()
        hull.append((a3, s3))
    while len(hull) >= 2 and sum(hull[1]) >= sum(hull[0]):  # overtaken by batch 1 already
        hull.pop(0)
    return tuple(hull)


def measure_step(model: nn.Module, inputs: torch.Tensor | Batch, *, precision: str = "fp32",
                 loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss,
                 backward: bool = False, grads_allocated: bool = False, trace: bool = False) -> StepMemory:
    """One forward (and, with ``backward``, a backward) of ``model`` on ``inputs`` (a batched input tensor
    or a Batch), measured by LiveBytes.

    ``grads_allocated``: give every parameter a zero gradient first, as DDP's bucket views keep them between
    steps, so backward adds into it and the peak counts only backward's temporaries, not the gradients.
    The model's gradients, RNG and buffers are left as they were, so measuring does not change training.
    ``trace``: the StepMemory's ``rises`` too (LiveBytes). ``loss_fn(output, target)``: the loss backward
    starts from, given the batch's target (None for a bare input): a user's loss holds its own temporaries.
    """
    params = list(model.parameters())
    buffers = [b.detach().clone() for b in model.buffers()]
    grads = [p.grad for p in params]
    for p in params:  # a measured backward must not add into the training's gradients
        p.grad = torch.zeros_like(p) if grads_allocated else None
    batch = inputs if isinstance(inputs, Batch) else Batch((inputs,), {}, None)
    existing = [*params, *(p.grad for p in params if p.grad is not None), *model.buffers(), *batch.tensors()]
    dtype = AUTOCAST_DTYPE.get(precision)
    device = next(batch.tensors()).device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        tracker = LiveBytes(existing, trace=trace)
        with tracker:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(batch(model), batch.target)
            retained = tracker.current
            if backward:
                loss.backward()
        del loss
    for p, g in zip(params, grads):
        p.grad = g
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    return StepMemory(retained, tracker.peak, tuple(tracker.rises or ()))


def estimate_activation_bytes(model: nn.Module, sample: torch.Tensor | Batch, batch_size: int, *,
                              precision: str = "fp32",
                              loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss,
                              whole_step: bool = False) -> int:
    """Activation bytes of one micro-batch of ``batch_size`` copies of ``sample`` (one input with no batch
    dim, or a Batch of one sample).

    Measured (measure_step) at batch 1 and 2; activations are a + b x batch (a: what does not grow with the
    batch, e.g. weights cast to bf16 and kept for backward), so the two points give the estimate at any batch
    without running it. Run it on the real device: attention kernels there decide what is kept.
    ``whole_step``: instead of what forward keeps, the step's peak beyond the model state (forward and
    backward, gradients allocated beforehand): what the planner adds to the model state.
    """
    if whole_step:
        return estimate_step(model, sample, batch_size, precision=precision, loss_fn=loss_fn).peak_bytes

    def at(b: int) -> int:
        return measure_step(model, _batch_of(sample, b), precision=precision, loss_fn=loss_fn).activations_bytes

    return _extrapolated(at(1), at(2), batch_size)


def estimate_step(model: nn.Module, sample: torch.Tensor | Batch, batch_size: int, *, precision: str = "fp32",
                  loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss) -> StepMemory:
    """Both figures of estimate_activation_bytes (what forward keeps, and with ``whole_step`` the step's peak)
    from one measured forward and backward per batch size: the gradients allocated beforehand are not
    forward's, so what it keeps is the same as a forward-only measurement's, and the planner, which wants
    both, measures each step once instead of twice."""
    return step_points(model, sample, precision=precision, loss_fn=loss_fn).at(batch_size)


def step_points(model: nn.Module, sample: torch.Tensor | Batch, *, precision: str = "fp32",
                loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss) -> StepCurve:
    """estimate_step's StepCurve, from a forward and backward at batch 1 and at batch 2, and, where batch 1 ran
    other ops than batch 2, at batch 3 once a larger batch is asked (the planner keeps the curve: a config
    planned again at another micro-batch is the same steps). Should the two steps the lines come from not
    allocate with the same ops in the same order (a model whose work depends on the batch's size), the peak is
    the one line through their two peaks."""

    def step(b: int) -> StepMemory:
        return measure_step(model, _batch_of(sample, b), precision=precision, loss_fn=loss_fn, backward=True,
                            grads_allocated=True, trace=True)

    first, second = step(1), step(2)
    if _same_ops(first, second):
        return StepCurve(_lines(1, first, second))
    return StepCurve(lambda: _lines(2, second, step(3)), {1: first, 2: second})


def _same_ops(one: StepMemory, two: StepMemory) -> bool:
    return len(one.rises) == len(two.rises) and all(f == g for (f, _), (g, _) in zip(one.rises, two.rises))


def _lines(b: int, one: StepMemory, two: StepMemory) -> tuple[Line, tuple[Line, ...]]:
    """StepCurve's lines from the steps at batch ``b`` (``one``) and b + 1 (``two``)."""
    if _same_ops(one, two):
        moments: Iterable[tuple[int, int]] = zip((n for _, n in one.rises), (n for _, n in two.rises))
    else:
        moments = ((one.peak_bytes, two.peak_bytes),)
    return _line(b, one.activations_bytes, two.activations_bytes), _envelope(_line(b, *m) for m in moments)


def _batch_of(sample: torch.Tensor | Batch, b: int) -> torch.Tensor | Batch:
    """``b`` copies of one sample (an input with no batch dim, or a Batch of one)."""
    return sample.repeat(b) if isinstance(sample, Batch) else sample.unsqueeze(0).expand(b, *sample.shape).contiguous()


def _extrapolated(one: int, two: int, batch_size: int) -> int:
    """a + b x batch through the figures measured at batch 1 and 2."""
    return max(one + (two - one) * (batch_size - 1), 0)


# ---------------------------------------------------------------------------------------------- decisions


# The share of a device kept free when deciding what fits (auto, the planner): allocator fragmentation, the
# CUDA context, cuBLAS workspaces, communication buffers and temporaries.
FIT_MARGIN = 0.2


def choose_strategy(replica: MemoryBreakdown, capacity_bytes: int, *, world_size: int, nnodes: int = 1,
                    margin: float = FIT_MARGIN) -> tuple[str, str]:
    """ddp | fsdp | hsdp for ``--parallel.strategy=auto``, and a one-line reason with the numbers.

    ``replica``: one rank's memory without sharding (model state of the whole model, one micro-batch of
    activations). DDP when it fits in (1 - margin) x capacity; the margin leaves room for the allocator's
    fragmentation, the CUDA context, communication buffers and temporaries. Else shard the model state:
    HSDP (within each machine) when that fits and there are several machines, else FSDP over all ranks.
    """
    usable = int(capacity_bytes * (1 - margin))
    budget = f"{1 - margin:.0%} of {fmt_bytes(capacity_bytes)}"
    fits = replica.total_bytes <= usable
    if world_size == 1:
        verdict = "fits in" if fits else "does NOT fit in"
        return "ddp", (f"auto -> ddp: one rank, nothing to shard across; {replica.describe()} {verdict} "
                       f"{budget}")
    if fits:
        return "ddp", f"auto -> ddp: a full replica ({replica.describe()}) fits in {budget}"
    state, act = replica.model_state_bytes, replica.activations_bytes
    head = f"a full replica ({replica.describe()}) exceeds {budget}"
    per_node = world_size // max(nnodes, 1)
    if nnodes > 1 and per_node > 1 and state / per_node + act <= usable:
        need = state / per_node + act
        return "hsdp", (f"auto -> hsdp: {head}; model state sharded over the {per_node} ranks of a machine: "
                        f"{fmt_bytes(state)} / {per_node} + activations {fmt_bytes(act)} = {fmt_bytes(need)}")
    need = state / world_size + act
    still = "" if need <= usable else f" -- still over {budget}: see the out-of-memory advice"
    return "fsdp", (f"auto -> fsdp: {head}; model state sharded over {world_size} ranks: {fmt_bytes(state)} "
                    f"/ {world_size} + activations {fmt_bytes(act)} = {fmt_bytes(need)}{still}")


def oom_advice(breakdown: MemoryBreakdown, *, capacity_bytes: int, strategy: str, world_size: int,
               batch_size: int, accum_steps: int, activation_checkpointing: str = "none",
               precision: str = "fp32", margin: float = 0.1) -> str:
    """What to change when a rank ran out of memory: the breakdown, then fixes with their flags and numbers,
    the largest saving first."""
    usable = capacity_bytes * (1 - margin)
    state, act = breakdown.model_state_bytes, breakdown.activations_bytes
    fixes: list[tuple[float, str]] = []  # (bytes saved, line)
    if act > 0 and activation_checkpointing != "full":
        # 0.8: a sort key only; full checkpointing kept 7% of the GPT's activations in
        # tests/unit/test_memory_checkpointing.py.
        text = ("--memory.activation_checkpointing=full: each block keeps only its input and recomputes the "
                f"rest in backward (activations {fmt_bytes(act)} shrink to about one block's; ~33% more "
                "compute)")
        fixes.append((0.8 * act, text))
    if act > 0 and batch_size > 1:
        fits = [k for k in (2, 4, 8, 16, 32, 64) if batch_size % k == 0 and state + act / k <= usable]
        k = fits[0] if fits else (2 if batch_size % 2 == 0 else batch_size)
        total = batch_size * world_size * accum_steps
        text = (f"--data.batch_size={batch_size // k} --train.accum_steps={accum_steps * k}: the same global "
                f"batch {total}, activations {fmt_bytes(act)} -> {fmt_bytes(act / k)}")
        fixes.append((act - act / k, text))
    if strategy == "ddp" and world_size > 1:
        text = (f"--parallel.strategy=fsdp: model state {fmt_bytes(state)} -> "
                f"{fmt_bytes(state / world_size)} per rank, sharded over {world_size} ranks")
        fixes.append((state - state / world_size, text))
    if strategy in ("fsdp", "hsdp") and state > 0:
        text = ("--memory.cpu_offload=true: sharded parameters, gradients and optimizer state in host memory "
                f"({fmt_bytes(state)} off the device; the optimizer step runs on the CPU)")
        fixes.append((state, text))
    if precision == "fp32" and act > 0:
        text = (f"--train.precision={BF16_MIXED}: activations in bf16, about half ({fmt_bytes(act)} -> "
                f"{fmt_bytes(act / 2)})")
        fixes.append((act / 2, text))
    if not fixes:
        fixes.append((0.0, "a smaller model, or more devices to shard over"))
    lines = [f"memory per rank: {breakdown.describe()}; device {fmt_bytes(capacity_bytes)}",
             "fixes, the largest saving first:"]
    return "\n".join(lines + [f"  - {text}" for _, text in sorted(fixes, key=lambda f: -f[0])])
