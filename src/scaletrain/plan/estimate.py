"""A plan before a run: memory per GPU for each layout, the step's time and the run's cost, and a choice.

Memory. The model is built from the config on fake tensors (torch's FakeTensorMode: shapes, dtypes and
storages, no data); a GPT's steps are measured at 3 and 4 blocks and extrapolated to its depth (its blocks
are identical), so a 6.7B-parameter GPT is planned in a few seconds on a 2-core CPU. Model state is counted
from its parameters: fp32 parameters and gradients and the optimizer's state tensors (AdamW 2 per parameter),
divided over the ranks that shard them (FSDP: all; HSDP: the GPUs of one machine; DDP: none). The rest of
the peak ("activations": what forward keeps for backward, the loss, backward's temporaries, and under
checkpointing the recomputed block) is measured, not guessed: one forward and backward at batch 1 and 2
under observe.memory.LiveBytes on the fake tensors, the gradients allocated beforehand as DDP keeps them
(tests/unit/test_plan.py: the same bytes as a real step), then at the per-rank batch (observe.memory.StepCurve:
what forward keeps a + b x batch, the peak the highest of the step's moments, each such a line). In mixed
precision it is measured as DDP runs (autocast keeps a compute-dtype copy of each weight for backward) and
as FSDP runs (parameters all-gathered in the compute dtype: no copies). FSDP adds its working set: two units
all-gathered in the compute dtype (the one computing and the one prefetched) and one unit's unsharded fp32
gradients before their reduce-scatter. A layout fits when its total is within 80% of the device
(choose_strategy's margin: the CUDA context, cuBLAS workspaces, the allocator's rounding and communication
buffers). Sizes come from the CPU's kernels: on a GPU, flash/cuDNN attention keeps the same or less.

Time. compute = training FLOPs per step / (GPUs x peak x MFU), at the peak of the format the matmuls run in
(bf16/fp16 in the mixed modes; an fp32 run at the TF32 rate when train.tf32 is on, else at the fp32 rate);
the FLOPs are the model's, as MFU counts them, and the MFU given is a run's without recompute: under full
checkpointing the GPU also recomputes one forward (a third more work at the same hardware utilization), so its
MFU is 3/4 of the given one. MFU is an assumption the user can change (--mfu; default 0.40: this project measured 48-52% for tuned GPT benchmarks and 25-30% through
the eager trainer, benchmarks/RESULTS.md 5b). Communication per optimizer step, the bytes each GPU sends over
the ring algorithms at the link rate: DDP one all-reduce of the fp32 gradients (2 (n-1)/n x G); FSDP two
all-gathers of the parameters in the compute dtype per micro-step (forward, and backward after resharding) and
one reduce-scatter of the fp32 gradients per step ((n-1)/n each); HSDP those within a machine plus an
all-reduce of one shard's gradients across machines. A collective spanning machines runs at the slower of the
two links. The step is max(compute, communication): both overlap
fully at best, so a plan's step time is a lower bound, and "communication-bound" says the links set it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from scaletrain.batch import Batch
from scaletrain.config import Config
from scaletrain.observe.memory import (
    AUTOCAST_DTYPE,
    FIT_MARGIN,
    OPTIM_STATES,
    StepCurve,
    default_loss,
    fmt_bytes,
    step_points,
)
from scaletrain.plan.catalog import Accelerator

AC_PLANNED = ("none", "full")  # the data-parallel table's columns
AC_SEARCHED = ("none", "selective", "full")  # the dp x tp x pp layouts' rows
# Compute per step over the model's FLOPs, by activation checkpointing: full recomputes each block's forward (a
# third of the step's matmuls); selective (parallel/activation_checkpoint.py, torchtitan's op-level policy)
# every second matmul of it, half that, and the pointwise ops, which are next to free; attention is saved.
RECOMPUTE = {"none": 1.0, "selective": 7 / 6, "full": 4 / 3}


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs of a model, measured once on fake tensors."""

    params: int  # parameter elements (a tied parameter once)
    trainable: int  # of which trainable
    largest_unit: int  # parameter elements of the largest FSDP unit (a block), or of the model without blocks
    units: int  # blocks (1 for a model without blocks)
    flops_per_sample: float  # training FLOPs of one sample (forward and backward), as MFU counts them
    tokens_per_sample: int  # 0 for a model that does not read tokens
    activations: dict[str, int]  # AC mode (DDP) or "sharded-" + mode (FSDP) -> step peak beyond model state
    # the same keys -> what one more block adds to ``activations`` (a GPT or Llama: measured at 3 and 4 blocks;
    # empty until measured), which tensor and pipeline parallelism divide (plan/parallel.py)
    block_activations: dict[str, int] = field(default_factory=dict, compare=False)  # a by-product, not a fact
    # the same keys -> what one more block keeps from forward until its backward (the step's peak may not grow
    # by a block's: under checkpointing it comes at the end, after the blocks' backward): what each further
    # micro-batch a pipeline stage holds in flight costs per block (plan/parallel.py)
    block_kept: dict[str, int] = field(default_factory=dict, compare=False)
    # what forward keeps outside the blocks (the head's logits and the loss's): per micro-batch in flight on
    # the last pipeline stage (GPipe holds all of them)
    rest_kept: dict[str, int] = field(default_factory=dict, compare=False)
    kept: dict[str, int] = field(default_factory=dict, compare=False)  # the whole model's, where measured
    # tp -> the same keys -> (one block's, the rest's, one block's kept, the rest's kept) activations on a rank of a tp-way
    # tensor-parallel step, measured on that step itself (with_tp_activations); a tp missing is planned by
    # Korthikanti's ratio
    tp_activations: dict[int, dict[str, tuple[int, int, int, int]]] = field(default_factory=dict, compare=False)

    def scaled(self, ratio: Callable[[str], float]) -> ModelFacts:
        """These facts with every activation figure of key k (activations, per block, kept) times ratio(k): the
        compiled ratios, or --calibrate's correction."""
        def times(d: dict[str, int]) -> dict[str, int]:
            return {k: round(v * ratio(k)) for k, v in d.items()}

        return replace(self, activations=times(self.activations), block_activations=times(self.block_activations),
                       block_kept=times(self.block_kept), rest_kept=times(self.rest_kept))


