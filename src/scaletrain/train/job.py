"""What scaletrain train and fit() build from the config, the runtime and the data, for a session to train."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau
from torch.utils.data import DataLoader, Dataset, IterableDataset

from scaletrain.batch import (
    Batch,
    Batcher,
    BatchFn,
    check_targets,
    default_loss,
    label_shift,
    leaves,
    loss_of,
    one_sample,
    shifted_loss,
)
from scaletrain.config import Config, OptimConfig, TrainConfig
from scaletrain.data import Splits, TensorPairs, train_size
from scaletrain.errors import CheckpointError, ConfigError, UserError, said_of
from scaletrain.layout import check_pipeline
from scaletrain.models import GPT, build_model
from scaletrain.models.init import refuse_sync_batchnorm, refuse_unfilled
from scaletrain.observe.report.load import EVAL_OWN
from scaletrain.observe.throughput import flops_per_sample
from scaletrain.parallel import (
    Layout,
    gradient_sync,
    has_dtensors,
    is_fsdp,
    resolve_layout,
    resolve_strategy,
    sharded_parts,
    uncompiled,
)
from scaletrain.parallel.pipeline import PipelineRunner
from scaletrain.parallel.units import mark_idle
from scaletrain.runtime import Runtime, seed_all, set_deterministic
from scaletrain.sharded import is_dtensor, loss_context, plain
from scaletrain.train.batching import BatchPlan, plan_batches
from scaletrain.train.guard import sparse_gradient_modules
from scaletrain.train.lr import build_scheduler
from scaletrain.train.precision import check_precision, set_attention, set_tf32
from scaletrain.train.state import load_scheduler_tree, scheduler_tree

if TYPE_CHECKING:
    from scaletrain.train.session import Loader, Session

LossFn = Callable[[Any, Any], torch.Tensor]  # (the model's output as it returned it, the batch's target)
# fit()'s optimizer=: one built on the model given, or a function of its trainable parameters building one
OwnOptimizer = Optimizer | Callable[[list[nn.Parameter]], Optimizer]
# fit()'s scheduler=: one built on the optimizer given, or a function of the optimizer building one
OwnScheduler = LRScheduler | Callable[[Optimizer], LRScheduler]


@dataclass
class Job:
    """A run of scaletrain train / fit(): the model built, its batch plan, how its batches become inputs and a
    loss; and, once attached to the session that trains it (attach()), the model wrapped for the layout,
    the optimizer, the LR schedule and the loader."""
    cfg: Config
    rt: Runtime
    plan: BatchPlan
    module: nn.Module  # the bare model (under parallel.pp > 1, once attached, this rank's stage): evaluation, saving
    optimizer: Optimizer  # before attach(): built on the bare model, to check a checkpoint against
    train_data: Dataset
    eval_data: Dataset | None
    loss_fn: LossFn
    batcher: Batcher  # a loader's batch -> the model's inputs and the loss's target
    layout: Layout  # the parallel layout, resolved once (scaletrain/layout.py)
    strategy_reason: str = ""
    flops: float = 0.0  # model FLOPs per training sample (forward + backward)
    tokens_per_sample: int = 0  # sequence models: tokens per sample
    params: int = 0  # the whole model's parameters (counted before a pipeline keeps one stage per rank)
    trainable: int = 0  # of those, the ones with requires_grad (fewer where the user froze some: adapters)
    shifted: bool = False  # pp > 1 on a transformers causal LM: the loss takes logits[:, :-1] against labels[:, 1:]
    label_shift: int | None = None  # batch.label_shift of the model's own loss or the user's loss_fn, read before step 1
    model_name: str = ""  # its class
    given_mode: str | None = None  # the model came as torch.compile(model, mode=...) returned it: that mode
    collate_fn: Callable[[list[Any]], Any] | None = None  # the user's (fit's collate_fn), else scaletrain's
    worker_init_fn: Callable[[int], None] | None = None  # a DataLoader's given to fit()
    user_loss: bool = False  # loss_fn was given: how it lines logits up with targets is its own (a shift, a mask)
    first: Batch | None = None  # a batch of the first training sample, on the host (plan vs actual measures it)
    build: Callable[[], nn.Module] | None = None  # a model of one's own given as its class or a builder: builds it
    pipeline: PipelineRunner | None = None  # parallel.pp > 1: runs this rank's stage of every step
    scheduler: LRScheduler | None = None
    own_optimizer: OwnOptimizer | None = None  # fit(optimizer=...): the user's, in place of optim.*
    own_scheduler: OwnScheduler | None = None  # fit(scheduler=...): the user's, in place of schedule.*
    peak_lrs: list[float] = dataclasses.field(default_factory=list)  # the user's optimizer's lr per group, as given
    loader: Loader | None = None
    eval_loader: DataLoader | None = None  # made at the first evaluation (train/evaluate.py), kept for the others
    st: Session | None = None
    best_eval: BestEval | None = None  # train.early_stop > 0 or checkpoint.best, with held-out data
    metrics: dict[str, Metric] = dataclasses.field(default_factory=dict)  # fit(metrics=...), evaluated beside the loss
    token_loss: LossFn | None = None  # train.loss_mean=tokens: the loss summed over its targets (None: the model's own)
    on_eval: OnEval | None = None  # fit(on_eval=...): called after each evaluation
    last_eval: dict[str, float] = dataclasses.field(default_factory=dict)
    eval_step: int = -1  # the step of the last evaluation
    unused: tuple[str, ...] = ()  # parameters that require a gradient and got none from the first sample's backward
    zero_unused: bool = False  # FSDP reduce-scatters zeros for those where a rank's batch leaves them so (attach())

    @property
    def model(self) -> nn.Module | None:
        """What forward and backward go through: the session's (DDP-wrapped when world > 1), read from it, so that
        the session's close drops the wrapper, and the process group it holds, for good (a second reference here
        kept it alive past destroy_process_group: Gloo's threads could then abort the process at exit)."""
        return self.st._models[0].wrapped if self.st is not None and self.st._models else None

    @property
    def strategy(self) -> str:
        """The data-parallel layout in effect (auto resolved)."""
        return self.layout.strategy

    @property
    def sharded(self) -> bool:
        """FSDP/HSDP or tensor parallelism: parameters, gradients and optimizer state are DTensors; forward is
        collective."""
        return self.model is not None and has_dtensors(self.model)

    @property
    def fsdp(self) -> bool:
        """FSDP/HSDP: its mixed-precision policy casts (autocast is not needed)."""
        return self.model is not None and is_fsdp(self.model)

    @property
    def optim_kind(self) -> str:
        """The optimizer as the memory model counts its state: optim.name, or the kind of one given to fit()."""
        return optim_kind(self.cfg, self.optimizer, self.own_optimizer)

    @property
    def token_mean(self) -> bool:
        """train.loss_mean=tokens: the step's loss weighs each of its targets alike (_token_mean_step)."""
        return self.cfg.train.loss_mean == "tokens"

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self.st.steps if self.st is not None else 0

    def attach(self, st: Session) -> None:
        """Set the model up in ``st`` (wrapped for the layout, restored on resume), with its optimizer (weight
        decay on matrices only), LR schedule (tracked: in every checkpoint) and loader (``plan``'s batches)."""
        cfg, plan = self.cfg, self.plan
        st.total_steps, st.flops_per_sample = plan.total_steps, self.flops
        st.loss_parallel = cfg.parallel.loss_parallel and self.loss_fn is default_loss
        self.st = st
        if self.given_mode is not None:
            st.given_compiled(self.given_mode)
        layout = self.layout  # under tp or pp, st.setup() says why it cannot be measured at all
        if cfg.log.grad_noise_scale and layout.tp == layout.pp == layout.dp_size == plan.accum_steps == 1:
            raise UserError("log.grad_noise_scale compares the gradients of several ranks, or of the micro-batches "
                            "of one step: this run has one of each (one data-parallel rank, no accumulation); fix: "
                            "--nproc 2, or --train.accum_steps=2")
        # the user's (an instance FSDP or TP rebinds to their parameters, or the function, called again), else ours
        sparse = bool(sparse_gradient_modules(self.module))
        optimizer = self.own_optimizer if self.own_optimizer is not None else \
            lambda params: build_optimizer(params, cfg.optim, plan.peak_lr, sparse=sparse)
        wrapped, self.optimizer = st.setup(self.module, optimizer, name="model")
        # some ranks' batches may use them and others' not (parallel.find_unused: switched on by parallelize())
        if self.unused and is_fsdp(wrapped) and not cfg.parallel.find_unused:
            from scaletrain.parallel.fsdp import reduce_unused  # (FSDP's modules: imported where it is used)

            self.zero_unused = reduce_unused(wrapped)
        if st._stage is not None:  # pp > 1: this rank's stage is the model it trains, evaluates and saves
            self.module = st._stage
            # a transformers causal LM given its labels computes a shifted loss; its last stage returns logits
            self.shifted = st._stage.own_loss_shifts and not self.user_loss and self.first is not None \
                and self.first.target_given()
            if self.shifted:
                self.loss_fn = shifted_loss(self.loss_fn)
            self.pipeline = PipelineRunner(st._stage, st._stage.mesh, device=st.device,
                                           microbatches=cfg.parallel.microbatches, schedule=cfg.parallel.pp_schedule,
                                           loss_fn=self.loss_fn, accum=plan.accum_steps)
        _same_schedule(st, own=self.own_scheduler is not None)
        if self.own_scheduler is not None:  # the user's schedule, checkpointed as a session tracks one
            self.scheduler = own_scheduler(self.own_scheduler, self.optimizer)
            st.track(self.scheduler, name="lr_scheduler")
        else:
            # this run's peak (a restored group holds the saved one): optim.lr, or the lr of each group of the
            # optimizer given, under the linear scaling rule when optim.scale_lr is on
            scale = plan.peak_lr / cfg.optim.lr
            peaks = [lr * scale for lr in self.peak_lrs] or [plan.peak_lr] * len(self.optimizer.param_groups)
            for group, peak in zip(self.optimizer.param_groups, peaks):
                group["initial_lr"] = peak
            self.scheduler = build_scheduler(self.optimizer, cfg.schedule, plan.total_steps)
            st.track(Schedule(self.scheduler, self.optimizer, skip="scheduler" in st.skip, step=st.steps),
                     name="scheduler")
        self.loader = st.loader(self.train_data, batch_size=plan.batch_size, accum=plan.accum_steps,
                                collate_fn=self.collate_fn, worker_init_fn=self.worker_init_fn)
        if (cfg.train.early_stop or cfg.checkpoint.best) and self.eval_data is not None:
            self.best_eval = st.track(BestEval(cfg.train.early_stop, cfg.train.early_stop_delta, cfg.train.monitor,
                                               monitor_mode(cfg.train, self.metrics)), name="best_eval", _new=True)


