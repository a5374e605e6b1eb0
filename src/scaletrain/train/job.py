"""Everything one training run holds, built once from the config, the runtime and the data."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Dataset

from scaletrain.batch import Batcher, BatchFn, collate_one, default_loss
from scaletrain.config import Config, OptimConfig
from scaletrain.data import ShardedLoader, Splits
from scaletrain.models import GPT, build_model
from scaletrain.observe.memory import MemoryBreakdown
from scaletrain.observe.throughput import flops_per_sample
from scaletrain.observe.timing import NullTimer, StepTimer, attach_comm_hook, attach_fsdp_mark
from scaletrain.parallel import Layout, is_fsdp, parallelize, resolve_layout, resolve_strategy
from scaletrain.runtime import Runtime, seed_all, set_deterministic
from scaletrain.train.batching import BatchPlan, plan_batches
from scaletrain.train.chaos import Chaos
from scaletrain.train.guard import NonFiniteGuard, supports_device_skip
from scaletrain.train.lr import build_scheduler
from scaletrain.train.precision import check_precision, grad_scaler, set_tf32

if TYPE_CHECKING:
    from scaletrain.train.trace import Tracer

LossFn = Callable[[Any, Any], torch.Tensor]  # (the model's output as it returned it, the batch's target)


@dataclass
class Job:
    cfg: Config
    rt: Runtime
    plan: BatchPlan
    module: nn.Module  # the bare model: evaluation and saving
    model: nn.Module  # what forward and backward go through (DDP-wrapped when world > 1)
    optimizer: Optimizer
    scheduler: LambdaLR
    scaler: torch.amp.GradScaler
    loader: ShardedLoader
    eval_data: Dataset | None
    loss_fn: LossFn
    batcher: Batcher  # a loader's batch -> the model's inputs and the loss's target
    guard: NonFiniteGuard
    chaos: Chaos
    layout: Layout  # the parallel layout, resolved once (scaletrain/layout.py)
    strategy_reason: str = ""
    step: int = 0  # optimizer steps completed
    tracer: Tracer | None = None  # per-step fingerprints (debug.trace)
    state_bytes: MemoryBreakdown | None = None  # model state on this rank, counted after the first step
    timer: StepTimer = dataclasses.field(default_factory=lambda: NullTimer(torch.device("cpu")))  # phase times
    flops: float = 0.0  # model FLOPs per training sample (forward + backward)
    tokens_per_sample: int = 0  # sequence models: tokens per sample

    @property
    def strategy(self) -> str:
        """The data-parallel layout in effect (auto resolved)."""
        return self.layout.strategy

    @property
    def sharded(self) -> bool:
        """FSDP/HSDP: parameters, gradients and optimizer state are DTensor shards; forward is collective."""
        return is_fsdp(self.model)

    def release(self) -> None:
        """Drop the parallel wrapper (it holds the process group) so closing the group really ends it."""
        self.model = self.module


def build_optimizer(module: nn.Module, cfg: OptimConfig, lr: float) -> Optimizer:
    """Weight decay on matrices and embeddings only, never on biases and norm gains (GPT-2's rule)."""
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    # Fused kernels: faster, and they skip a non-finite step on the device (train/guard.py) without a sync.
    # torch has no sharding rule for fused SGD on DTensors (FSDP): there the guard falls back to a host check.
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) and not (
        cfg.name == "sgd" and any(isinstance(p, DTensor) for p in params))
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, fused=fused)
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), fused=fused)


ModelArg = nn.Module | Callable[[], nn.Module] | None


def build_job(cfg: Config, rt: Runtime, splits: Splits, model: ModelArg = None,
              loss_fn: LossFn | None = None, resume: dict[str, Any] | None = None,
              batch_fn: BatchFn | None = None) -> Job:
    """``model``: None (the built-in model the config names), a module, or a callable building one (a class
    works): a callable is called after seeding, so run.seed decides the initial weights. ``resume``: the
    metadata of the checkpoint the job will continue from (its global batch and position shape the plan).
    ``batch_fn``: maps a loader batch to (inputs, target) where scaletrain.batch's convention does not fit."""
    # Once, with the strategy as given; again below only if auto resolves to another one (a sharded layout
    # refuses fp16).
    check_precision(cfg.train.precision, rt.device, cfg.parallel.strategy)
    set_tf32(cfg.train.tf32, rt.device)
    plan = plan_batches(cfg, rt.world_size, len(splits.train), resume)  # type: ignore[arg-type]
    set_deterministic(cfg.train.deterministic)
    seed_all(cfg.run.seed)  # the same initial weights on every rank
    if model is None:
        module = build_model(cfg.model, splits.task, splits.info)
    else:
        module = model if isinstance(model, nn.Module) else model()
    module.to(rt.device)
    # The built-in GPT with model.loss=fused computes its loss in forward: it is given the targets too.
    batcher = Batcher(module, batch_fn, target_kwarg="targets" if isinstance(module, GPT) and module.fused_loss else None)
    one = batcher(collate_one(splits.train))  # a batch of one sample, as the loader collates it
    flops = flops_per_sample(module, one.to(rt.device))  # counted once, before any wrapping
    nnodes = max(1, rt.world_size // rt.local_world_size)
    strategy, reason = resolve_strategy(module, cfg.parallel, world_size=rt.world_size, nnodes=nnodes,
                                        precision=cfg.train.precision, optimizer=cfg.optim.name,
                                        sample=one if cfg.parallel.strategy == "auto" else None,
                                        batch_size=plan.batch_size, cpu_offload=cfg.memory.cpu_offload)
    if strategy != cfg.parallel.strategy:
        check_precision(cfg.train.precision, rt.device, strategy)
    layout = resolve_layout(cfg.parallel, cfg.memory, rt.world_size, nnodes, strategy=strategy)  # once, read below
    wrapped = parallelize(module, rt.device, rt.world_size, cfg.parallel, compile=cfg.train.compile,
                          precision=cfg.train.precision, memory=cfg.memory, layout=layout)
    torch.manual_seed(cfg.run.seed + rt.rank)  # dropout masks differ between ranks
    optimizer = build_optimizer(module, cfg.optim, plan.peak_lr)
    loader = ShardedLoader(splits.train, batch_size=plan.batch_size, rank=layout.dp_rank(rt.rank),
                           world=layout.dp_size, accum=plan.accum_steps, seed=cfg.run.seed, shuffle=cfg.data.shuffle,
                           num_workers=cfg.data.num_workers, pin_memory=rt.device.type == "cuda")
    scaler = grad_scaler(cfg.train.precision, rt.device)
    guard = NonFiniteGuard(rt.device, scaler_owns_skips=scaler.is_enabled(), device_skip=supports_device_skip(optimizer))
    timer = StepTimer(rt.device) if cfg.log.phase_times else NullTimer(rt.device)
    timed = timer if cfg.log.phase_times else None  # the hooks need not be attached for a NullTimer
    attach_comm_hook(wrapped, timed, overlap=cfg.parallel.overlap)
    attach_fsdp_mark(wrapped, timed)
    return Job(cfg, rt, plan, module, wrapped, optimizer, build_scheduler(optimizer, cfg.schedule, plan.total_steps),
               scaler, loader, splits.eval, loss_fn or default_loss, batcher, guard,
               Chaos(cfg.chaos, rt.rank, rt.world_size), layout, reason, timer=timer, flops=flops,
               tokens_per_sample=one.tokens_per_sample())