class PerGpuBytes:
    """The memory of a planned layout per GPU, summed (its dataclass has the five fields)."""

    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    activations_bytes: int
    fsdp_buffers_bytes: int

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optim_bytes + self.activations_bytes
                + self.fsdp_buffers_bytes)


@dataclass(frozen=True)
class Layout(PerGpuBytes):
    strategy: str  # ddp | fsdp | hsdp
    checkpointing: str  # none | full
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    activations_bytes: int
    fsdp_buffers_bytes: int
    compute_s: float
    comm_s: float
    fits: bool

    @property
    def step_s(self) -> float:
        return max(self.compute_s, self.comm_s)

    def efficiency_for(self, step_mfu: float) -> float:
        """The compute efficiency (the fraction of peak the GPUs run at while computing, recompute included)
        at which this layout, planned at efficiency 1, runs whole steps at ``step_mfu`` as summary.json and
        published runs count MFU (the model's FLOPs over the step's wall time): full checkpointing's recompute
        taken out. At most 1; a communication-bound layout stays below ``step_mfu`` at any efficiency."""
        return min(1.0, self.compute_s * step_mfu / self._at_peak)

    def mfu_at(self, efficiency: float) -> float:
        """The whole-step MFU of this layout, planned at efficiency 1, when its GPUs compute at ``efficiency``."""
        return self._at_peak / max(self.compute_s / efficiency, self.comm_s)

    @property
    def _at_peak(self) -> float:  # the model's FLOPs per step at peak, as MFU counts them (no recompute)
        return self.compute_s / RECOMPUTE[self.checkpointing]

    @property
    def bound(self) -> str:
        return "communication" if self.comm_s > self.compute_s else "compute"


@dataclass
class Plan:
    accelerator: Accelerator
    gpus_per_node: int
    nodes: int
    precision: str
    tf32: bool
    batch_size: int
    accum_steps: int
    total_steps: int
    mfu: float
    net_bytes_per_s: float
    price_per_gpu_hour: float | None
    facts: ModelFacts
    layouts: list[Layout] = field(default_factory=list)
    choice: Layout | None = None
    reason: str = ""

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.accelerator)

    @property
    def peak(self) -> float:
        """FLOP/s the compute time is planned against (at MFU 1)."""
        return self.accelerator.peak(self.precision, tf32=self.tf32)

    def run_hours(self, layout: Layout) -> float:
        return self.total_steps * layout.step_s / 3600

    def cost(self, layout: Layout) -> float | None:
        if self.price_per_gpu_hour is None:
            return None
        return self.run_hours(layout) * self.world * self.price_per_gpu_hour

    def as_dict(self) -> dict[str, Any]:
        rows = []
        for lay in self.layouts:
            row = asdict(lay)
            row.update(total_bytes=lay.total_bytes, step_s=lay.step_s, bound=lay.bound,
                       run_hours=self.run_hours(lay), cost=self.cost(lay))
            rows.append(row)
        return {"accelerator": asdict(self.accelerator), "gpus_per_node": self.gpus_per_node,
                "nodes": self.nodes, "world_size": self.world, "precision": self.precision,
                "batch_size": self.batch_size, "accum_steps": self.accum_steps,
                "global_batch": self.batch_size * self.world * self.accum_steps, "total_steps": self.total_steps,
                "mfu_assumed": self.mfu, "net_bytes_per_s": self.net_bytes_per_s,
                "price_per_gpu_hour": self.price_per_gpu_hour, "usable_bytes": self.usable_bytes,
                "model": asdict(self.facts), "layouts": rows,
                "choice": None if self.choice is None else
                {"strategy": self.choice.strategy, "checkpointing": self.choice.checkpointing},
                "reason": self.reason}