SCHEDULES = {"scheduler": "scaletrain's (schedule.*)", "lr_scheduler": "the scheduler given to fit()"}  # tracked as


def _same_schedule(st: Session, *, own: bool) -> None:
    """A checkpoint made with scaletrain's schedule resumed with fit(scheduler=...), or the other way round: one
    line saying which is which (the session's own refusal names tracked objects a fit() user never named)."""
    if st.resume is None:
        return
    mine, other = ("lr_scheduler", "scheduler") if own else ("scheduler", "lr_scheduler")
    saved = st._trainer.get("tracked", {})
    if other in saved and mine not in saved:
        raise CheckpointError(st.resume.path, f"its LR schedule is {SCHEDULES[other]}, this run's is "
                              f"{SCHEDULES[mine]}", "resume with the schedule it was made with, or start a new "
                              "--run.dir")


class BestEval:
    """The best held-out train.monitor so far (better by more than train.early_stop_delta), its step, and the
    evaluations since it, for train.early_stop (``patience``; 0: never stops) and checkpoint.best; checkpointed: a
    resumed run stops, and keeps its best, where the uninterrupted one would (one that watched another measure
    starts afresh). Every rank reads the same all-reduced metrics, so every rank decides alike, with no collective
    of its own."""

    def __init__(self, patience: int, delta: float, monitor: str = "loss", mode: str = "min") -> None:
        self.patience, self.delta, self.monitor, self.mode = patience, delta, monitor, mode
        self.best, self.best_step, self.since = math.inf if mode == "min" else -math.inf, 0, 0

    def saw(self, metrics: dict[str, float], step: int) -> bool:
        """Record an evaluation; True when it is a new best."""
        if self.monitor not in metrics:  # accuracy, where the held-out targets are not classes
            raise ConfigError("train.monitor", self.monitor, "a measure this evaluation has: "
                              f"{', '.join(k for k in metrics if k not in EVAL_OWN[2:])}", "--train.monitor=loss")
        value = metrics[self.monitor]
        if (value < self.best - self.delta) if self.mode == "min" else (value > self.best + self.delta):
            self.best, self.best_step, self.since = value, step, 0
            return True
        self.since += 1
        return False

    @property
    def stopped(self) -> bool:
        """train.early_stop's patience is spent: the run ends here."""
        return 0 < self.patience <= self.since

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode, "best": self.best, "best_step": self.best_step,
                "since": self.since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("monitor", "loss"), state.get("mode", "min")) != (self.monitor, self.mode):
            return  # it watched another measure: this one's best starts at this resume
        self.best, self.best_step, self.since = float(state["best"]), int(state["best_step"]), int(state["since"])


Metric = Callable[[Any, Any], torch.Tensor]  # fit(metrics=...): (output, target) -> per-sample values
OnEval = Callable[[nn.Module, int, dict[str, float]], Any]  # fit(on_eval=...): (model, step, metrics)


def checked_metrics(metrics: Any) -> dict[str, Metric]:
    """fit(metrics=...): a mapping of names to functions, each checked (one line for the first wrong one)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise UserError(f"fit(metrics=...): a {type(metrics).__name__}; expected a dict of names to functions "
                        "(output, target) -> per-sample values; fix: metrics={'top5': lambda out, y: "
                        "(out.topk(5, -1).indices == y[:, None]).any(-1)}")
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name.isidentifier() or name in EVAL_OWN:
            raise UserError(f"fit(metrics=...): the name {name!r}; expected an identifier other than "
                            f"{', '.join(EVAL_OWN)} (it is logged as eval_NAME); fix: another name")
        if not callable(fn):
            raise UserError(f"fit(metrics={{{name!r}: ...}}): a {type(fn).__name__} is not a function; fix: a "
                            "function (output, target) -> a tensor of per-sample values")
    return dict(metrics)


def monitor_mode(train: TrainConfig, metrics: Mapping[str, Metric]) -> str:
    """train.monitor checked against what the evaluation measures, and its direction (min or max)."""
    name, mode = train.monitor, train.monitor_mode
    known = ("loss", "accuracy", *metrics)
    if name not in known:
        raise ConfigError("train.monitor", name, f"one of {', '.join(known)}", f"--train.monitor=loss, or "
                          f"fit(metrics={{{name!r}: fn}}) to measure it")
    if mode != "auto":
        return mode
    if name not in ("loss", "accuracy"):
        raise ConfigError("train.monitor_mode", mode, f"min or max for {name!r}, a metric of your own (does it "
                          "improve by falling or by rising?)", "--train.monitor_mode=max")
    return "min" if name == "loss" else "max"


class Schedule:
    """The LR schedule's position, as a session tracks it: the schedule itself is rebuilt from the config, so a
    resume at another peak lr (another global batch under the linear scaling rule) follows the new peak
    (train/state.py load_scheduler_tree). ``skip`` (debug.skip_restore): only the step count is restored."""

    def __init__(self, scheduler: LambdaLR, optimizer: Optimizer, *, skip: bool, step: int) -> None:
        self.scheduler, self.optimizer, self.skip, self.step = scheduler, optimizer, skip, step

    def state_dict(self) -> dict[str, Any]:
        return scheduler_tree(self.scheduler)

    def load_state_dict(self, tree: dict[str, Any]) -> None:
        if self.skip:
            self.scheduler.last_epoch = self.step  # at least at the right step count, so the run ends where it should
            return
        load_scheduler_tree(self.scheduler, self.optimizer, tree)


def optim_kind(cfg: Config, opt: Optimizer, given: OwnOptimizer | None) -> str:
    """The optimizer as the memory model counts its state (observe/memory.py OPTIM_STATES): optim.name, or for an
    optimizer given to fit() SGD's one buffer per parameter, or Adam's two for any other."""
    if given is None:
        return cfg.optim.name
    return "sgd" if isinstance(opt, torch.optim.SGD) else "adamw"


def own_optimizer(given: OwnOptimizer, module: nn.Module, built: bool) -> Optimizer:
    """fit(optimizer=...) checked against the model: an optimizer of this model's parameters that has not
    stepped, or a function of them that returns one (called here, on the bare model, to check a checkpoint
    against; the session calls it again on the parameters of the model it wraps). ``built``: fit() built the
    model itself (given its class), so no optimizer made before can hold its parameters."""
    if isinstance(given, Optimizer):
        if built:
            raise UserError("fit(optimizer=...): the optimizer was built before fit() built the model (given as its "
                            "class), so it holds another model's parameters; fix: optimizer=lambda params: "
                            f"torch.optim.{type(given).__name__}(params, ...)")
        opt = given
    elif callable(given):
        opt = given([p for p in module.parameters() if p.requires_grad])
        if not isinstance(opt, Optimizer):
            raise UserError(f"fit(optimizer=...): the function given returned a {type(opt).__name__}, not a torch "
                            "optimizer; fix: optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)")
    else:
        raise UserError(f"fit(optimizer=...): a {type(given).__name__} is neither a torch optimizer nor a function "
                        "of the parameters returning one; fix: optimizer=lambda params: torch.optim.AdamW(params, "
                        "lr=3e-4)")
    from scaletrain.train.session import check_optimizer

    check_optimizer(opt, module, who="fit(optimizer=...)",
                    foreign="that are not the model's; fix: build it on the model given to fit() "
                            "(torch.optim.AdamW(model.parameters())), or pass a function of the parameters",
                    stepped="give fit() a new one (its checkpoints keep the optimizer's state from then on)")
    return opt


def own_scheduler(given: OwnScheduler, optimizer: Optimizer) -> LRScheduler:
    """fit(scheduler=...): one built on the optimizer given to fit(), or a function of the optimizer returning
    one (called here, once the optimizer is set up and restored), stepped after every optimizer step."""
    sched = given if isinstance(given, LRScheduler) else None  # ReduceLROnPlateau is one too (torch >= 2.2)
    if sched is None:
        if not callable(given):
            raise UserError(f"fit(scheduler=...): a {type(given).__name__} is neither an LR scheduler nor a function "
                            "of the optimizer returning one; fix: scheduler=lambda opt: "
                            "torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)")
        sched = given(optimizer)
    if isinstance(sched, ReduceLROnPlateau):
        raise UserError("fit(scheduler=...): ReduceLROnPlateau steps on a metric, which fit() does not pass it; fix: "
                        "a schedule of steps (CosineAnnealingLR, OneCycleLR, LambdaLR, or scaletrain's own: "
                        "--schedule.warmup_steps, --schedule.decay), or a loop of your own with scaletrain.session()")
    if not isinstance(sched, LRScheduler):
        raise UserError(f"fit(scheduler=...): the function given returned a {type(sched).__name__}, not an LR "
                        "scheduler; fix: scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, "
                        "T_max=1000)")
    if sched.optimizer is not optimizer:
        raise UserError("fit(scheduler=...): the scheduler drives another optimizer than the one fit() trains with; "
                        "fix: build it on the optimizer given to fit(optimizer=...), or pass a function of the "
                        "optimizer (scheduler=lambda opt: ...)")
    return sched


def train_step(job: Job, batches: Iterator[Any]) -> torch.Tensor:
    """One optimizer step over accum_steps micro-batches, inside ``with job.st.step():``; returns the step's
    mean loss on the device (logged as ``loss``). The session times the phases, watches the loss and the
    gradient norm, clips, steps through the loss scaler and decides when to log and save. Under parallel.pp > 1
    each of them runs through the pipeline (its stages split it into parallel.microbatches)."""
    st = job.st
    assert st is not None and job.scheduler is not None
    step_loss = _token_mean_step(job, batches) if job.token_mean else _micro_batch_step(job, batches)
    st.optimizer_step(job.optimizer)
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    st.log(loss=step_loss)
    return step_loss


def _micro_batch_step(job: Job, batches: Iterator[Any]) -> torch.Tensor:
    """The step's forwards and backwards, each micro-batch's loss its own mean over accum_steps; their sum."""
    st, model, accum = job.st, job.model, job.plan.accum_steps
    assert st is not None and model is not None
    step_loss = torch.zeros((), device=st.device)
    for micro in range(accum):
        batch = job.batcher(next(batches)).to(st.device)
        last = micro == accum - 1
        if job.pipeline is not None:  # every stage is given the batch: the first reads its inputs, the last its target
            with st.autocast(), loss_context(job.module):
                loss = st.pipeline_step(job.pipeline, batch.pipeline_inputs(), batch.target, sync=last) / accum
        else:  # only the last micro-step all-reduces (or reduce-scatters) gradients; the others accumulate locally
            with gradient_sync(model, last), loss_context(job.module):  # logits split by vocabulary: their loss
                with st.autocast():
                    loss = job.loss_fn(batch(model), batch.target) / accum
                st.backward(loss)
        step_loss += plain(loss.detach())
    return step_loss


def _token_mean_step(job: Job, batches: Iterator[Any]) -> torch.Tensor:
    """train.loss_mean=tokens: the step's micro-batches drawn first and their counted targets summed over the
    micro-batches and the data-parallel ranks (one all-reduce, on the device: no host sync); each micro-batch's
    loss is then its sum over its targets divided by this rank's share of that count, so that the gradients,
    averaged over the ranks as DDP and FSDP average them, are those of the whole step's targets at once."""
    import torch.distributed as dist

    st, model, accum, layout = job.st, job.model, job.plan.accum_steps, job.layout
    assert st is not None and model is not None
    micro = [job.batcher(next(batches)).to(st.device) for _ in range(accum)]
    total = torch.stack([b.counted() for b in micro]).sum()
    if st.world_size > 1:
        if not layout.reads(st.rank):  # a tensor-parallel peer reads its group's batch: counted once
            total = total * 0
        dist.all_reduce(total)
    share = total.clamp(min=1.0) / layout.dp_size
    step_loss = torch.zeros((), device=st.device)
    for i, batch in enumerate(micro):
        with gradient_sync(model, i == accum - 1), loss_context(job.module):
            with st.autocast():
                if job.token_loss is None:  # the model's own, given the count (transformers' num_items_in_batch)
                    loss = loss_of(batch(model, num_items_in_batch=share), in_tuple=True)
                else:
                    loss = job.token_loss(batch(model), batch.target) / share
            st.backward(loss)
        step_loss += plain(loss.detach())
    return step_loss