def steps_for_tokens(tokens: int, global_batch: int, tokens_per_sample: int) -> int:
    """Optimizer steps that read at least ``tokens`` tokens at ``global_batch`` samples of
    ``tokens_per_sample`` tokens each: the budget rounded up to whole steps."""
    return -(-tokens // (global_batch * tokens_per_sample))


def fmt_seconds(s: float) -> str:
    """A duration in the unit that reads best: 6.55 ns, 59.5 us, 446 ms, 12.3 s, 4.2 min, 3.1 h, 2.5 d."""
    for limit, scale, unit in ((1e-6, 1e9, "ns"), (1e-3, 1e6, "us"), (1.0, 1e3, "ms"), (60.0, 1.0, "s"),
                               (3600.0, 1 / 60, "min"), (86400.0, 1 / 3600, "h")):
        if s < limit:
            return f"{s * scale:.3g} {unit}"
    days = s / 86400
    return f"{days:.3g} d" if days < 999.5 else f"{days:,.0f} d"  # not 1e+03 d


# task of a model of one's own (plan/own.py): info["build"] builds it, called with no arguments under fake tensors;
# info["loss_fn"], where fit() was given one, is the loss its measured steps go backward from (what fake tensors
# cannot run in it is said of the loss: fake_build.fake_loss)
OWN = "own"


def _fake_model(cfg: Config, task: str, info: dict[str, Any], checkpointing: str,
                dtype: torch.dtype = torch.float32) -> nn.Module:
    from scaletrain.models import build_model
    from scaletrain.parallel.activation_checkpoint import apply_activation_checkpointing
    from scaletrain.plan.fake_build import build_fake

    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # Module.to() cannot swap fake parameters: build them in the dtype
    try:
        model = build_fake(info["build"]) if task == OWN else build_model(cfg.model, task, info)
    finally:
        torch.set_default_dtype(default)
    model.train()
    apply_activation_checkpointing(model, checkpointing)
    return model


# The built-in GPT's and Llama's blocks are identical, so what a step keeps, and its FLOPs, grow by the same
# amount with each block: measured at MEASURED_LAYERS blocks, extrapolated to model.n_layer (exact to the byte
# from 3 blocks on; under bf16 autocast with full checkpointing, 2 blocks keep more than 3.
# tests/unit/test_plan.py, tests/unit/test_plan_parallel.py for the Llama).
MEASURED_LAYERS = (3, 4)
BLOCK_MODELS = ("gpt", "llama")  # model.name of the built-in models made of model.n_layer identical blocks


def measure_model(cfg: Config, task: str, info: dict[str, Any], sample: torch.Tensor, *,
                  target: torch.Tensor | None = None, modes: tuple[str, ...] = AC_PLANNED, sharded: tuple[bool, ...] = (False, True),
                  flops: float | None = None) -> ModelFacts:
    """ModelFacts of cfg's model for ``sample`` (one real input, no batch dim) at cfg.data.batch_size: the
    parameters counted on the whole model; a GPT deeper than MEASURED_LAYERS measured at those depths and
    extrapolated (a 32-block GPT planned in a fraction of the time), any other model measured whole.
    ``modes``/``sharded``: the checkpointing modes and layouts (DDP, FSDP) to measure activations for (a run's
    own plan needs one of each); ``flops``: FLOPs per sample known already (not counted again); ``target``:
    the sample's target, which a GPT with model.loss=fused takes in forward (its logits are never kept)."""
    return _compiled(cfg, _measure_eager(cfg, task, info, sample, target=target, modes=modes, sharded=sharded,
                                         flops=flops))


def compile_ratio(cfg: Config, params: float, key: str) -> float:
    """What torch.compile keeps of the eager activations of key ``key`` (train.compile, the built-in GPT): the
    measured ratio of plan/catalog.py's COMPILED_ACTIVATIONS, whole-graph for DDP's keys and block by block for
    FSDP's ("sharded-"); 1 where nothing is compiled or nothing was measured."""
    from scaletrain.plan.catalog import compiled_activations

    if not cfg.train.compile or cfg.model.name != "gpt":
        return 1.0
    m = compiled_activations(whole=not key.startswith("sharded-"), loss=cfg.model.loss, bias=cfg.model.bias,
                             params=params)
    return m.ratio if m is not None else 1.0


def _compiled(cfg: Config, facts: ModelFacts) -> ModelFacts:
    """Activations as torch.compile keeps them: the eager measurement times compile_ratio."""
    return facts.scaled(lambda key: compile_ratio(cfg, facts.params, key))


def _measure_eager(cfg: Config, task: str, info: dict[str, Any], sample: torch.Tensor, *,
                   target: torch.Tensor | None, modes: tuple[str, ...], sharded: tuple[bool, ...],
                   flops: float | None) -> ModelFacts:
    layers = cfg.model.n_layer if cfg.model.name in BLOCK_MODELS and task != OWN else 0
    if layers <= 2 * MEASURED_LAYERS[-1]:  # as quick to measure whole
        return _measure(cfg, task, info, sample, target=target, modes=modes, sharded=sharded, flops=flops)
    lo, hi = _measure_depths(cfg, task, info, sample, target=target, modes=modes, sharded=sharded, flops=flops)
    whole = _measure(cfg, task, info, sample, steps=False)
    more = layers - MEASURED_LAYERS[-1]
    per_sample = flops if flops is not None else \
        hi.flops_per_sample + more * (hi.flops_per_sample - lo.flops_per_sample)
    return replace(whole, flops_per_sample=per_sample,
                   activations={k: v + more * (v - lo.activations[k]) for k, v in hi.activations.items()},
                   **_per_block(lo, hi))


def _block_and_rest(lo: int, hi: int) -> tuple[int, int]:
    """(one block's, the rest's) of a figure measured at MEASURED_LAYERS blocks (``lo``, ``hi``)."""
    fewer, more = MEASURED_LAYERS
    block = (hi - lo) // (more - fewer)
    return block, lo - fewer * block


def _per_block(lo: ModelFacts, hi: ModelFacts) -> dict[str, dict[str, int]]:
    """ModelFacts' block_activations, block_kept and rest_kept from the model measured at MEASURED_LAYERS."""
    kept = {k: _block_and_rest(lo.kept[k], v) for k, v in hi.kept.items()}
    return {"block_activations": {k: _block_and_rest(lo.activations[k], v)[0] for k, v in hi.activations.items()},
            "block_kept": {k: block for k, (block, _) in kept.items()},
            "rest_kept": {k: rest for k, (_, rest) in kept.items()}}


def _measure_depths(cfg: Config, task: str, info: dict[str, Any], sample: torch.Tensor, *,
                    target: torch.Tensor | None, modes: tuple[str, ...], sharded: tuple[bool, ...],
                    flops: float | None) -> tuple[ModelFacts, ModelFacts]:
    """The model of ``cfg`` measured at each of MEASURED_LAYERS blocks."""
    lo, hi = (_measure(replace(cfg, model=replace(cfg.model, n_layer=n)), task, info, sample, target=target,
                       steps=True, modes=modes, sharded=sharded, flops=flops, kept=True)
              for n in MEASURED_LAYERS)
    return lo, hi


def with_block_activations(cfg: Config, task: str, info: dict[str, Any], sample: torch.Tensor, facts: ModelFacts,
                           *, target: torch.Tensor | None = None) -> ModelFacts:
    """``facts`` with block_activations: a GPT or Llama measured whole (up to 8 blocks) is measured again at
    MEASURED_LAYERS blocks; a model without identical blocks is returned as it was. Call it before scaling
    ``facts`` (--calibrate), which scales both."""
    if facts.block_activations or cfg.model.name not in BLOCK_MODELS:
        return facts
    modes = tuple(k for k in facts.activations if not k.startswith("sharded-"))
    lo, hi = _measure_depths(cfg, task, info, sample, target=target, modes=modes, sharded=(False, True),
                             flops=facts.flops_per_sample)
    return replace(facts, **_per_block(_compiled(cfg, lo), _compiled(cfg, hi)))


def with_tp_activations(cfg: Config, task: str, info: dict[str, Any], sample: torch.Tensor, facts: ModelFacts,
                        degrees: Iterable[int], *, target: torch.Tensor | None = None) -> ModelFacts:
    """``facts`` with tp_activations for each tensor-parallel degree above 1 in ``degrees``: the model split as
    parallel/tensor.py splits it in training (torch's tensor parallelism on a "tp" mesh), one forward and
    backward measured on fake tensors over torch's fake process group (one process playing rank 0 of tp: no
    communication, no memory), at MEASURED_LAYERS blocks. What torch's tensor parallelism keeps differs from
    Megatron's, which Korthikanti's ratio describes: the all-gathered inputs of the column-parallel matmuls
    stay whole for their backward, and a GPT's norms are not sequence-parallel. Where the fake process group
    cannot be had (a process group of this process's own already), the ratio stays."""
    wanted = sorted(t for t in set(degrees) if t > 1 and t not in facts.tp_activations)
    if not wanted or cfg.model.name not in BLOCK_MODELS or not facts.block_activations:
        return facts
    found = dict(facts.tp_activations)
    keys = tuple(facts.activations)
    for tp in wanted:
        measured = _measure_tp(cfg, task, info, sample, tp, keys, target=target)
        if measured is None:
            break
        found[tp] = measured
    return replace(facts, tp_activations=found)


def _measure_tp(cfg: Config, task: str, info: dict[str, Any], sample: torch.Tensor, tp: int, keys: tuple[str, ...],
                *, target: torch.Tensor | None) -> dict[str, tuple[int, int, int, int]] | None:
    """key -> (one block's, the rest's, one block's kept, the rest's kept) activations on rank 0 of a tp-way
    tensor-parallel step (with_tp_activations); None without the fake process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.parallel.activation_checkpoint import apply_activation_checkpointing
    from scaletrain.parallel.tensor import apply_tp
    from scaletrain.sharded import loss_context

    try:  # torch's own, for single-process simulations of a rank (torchtitan's memory estimation uses it)
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return None
    if dist.is_initialized():
        return None
    dtype = AUTOCAST_DTYPE.get(cfg.train.precision)
    measured: dict[str, list[tuple[int, int | None]]] = {k: [] for k in keys}  # key -> (peak, kept) per depth
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))  # outside fake mode: it reads its ranks
        for n in MEASURED_LAYERS:
            at = replace(cfg, model=replace(cfg.model, n_layer=n))
            done: dict[tuple[str, bool], tuple[int, int | None]] = {}  # (checkpointing, low) -> its measure
            for key in keys:
                ac, low = key.removeprefix("sharded-"), key.startswith("sharded-") and dtype is not None
                if (ac, low) in done:  # no compute dtype: FSDP's step is DDP's, measured already
                    measured[key].append(done[ac, low])
                    continue
                with FakeTensorMode(allow_non_fake_inputs=False) as mode:
                    fake_sample = _fake_input(mode, cfg, sample, target)
                    model = _fake_model(at, task, info, "none", dtype if low else torch.float32)
                # torch's parallelize_module (the fake parameters keep their mode); the trainer's cross-entropy
                # on logits split by vocabulary, as parallel.loss_parallel has it
                apply_tp(model, mesh["tp"], loss_parallel=cfg.parallel.loss_parallel)
                apply_activation_checkpointing(model, ac)  # after the split, as parallelize() orders them
                with mode, loss_context(model):
                    done[ac, low] = _step_bytes(at, model, fake_sample, low=low, kept=True)
                measured[key].append(done[ac, low])
    finally:
        dist.destroy_process_group()
    out = {}
    for key, ((peak_lo, kept_lo), (peak_hi, kept_hi)) in measured.items():
        assert kept_lo is not None and kept_hi is not None
        out[key] = (*_block_and_rest(peak_lo, peak_hi), *_block_and_rest(kept_lo, kept_hi))
    return out


def _fake_input(mode: FakeTensorMode, cfg: Config, sample: torch.Tensor | Batch,
                target: torch.Tensor | None) -> torch.Tensor | Batch:
    """``sample`` as a fake input: a batch of one with its targets for a GPT with model.loss=fused (it takes
    them in forward, and never keeps its logits); a model of one's own's Batch of one, every tensor faked."""
    if isinstance(sample, Batch):
        return sample.map(mode.from_tensor)
    fake_sample: torch.Tensor | Batch = mode.from_tensor(sample)
    if target is not None and cfg.model.name == "gpt" and cfg.model.loss == "fused":
        one, fake_target = fake_sample.unsqueeze(0), mode.from_tensor(target).unsqueeze(0)
        fake_sample = Batch((one,), {"targets": fake_target}, fake_target)
    return fake_sample


def _step_bytes(cfg: Config, model: nn.Module, sample: torch.Tensor | Batch, *, low: bool,
                kept: bool) -> tuple[int, int | None]:
    """(the step's peak beyond the model state, with ``kept`` what forward keeps for backward) at
    cfg.data.batch_size: _bytes_at of _step_points."""
    return _bytes_at(cfg, _step_points(cfg, model, sample, low=low), kept=kept)


def _bytes_at(cfg: Config, curve: StepCurve, *, kept: bool) -> tuple[int, int | None]:
    """_step_bytes' figures at cfg.data.batch_size from _step_points' curve."""
    step = curve.at(cfg.data.batch_size)
    return step.peak_bytes, step.activations_bytes if kept else None


def _step_points(cfg: Config, model: nn.Module, sample: torch.Tensor | Batch, *,
                 low: bool, loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss) -> StepCurve:
    """The step measured at batch 1 and 2 (observe.memory.step_points' curve): as DDP runs it (autocast) or, ``low``, as
    FSDP does (a model built in the compute dtype, a floating input cast to it; no autocast for scaletrain's own
    models, autocast over a model of one's own: precision.policy_casts). ``loss_fn``: the user's (fit()'s
    loss_fn(output, target)), where backward starts."""
    precision = cfg.train.precision
    if low:
        dtype = AUTOCAST_DTYPE[precision]
        precision = "fp32" if getattr(model, "fsdp_policy_casts", False) else precision
        if isinstance(sample, torch.Tensor) and sample.is_floating_point():
            sample = sample.to(dtype)
        elif isinstance(sample, Batch):  # FSDP's policy casts the floating inputs (cast_forward_inputs)
            sample = sample.map(lambda t: t.to(dtype) if t.is_floating_point() else t, target=False)
    return step_points(model, sample, precision=precision, loss_fn=loss_fn)


# What _measure measured of a built-in model, by what decides it: the config at one sample per batch, the
# sample's and target's shapes, then the checkpointing mode and FSDP's compute-dtype copy (_POINTS), or the
# parameters and FLOPs per sample (_COUNTS). A plan measures its config again at the trainer's micro-batch (a
# pipeline's) and at MEASURED_LAYERS blocks for each measurement: the same fake steps, extrapolated to another
# batch size (the 405B plan measured each twice: 36 of its 73 profiled seconds). A model of one's own is not
# kept: its config does not say which model it is.
_POINTS: dict[Any, StepCurve] = {}
_COUNTS: dict[Any, tuple[int, int, int, int]] = {}
_FLOPS: dict[Any, float] = {}


def _once(store: dict[Any, Any], key: Any, make: Callable[[], Any]) -> Any:
    if key not in store:
        store[key] = make()
    return store[key]


def _measured_key(cfg: Config, task: str, sample: torch.Tensor | Batch,
                  target: torch.Tensor | None) -> tuple[Any, ...] | None:
    if task == OWN or not isinstance(sample, torch.Tensor):
        return None
    shape = (tuple(target.shape), target.dtype) if isinstance(target, torch.Tensor) else None
    return replace(cfg, data=replace(cfg.data, batch_size=1)), task, (tuple(sample.shape), sample.dtype), shape


def _measure(cfg: Config, task: str, info: dict[str, Any], sample: torch.Tensor, *,
             target: torch.Tensor | None = None, steps: bool = True, modes: tuple[str, ...] = AC_PLANNED, sharded: tuple[bool, ...] = (False, True),
             flops: float | None = None, kept: bool = False) -> ModelFacts:
    """ModelFacts of cfg's model, measured whole (``steps=False``: the parameters only, no FLOPs or
    activations).

    Activations are measured twice per checkpointing mode: as DDP runs (fp32 parameters under autocast, which
    keeps a compute-dtype copy of every weight for backward) and as FSDP runs (its MixedPrecisionPolicy
    all-gathers the parameters in the compute dtype and casts the inputs: no copies, counted instead as the
    FSDP working set)."""
    from scaletrain.observe.throughput import flops_per_sample
    from scaletrain.plan.fake_build import fake_loss

    dtype = AUTOCAST_DTYPE.get(cfg.train.precision)
    acts: dict[str, int] = {}
    held: dict[str, int] = {}  # with ``kept``: what forward keeps for backward, per key
    known = _measured_key(cfg, task, sample, target)
    points, counts_of, flops_of = (_POINTS, _COUNTS, _FLOPS) if known is not None else ({}, {}, {})
    loss_fn = fake_loss(info["loss_fn"]) if "loss_fn" in info else default_loss

    def measured(key: str, build: Callable[[], nn.Module], *, low: bool) -> None:
        two = _once(points, (known, key, low), lambda: _step_points(cfg, build(), fake_sample, low=low, loss_fn=loss_fn))
        acts[key], just_kept = _bytes_at(cfg, two, kept=kept)
        if just_kept is not None:
            held[key] = just_kept

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_sample = _fake_input(mode, cfg, sample, target)
        plain = functools.cache(lambda: _fake_model(cfg, task, info, "none"))  # built when first needed
        counts = _once(counts_of, known, lambda: model_counts(plain(), cfg.parallel.fsdp_units))
        if steps and flops is None:
            flops = _once(flops_of, known, lambda: flops_per_sample(plain(), fake_sample))
        for ac in modes if steps else ():
            build = plain if ac == "none" else functools.partial(_fake_model, cfg, task, info, ac)
            if False in sharded or dtype is None:
                measured(ac, build, low=False)
            if dtype is None:  # no compute dtype: FSDP's step is DDP's
                acts[f"sharded-{ac}"] = acts[ac]
                if kept:
                    held[f"sharded-{ac}"] = held[ac]
            elif True in sharded:
                measured(f"sharded-{ac}", functools.partial(_fake_model, cfg, task, info, ac, dtype), low=True)
    tokens = sample.tokens_per_sample() if isinstance(sample, Batch) else \
        int(info.get("seq_len", 0)) if task == "lm" else 0
    return ModelFacts(*counts, flops_per_sample=flops or 0.0, tokens_per_sample=tokens, activations=acts, kept=held)


def model_counts(model: nn.Module, units_given: str = "") -> tuple[int, int, int, int]:
    """ModelFacts' (params, trainable, largest_unit, units) of ``model`` (fake or real; a tied parameter counted
    once, a sharded DTensor at its whole size); ``units_given``: parallel.fsdp_units."""
    from scaletrain.parallel.fsdp import fsdp_units

    params = list(model.parameters())
    units = fsdp_units(model, units_given) or [model]
    return (sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad),
            max(sum(p.numel() for p in u.parameters()) for u in units), len(units))


def usable_bytes(acc: Accelerator) -> int:
    """What a layout may use of the device: all but observe.memory's fit margin."""
    return int(acc.memory_bytes * (1 - FIT_MARGIN))


def ring(n: int) -> float:
    """The share of a tensor each rank sends in a ring all-reduce's half (reduce-scatter or all-gather)."""
    return (n - 1) / n if n > 1 else 0.0


def compute_bytes(precision: str) -> int:
    """Bytes per element of the compute dtype (bf16/fp16 under mixed precision, else fp32)."""
    return AUTOCAST_DTYPE.get(precision, torch.float32).itemsize


def dp_comm_s(kind: str, *, params: int, trainable: int, dp: int, micro: int, cbytes: int, across: float,
              link: float, net: float, within: int) -> float:
    """Seconds of data-parallel collectives per optimizer step over ``dp`` ranks (``micro``: forwards per step,
    ``across``: the slowest link they cross, ``within``: an HSDP shard group's size): ddp, zero1, zero2 an
    all-reduce of fp32 gradients (zero: a reduce-scatter of them and an all-gather of the updated fp32
    parameters, the same bytes); fsdp two all-gathers of the parameters in the compute dtype per forward and a
    reduce-scatter of the gradients; hsdp that within a machine and an all-reduce of one shard's gradients
    across machines."""
    g32, pc = 4 * trainable, cbytes * params
    if kind in ("ddp", "zero1", "zero2"):
        return 2 * ring(dp) * g32 / across
    if kind == "fsdp":
        return (micro * 2 * ring(dp) * pc + ring(dp) * g32) / across
    replicas = dp // within
    return ((micro * 2 * ring(within) * pc + ring(within) * g32) / link
            + 2 * ring(replicas) * (g32 / within) / net)


def layout(facts: ModelFacts, strategy: str, checkpointing: str, *, acc: Accelerator, gpus_per_node: int,
           nodes: int, precision: str, tf32: bool, batch_size: int, accum_steps: int, optimizer: str,
           mfu: float, net_bytes_per_s: float) -> Layout:
    """Memory per GPU and time per optimizer step of one layout (the module docstring's model)."""
    world = gpus_per_node * nodes
    shard = {"ddp": 1, "fsdp": world, "hsdp": gpus_per_node}[strategy]
    cbytes = compute_bytes(precision)
    flops = facts.flops_per_sample * batch_size * world * accum_steps  # the model's, as MFU counts them
    # ``mfu`` is a run's without recompute; full checkpointing does a forward more on the same hardware
    # (HFU unchanged), so its MFU is 3/4 of that.
    compute = flops * RECOMPUTE[checkpointing] / (world * acc.peak(precision, tf32=tf32) * mfu)
    link = acc.link_bytes_per_s
    across = min(link, net_bytes_per_s) if nodes > 1 else link
    comm = dp_comm_s(strategy, params=facts.params, trainable=facts.trainable, dp=world, micro=accum_steps,
                     cbytes=cbytes, across=across, link=link, net=net_bytes_per_s, within=shard)
    memory = layout_memory(facts, strategy, checkpointing, shard=shard, precision=precision, optimizer=optimizer)
    return Layout(strategy, checkpointing, *memory, compute, comm, sum(memory) <= usable_bytes(acc))


def activation_key(strategy: str, checkpointing: str) -> str:
    """ModelFacts' activation key of a layout: FSDP's ("sharded-") on any number of ranks, one too (its bf16
    parameters, and torch.compile block by block)."""
    return checkpointing if strategy == "ddp" else f"sharded-{checkpointing}"


def layout_memory(facts: ModelFacts, strategy: str, checkpointing: str, *, shard: int, precision: str,
                  optimizer: str) -> tuple[int, int, int, int, int]:
    """Bytes per GPU of one layout, its model state sharded over ``shard`` ranks: parameters, gradients,
    optimizer state, activations, FSDP's working set (the module docstring's model)."""
    p32, g32 = 4 * facts.params, 4 * facts.trainable
    k = OPTIM_STATES.get(optimizer, 2)
    buffers = 0 if strategy == "ddp" or shard == 1 else facts.largest_unit * (2 * compute_bytes(precision) + 4)
    acts = facts.activations[activation_key(strategy, checkpointing)]
    return math.ceil(p32 / shard), math.ceil(g32 / shard), math.ceil(k * g32 / shard), acts, buffers


def strategies(world: int, nodes: int) -> list[str]:
    """The layouts worth planning: DDP always; FSDP with more than one GPU; HSDP across machines."""
    out = ["ddp"]
    if world > 1:
        out.append("fsdp")
    if nodes > 1 and world // nodes > 1:
        out.append("hsdp")
    return out


def choose(plan: Plan) -> tuple[Layout | None, str]:
    """The fastest layout that fits (ties: the simpler one: DDP, then no recomputation), and why."""
    fitting = [lay for lay in plan.layouts if lay.fits]
    usable = plan.usable_bytes
    if fitting:
        best = min(fitting, key=lambda lay: lay.step_s)  # min keeps the first of equals: the table's order
        why = (f"activation checkpointing {best.checkpointing}; {fmt_bytes(best.total_bytes)} per GPU of "
               f"{fmt_bytes(usable)} usable, {fmt_seconds(best.step_s)} per step ({best.bound}-bound)")
        ddp = next((lay for lay in plan.layouts if lay.strategy == "ddp" and lay.checkpointing == "none"), None)
        if ddp is not None and not ddp.fits:
            why += (f"; ddp does not fit: {fmt_bytes(ddp.total_bytes)} per GPU (model state "
                    f"{fmt_bytes(ddp.params_bytes + ddp.grads_bytes + ddp.optim_bytes)} replicated)")
        elif ddp is not None and best is not ddp:
            why += f"; ddp fits too, at {fmt_seconds(ddp.step_s)} per step ({ddp.bound}-bound)"
        return best, why
    return None, (f"{_smallest(plan)}; fix: more GPUs to shard over (--nproc, --nnodes), a smaller "
                  "--data.batch_size with --train.accum_steps keeping the global batch, "
                  + ("" if plan.precision != "fp32" else "--train.precision=bf16-mixed, ")
                  + "or a larger accelerator (--gpu)")


def _smallest(plan: Plan) -> str:
    smallest = min(plan.layouts, key=lambda lay: lay.total_bytes)
    state = smallest.params_bytes + smallest.grads_bytes + smallest.optim_bytes
    return (f"the smallest is {smallest.strategy} with checkpointing {smallest.checkpointing} at "
            f"{fmt_bytes(smallest.total_bytes)} per GPU (model state {fmt_bytes(state)}, activations "
            f"{fmt_bytes(smallest.activations_bytes)}) of {fmt_bytes(plan.usable_bytes)} usable")


def make_plan(cfg: Config, facts: ModelFacts, acc: Accelerator, *, total_steps: int, accum_steps: int,
              mfu: float, net_bytes_per_s: float, price_per_gpu_hour: float | None) -> Plan:
    gpus, nodes = cfg.dist.nproc, cfg.dist.nnodes
    plan = Plan(acc, gpus, nodes, cfg.train.precision, cfg.train.tf32, cfg.data.batch_size, accum_steps,
                total_steps, mfu, net_bytes_per_s, price_per_gpu_hour, facts)

    def at(strategy: str, ac: str, per_node: int, n_nodes: int) -> Layout:
        return layout(facts, strategy, ac, acc=acc, gpus_per_node=per_node, nodes=n_nodes,
                      precision=cfg.train.precision, tf32=cfg.train.tf32, batch_size=cfg.data.batch_size,
                      accum_steps=accum_steps, optimizer=cfg.optim.name, mfu=mfu, net_bytes_per_s=net_bytes_per_s)

    for strategy in strategies(gpus * nodes, nodes):
        for ac in AC_PLANNED:
            plan.layouts.append(at(strategy, ac, gpus, nodes))
    plan.choice, plan.reason = choose(plan)
    if plan.choice is None:  # how many GPUs FSDP with full checkpointing would need (machines of `gpus`)
        need = next((n for n in range(2, 65537) if at("fsdp", "full", n, 1).fits), None)
        if need:
            plan.reason += f"; FSDP with --memory.activation_checkpointing=full fits on {need} GPUs of this kind"
        else:  # more GPUs are no fix: say what does not shrink with them
            plan.reason = f"{_smallest(plan)}; {_beyond_sharding(at('fsdp', 'full', 65536, 1), plan)}"
    return plan


def _beyond_sharding(lay: Layout, plan: Plan) -> str:
    """Why no number of GPUs holds the model under FSDP with full checkpointing: what does not shrink with more
    GPUs (the activations of the per-rank batch, FSDP's working set of a block), each named with its size."""
    usable = plan.usable_bytes
    acts, buffers = lay.activations_bytes, lay.fsdp_buffers_bytes
    held = (f"the activations of its batch of {plan.batch_size} ({fmt_bytes(acts)}) and FSDP's working set, two "
            f"blocks all-gathered and one block's gradients ({fmt_bytes(buffers)})")
    if buffers >= acts:
        cause = "FSDP's working set" + (" alone" if buffers > usable else "") + " is the larger part"
        fix = "smaller blocks (fewer parameters per block: --model.n_embd), or a larger accelerator (--gpu)"
    else:
        cause = "the activations" + (" alone" if acts > usable else "") + " are the larger part"
        fix = ("--data.batch_size=1 with --train.accum_steps keeping the global batch, " if plan.batch_size > 1
               else "") + "a shorter --data.seq_len, or a larger accelerator (--gpu)"
    return (f"even 65,536 GPUs would not hold it: each GPU still holds {held}, {fmt_bytes(acts + buffers)} of "
            f"{fmt_bytes(usable)} usable; {cause}; fix: {fix}")