def _token_loss(cfg: Config, module: nn.Module, one: Batch, layout: Layout, *, user_loss: bool,
                deferred: bool) -> LossFn | None:
    """train.loss_mean=tokens, checked: scaletrain's cross-entropy summed over its targets, or None for a model
    whose own loss takes num_items_in_batch (and divides by it: checked on the first sample). One line for a
    loss of one's own, a pipeline, targets that are not class ids, and a model's loss that takes no count."""
    def refuse(expected: str, fix: str = "--train.loss_mean=micro_batch") -> ConfigError:
        return ConfigError("train.loss_mean", "tokens", expected, fix)

    if user_loss:
        raise refuse("micro_batch with a loss_fn of your own (it returns its own mean, which scaletrain cannot "
                     "weigh by its targets)", "--train.loss_mean=micro_batch, or leave the loss to scaletrain")
    if layout.pp > 1:
        raise refuse("micro_batch under pipeline parallelism (its stages average the micro-batches they split)")
    target = one.target
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        raise refuse("micro_batch for targets that are not class ids (it counts the targets of a cross-entropy)")
    if not one.target_given():
        return functools.partial(default_loss, reduction="sum")
    name = type(module).__name__
    params = inspect.signature(module.forward).parameters
    if "num_items_in_batch" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise refuse(f"micro_batch for a {name}: it computes its own loss, and its forward takes no "
                     "num_items_in_batch to divide its sum by", "--train.loss_mean=micro_batch" + (
                         ", or --model.loss=standard (scaletrain's cross-entropy)" if isinstance(module, GPT) else ""))
    if not deferred:
        training = module.training
        module.eval()  # no dropout: the two forwards differ by the count alone (and draw no random numbers)
        try:
            with torch.no_grad():
                losses = [loss_of(one(module, num_items_in_batch=torch.tensor(n, device=target.device)),
                                  in_tuple=True) for n in (1.0, 2.0)]
        finally:
            module.train(training)
        if any(x is None for x in losses) or not torch.allclose(losses[0], 2 * losses[1], rtol=1e-3):
            raise refuse(f"micro_batch for a {name}: its own loss does not divide its sum by the "
                         "num_items_in_batch it is given")
    return None


def batches_of(job: Job) -> Iterator[Any]:
    """The job's loader, epoch after epoch."""
    assert job.loader is not None
    while True:
        yield from job.loader


def build_optimizer(params: Iterable[nn.Parameter], cfg: OptimConfig, lr: float, *,
                    sparse: bool = False) -> Optimizer:
    """Weight decay on matrices and embeddings only, never on biases and norm gains (GPT-2's rule). ``sparse``:
    some gradients are sparse (guard.sparse_gradient_modules), which the fused kernels do not take."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    # Fused kernels: faster, and they skip a non-finite step on the device (train/guard.py) without a sync.
    # torch has no sharding rule for fused SGD on DTensors (FSDP): there the guard falls back to a host check.
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) and not (
        cfg.name == "sgd" and any(is_dtensor(p) for p in params)) and not sparse
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, fused=fused)
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), fused=fused)


ModelArg = nn.Module | Callable[[], nn.Module] | None


def _default_loss(train: TrainConfig, own_in_tuple: bool) -> LossFn:
    """The built-in loss, compiled with the model when train.compile is on: eager, the cross-entropy upcasts
    the bf16 logits to an fp32 copy and writes an fp32 log-softmax beside it; compiled, one fused pass. A
    loss the user gives is left as given. ``own_in_tuple``: the model is given its targets, so the loss it
    returns in a tuple is its own (batch.loss_of): nanoGPT's label smoothing or ignore_index=-1 is kept."""
    loss = functools.partial(default_loss, own_in_tuple=True) if own_in_tuple else default_loss
    return torch.compile(loss, mode=train.compile_mode) if train.compile else loss


def _split_before_filled(cfg: Config, world_size: int, nnodes: int) -> bool:
    """Whether the built-in model is built on the meta device and given memory and weights only once split
    (models/init.py materialize, in Session.setup): under FSDP/HSDP, tensor or pipeline parallelism a rank
    holds a part of it, and the whole need not fit one device or the host. Not for parallel.strategy=auto,
    which measures the whole model on the device to decide, nor with memory.cpu_offload (FSDP keeps the
    offloaded shards in pinned host memory it allocates itself when it shards a model that has memory)."""
    if cfg.parallel.strategy == "auto" or cfg.model.name not in ("gpt", "llama") or cfg.memory.cpu_offload:
        return False
    layout = resolve_layout(cfg.parallel, cfg.memory, world_size, nnodes)
    return layout.sharded or layout.tp > 1 or layout.pp > 1


def _first_forward(module: nn.Module, one: Batch, seen: Callable[[Any, Batch], None] | None = None) \
        -> tuple[float, tuple[str, ...]]:
    """flops_per_sample(): the model's first forward and backward, on a batch of one training sample (its output
    shown to ``seen``). Data in float64 (numpy's default) meeting float32 parameters fails there with torch's
    dtype error from deep inside the model, as do integer features meeting a first Linear: said in one line as
    what it is, a property of the data, with the fix; so is a model made bf16, fp16 or float64 meeting float32
    data. Any other error is the user's code's own, traceback and all. Samples whose items the model's forward
    cannot take (a third item, a sample weight, passed as a second input to a forward of one) are one line too,
    before the call: it was torch's TypeError at the first step.

    Also returns the names of the parameters that require a gradient and got none. The modules with parameters
    whose forward did not run (a mixture of experts' experts no token went to) are marked idle for find_units:
    a unit that some ranks' batches do not run would gather its parameters on the others only."""
    _check_arity(module, one)
    ran: set[int] = set()
    got: set[int] = set()
    trained = [p for p in module.parameters() if p.requires_grad]
    hooks = [m.register_forward_pre_hook(lambda m, _: ran.add(id(m))) for m in module.modules()] + \
        [p.register_post_accumulate_grad_hook(lambda p: got.add(id(p))) for p in trained]
    try:
        flops = flops_per_sample(module, one, seen)
    except RuntimeError as err:
        _first_forward_failed(module, one, err)
        raise
    finally:
        for hook in hooks:
            hook.remove()
    if not ran:  # the model states its FLOPs (scaletrain's own): nothing ran
        return flops, ()
    mark_idle(m for m in module.modules() if id(m) not in ran and any(True for _ in m.parameters(recurse=False)))
    return flops, tuple(name for name, p in module.named_parameters() if p.requires_grad and id(p) not in got)


def _first_forward_failed(module: nn.Module, one: Batch, err: RuntimeError) -> None:
    """Raises the one line for a first forward that failed on the data's or the model's dtype (see
    _first_forward); returns for any other error, the user's code's own."""
    params = {p.dtype for p in module.parameters() if p.is_floating_point()}
    inputs = list(leaves((one.args, one.kwargs)))
    doubles = any(t.dtype == torch.float64 for t in inputs) and torch.float64 not in params
    ints = next((t.dtype for t in inputs if not t.is_floating_point() and t.dtype != torch.bool), None)
    said = said_of(err)
    mismatch = "dtype" in said.lower() or "scalar type" in said
    halves = params & {torch.bfloat16, torch.float16}
    if halves and mismatch and any(t.dtype == torch.float32 for t in inputs):  # model.to(torch.bfloat16)
        half = str(min(halves, key=str)).removeprefix("torch.")
        raise UserError(f"model: its first forward failed ({said}): its parameters are {half} and the inputs "
                        f"float32; fix: keep the model in float32 and train with --train.precision="
                        f"{'bf16' if half == 'bfloat16' else 'fp16'}-mixed ({half} compute, float32 weights "
                        f"and optimizer state: the updates too small for {half} are not lost)") from err
    if mismatch and torch.float64 in params and any(t.dtype == torch.float32 for t in inputs):  # .double()
        raise UserError(f"model: its first forward failed ({said}): its parameters are float64 and the inputs "
                        "float32; fix: keep the model in float32 (drop its .double() or .to(torch.float64)), or "
                        "make the data float64 too (x.double(), numpy's default)") from err
    if not params or not (doubles or (ints is not None and mismatch)):
        return
    dtype = str(min(params, key=str)).removeprefix("torch.")
    if doubles:
        raise UserError(f"data: the model's first forward failed ({said}): the samples hold float64 tensors "
                        f"(numpy's default) and the model's parameters are {dtype}; fix: make the data {dtype} "
                        f"(x.astype(np.float32), or .float() in the Dataset's __getitem__)") from err
    held = str(ints).removeprefix("torch.")
    raise UserError(f"data: the model's first forward failed ({said}): the inputs hold {held} tensors and the "
                    f"model's parameters are {dtype}; fix: make the features {dtype} (x.astype(np.float32), or "
                    ".float() in the Dataset's __getitem__); token ids go through an nn.Embedding first") from err


def _check_arity(module: nn.Module, one: Batch) -> None:
    """A UserError where forward's signature cannot bind the inputs a sample gives (see _first_forward)."""
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):  # a builtin or C forward: no signature to read
        return
    try:
        signature.bind(*one.args, **one.kwargs)
    except TypeError as err:
        gives = [f"{len(one.args)} positional input{'s' * (len(one.args) != 1)}"] if one.args or not one.kwargs else []
        gives += [f"the keys {', '.join(one.kwargs)}"] if one.kwargs else []
        items = " (a sample's items but the last, which is the target)" if one.args and one.target is not None else ""
        forward = f"{type(module).__name__}.forward({', '.join(signature.parameters)})"
        raise UserError(f"model: {forward} cannot take what each sample gives it: {' and '.join(gives)}"
                        f"{items}: {err}; fix: samples of (inputs..., target) as forward takes "
                        "them, or batch_fn=lambda batch: (inputs, target) to pick them from each batch (a sample of "
                        "(x, weight, y): batch_fn=lambda b: (b[0], b[-1]))") from None


def name_of(given: Any) -> str:
    """What a one-line error calls a function or class the user gave (a model builder, a loss_fn)."""
    return getattr(given, "__name__", type(given).__name__)


def builder(model: Callable[[], nn.Module], *, instead: str = "an instance") -> Callable[[], nn.Module]:
    """A model given as a class or a function, as fit() and scaletrain.plan_fit() take it, checked and made a function
    of no arguments that returns the module. One that needs arguments is one line naming them (a class whose
    __init__ takes sizes, passed instead of ``instead``), and so is one that returns no module."""
    name = name_of(model)
    if not callable(model):
        raise UserError(f"model: a {type(model).__name__} is neither a torch.nn.Module nor a function that builds one; "
                        "fix: pass its class, or a function of no arguments that returns it")
    try:
        inspect.signature(model).bind()
    except TypeError as err:
        raise UserError(f"model: {name}() is called with no arguments to build the model, and {err}; fix: pass "
                        f"{instead} ({name}(...)) or a function that builds one (lambda: {name}(...))") from None
    except ValueError:  # no signature to read (a builtin): call it and see
        pass

    def build() -> nn.Module:
        built = model()
        if not isinstance(built, nn.Module):
            raise UserError(f"model: {name}() returned a {type(built).__name__}, not a torch.nn.Module; fix: pass "
                            "its class, or a function that returns it")
        return built

    return build


def checked_loss(loss_fn: LossFn) -> LossFn:
    """The user's loss, called as loss_fn(output, target): a function that cannot take two arguments is said at
    once, and what it returns must be one number the step can backpropagate (a tensor of shape (), checked on
    the host: no sync)."""
    name = name_of(loss_fn)
    if not callable(loss_fn):
        raise UserError(f"loss_fn: a {type(loss_fn).__name__} is not callable; fix: pass a function "
                        "loss_fn(output, target) -> a scalar tensor")
    try:
        inspect.signature(loss_fn).bind(None, None)
    except TypeError as err:
        raise UserError(f"loss_fn: scaletrain calls loss_fn(output, target), and {name} cannot take that ({err}); "
                        "fix: def loss_fn(output, target): ... (the target is None when the batch has none)") from None
    except ValueError:
        pass

    @functools.wraps(loss_fn)
    def checked(output: Any, target: Any) -> torch.Tensor:
        loss = loss_fn(output, target)
        if not isinstance(loss, torch.Tensor):
            fix = ("return the loss tensor alone (held-out measures of the output go to fit(metrics={...}))"
                   if isinstance(loss, (tuple, list, dict)) else
                   "return the loss as a tensor (no float(), .item() or .tolist())")
            raise UserError(f"loss_fn: {name} returned a {type(loss).__name__}, not a tensor; the step backpropagates "
                            f"from it; fix: {fix}")
        if loss.numel() != 1:
            raise UserError(f"loss_fn: {name} returned a tensor of shape {tuple(loss.shape)}, not one number; fix: "
                            "reduce it to its mean (reduction='mean', the default, or .mean())")
        if torch.is_grad_enabled() and not loss.requires_grad:  # training (evaluation runs without gradients)
            raise UserError(f"loss_fn: {name} returned a loss without a gradient ({str(loss.dtype).removeprefix('torch.')}"
                            "): nothing differentiable leads from the model's output to it (an argmax, a "
                            "comparison or a count, .detach() or torch.no_grad() cut the way); fix: compute it from "
                            "the output's floating-point values (the cross-entropy of the logits, not the accuracy)")
        return loss

    return checked


def _probe_shift(output: Any, target: Any, loss_fn: LossFn | None, own_in_tuple: bool,
                 device: torch.device) -> int | None:
    """batch.label_shift of the loss the run will train on, read on the first forward's output: the model's own
    (a transformers model given labels, nanoGPT's tuple) or the user's loss_fn, called once more here (no
    gradient, its random numbers put back). None where scaletrain's own cross-entropy scores the logits (it
    aligns them itself) or nothing can be told."""
    if loss_fn is None:
        return label_shift(output, target, loss_of(output, in_tuple=own_in_tuple))
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            given = loss_fn(output, target)
    except Exception:  # noqa: BLE001 -- the first step calls it again, and says what is wrong in its own words
        return None
    return label_shift(output, target, given) if isinstance(given, torch.Tensor) else None


def _targets_in_memory(data: Any) -> torch.Tensor | None:
    """Every target of training data given as tensors ((inputs, targets) to fit(), held-out split or not)."""
    while isinstance(data, torch.utils.data.Subset):
        data = data.dataset
    return data.targets if isinstance(data, TensorPairs) else None


def build_job(cfg: Config, rt: Runtime, splits: Splits, model: ModelArg = None,
              loss_fn: LossFn | None = None, resume: dict[str, Any] | None = None,
              batch_fn: BatchFn | None = None, optimizer: OwnOptimizer | None = None,
              scheduler: OwnScheduler | None = None, metrics: Mapping[str, Metric] | None = None) -> Job:
    """``model``: None (the built-in model the config names), a module, or a callable building one (a class
    works): a callable is called after seeding, so run.seed decides the initial weights. ``resume``: the
    metadata of the checkpoint the job will continue from (its global batch and position shape the plan).
    ``batch_fn``: maps a loader batch to (inputs, target) where scaletrain.batch's convention does not fit.
    ``optimizer``, ``scheduler``: the user's (fit()'s), in place of the optim.* and schedule.* keys.
    ``metrics``: fit()'s, measured at each evaluation beside the loss."""
    metrics = checked_metrics(metrics)
    monitor_mode(cfg.train, metrics)
    best_is = "the best checkpoint is the one of the lowest held-out loss"
    held_out = {"train.early_stop": (cfg.train.early_stop, "0", "it stops on the held-out loss"),
                "checkpoint.best": (cfg.checkpoint.best, "false", best_is)}
    cause, refill = ("a stream", "") if isinstance(splits.train, IterableDataset) else \
        ("data.val_fraction = 0", ", --data.val_fraction=0.1")
    for key, (value, off, why) in held_out.items():
        if value and splits.eval is None:
            raise ConfigError(key, value, f"{off} for training data without a held-out split ({cause}): {why}",
                              f"eval_data=... (a list of held-out samples){refill}, or --{key}={off}")
    if cfg.checkpoint.load_best and not cfg.checkpoint.best:
        raise ConfigError("checkpoint.load_best", True, "false without checkpoint.best (no checkpoint is kept as the "
                          "best to load)", "--checkpoint.best=true as well")
    if scheduler is not None and cfg.optim.scale_lr:
        raise UserError("optim.scale_lr = true: the linear scaling rule scales the lr of scaletrain's schedule, and "
                        "fit() was given a scheduler of its own; fix: --optim.scale_lr=false, and scale the lr you "
                        "give the optimizer (lr x global batch / base batch)")
    # Once, with the strategy as given; again below only if auto resolves to another one (a sharded layout
    # refuses fp16).
    check_precision(cfg.train.precision, rt.device, cfg.parallel.strategy)
    set_tf32(cfg.train.tf32, rt.device)
    set_attention(cfg.train.attention, rt.device)
    plan = plan_batches(cfg, rt.world_size, train_size(splits.train), resume)
    check_pipeline(cfg.parallel, plan.batch_size)  # fit() too: its micro-batches split the batch evenly
    set_deterministic(cfg.train.deterministic)
    seed_all(cfg.run.seed)  # the same initial weights on every rank
    nnodes = max(1, rt.world_size // rt.local_world_size)
    deferred = model is None and _split_before_filled(cfg, rt.world_size, nnodes)
    given_mode, build = None, None
    if model is None:
        with torch.device("meta") if deferred else contextlib.nullcontext():
            module = build_model(cfg.model, splits.task, splits.info)
    else:
        build = None if isinstance(model, nn.Module) else builder(model)
        module, given_mode = uncompiled(model if build is None else build())
        sharded_parts(module)  # parts of a model sharded before, in a model that is not: one line, before its forward
    if not deferred:
        refuse_unfilled(module)
        refuse_sync_batchnorm(module, rt.device, rt.world_size)
        module.to(rt.device)
    # The built-in GPT with model.loss=fused computes its loss in forward: it is given the targets too.
    batcher = Batcher(module, batch_fn, target_kwarg="targets" if isinstance(module, GPT) and module.fused_loss else None)
    one = one_sample(batcher, splits.train, splits.collate_fn)  # a batch of one sample, as the loader collates it
    # counted once, before any wrapping (on the meta device for a model built there: shapes are all it needs)
    own_in_tuple = one.target_given() and batcher.target_kwarg is None  # a user's model given its targets
    check = None if loss_fn is not None else functools.partial(  # the default loss: are these its kind of targets?
        check_targets, target=one.target, own_in_tuple=own_in_tuple, targets=_targets_in_memory(splits.train))
    shifts: list[int | None] = []

    def seen(output: Any, ran: Batch) -> None:
        if check is not None:
            check(output)
        shifts.append(_probe_shift(output, ran.target, loss_fn, own_in_tuple, rt.device))

    # parameters that got no gradient from it: FSDP then reduce-scatters zeros for them
    flops, unused = _first_forward(module, one.to(torch.device("meta") if deferred else rt.device), seen)
    if optimizer is None:
        sparse = sparse_gradient_modules(module)
        if sparse and cfg.optim.name == "adamw":
            raise ConfigError("optim.name", "adamw", f"an optimizer that takes sparse gradients, which "
                              f"{', '.join(sparse)} gives", "--optim.name=sgd, sparse=False on the embedding, or "
                              "fit(optimizer=...) with torch.optim.SparseAdam for its parameters")
        if sparse and cfg.optim.weight_decay > 0:  # torch's SGD: "add(sparse, dense) is not supported"
            raise ConfigError("optim.weight_decay", cfg.optim.weight_decay, f"0 with sparse gradients, which "
                              f"{', '.join(sparse)} gives (SGD cannot decay them)", "--optim.weight_decay=0, or "
                              "sparse=False on the embedding")
        opt, peaks = build_optimizer(module.parameters(), cfg.optim, plan.peak_lr, sparse=bool(sparse)), []
    else:  # its lr per group as given (a scheduler built on it already moved "lr" and kept it as "initial_lr")
        opt = own_optimizer(optimizer, module, built=build is not None)
        peaks = [float(g.get("initial_lr", g["lr"])) for g in opt.param_groups]
    if isinstance(scheduler, LRScheduler):  # one built already: checked now, before the run starts
        own_scheduler(scheduler, opt)
    loss = checked_loss(loss_fn) if loss_fn else _default_loss(cfg.train, own_in_tuple)
    strategy, reason = resolve_strategy(module, cfg.parallel, world_size=rt.world_size, nnodes=nnodes,
                                        precision=cfg.train.precision, optimizer=optim_kind(cfg, opt, optimizer),
                                        sample=one if cfg.parallel.strategy == "auto" else None,
                                        batch_size=plan.batch_size, cpu_offload=cfg.memory.cpu_offload,
                                        **({"loss_fn": loss} if loss_fn else {}))
    if strategy != cfg.parallel.strategy:
        check_precision(cfg.train.precision, rt.device, strategy)
    layout = resolve_layout(cfg.parallel, cfg.memory, rt.world_size, nnodes, strategy=strategy)  # once, read below
    if isinstance(optimizer, Optimizer) and layout.pp > 1:
        raise UserError(f"fit(optimizer=...): with parallel.pp = {layout.pp} each rank trains its stage of the model, "
                        "with an optimizer of that stage's parameters, which one built on the whole model is not; fix: "
                        f"optimizer=lambda params: torch.optim.{type(optimizer).__name__}(params, ...)")
    token_loss = _token_loss(cfg, module, one.to(torch.device("meta") if deferred else rt.device), layout,
                             user_loss=loss_fn is not None, deferred=deferred) \
        if cfg.train.loss_mean == "tokens" else None
    if token_loss is not None and cfg.train.compile:
        token_loss = torch.compile(token_loss, mode=cfg.train.compile_mode)
    return Job(cfg, rt, plan, module, opt, splits.train, splits.eval, loss, batcher, layout, reason, flops=flops,
               tokens_per_sample=one.tokens_per_sample(), params=sum(p.numel() for p in module.parameters()),
               trainable=sum(p.numel() for p in module.parameters() if p.requires_grad),
               model_name=type(module).__name__, given_mode=given_mode, collate_fn=splits.collate_fn,
               worker_init_fn=splits.worker_init_fn,
               user_loss=loss_fn is not None, first=one, build=build, own_optimizer=optimizer,
               own_scheduler=scheduler, peak_lrs=peaks, metrics=metrics, token_loss=token_loss,
               label_shift=shifts[0] if shifts else None, unused=unused)
