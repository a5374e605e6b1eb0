"""``scaletrain.session()``: a training loop of your own, with scaletrain's data parallelism, exact resume,
metrics, stragglers and preemption. You write forward, backward and the optimizer steps; the session does the
rest::

    with scaletrain.session({"train.max_steps": 2000, "checkpoint.every": 200}) as st:
        G, opt_g = st.setup(Generator(), make_opt_g)      # wrapped for the layout (DDP here), restored on resume
        D, opt_d = st.setup(Discriminator(), make_opt_d)
        sched = st.track(LambdaLR(opt_g, warmup))          # anything with state_dict(): in the checkpoints too
        loader = st.loader(dataset, batch_size=64)         # this rank's shard, batches on the device, resumable
        while not st.done:
            for real in loader:
                with st.step():                            # phase times, stragglers, preemption, checkpoints
                    ...
                    st.backward(loss_d); opt_d.step(); opt_d.zero_grad()
                    ...
                    st.backward(loss_g); opt_g.step(); opt_g.zero_grad()
                    st.log(loss_d=loss_d, loss_g=loss_g)
                if st.done:
                    break

Create the session first and build the models after it: it seeds every rank alike (run.seed), so the initial
weights agree; at the first step each rank switches to seed + rank (dropout differs per rank) or, on resume,
to its saved RNG. An optimizer is given as a function of the parameters (``lambda params: Adam(params)``) or
as an optimizer built on the model's parameters. A checkpoint holds every model and optimizer set up, every
loader's position, the step, every rank's RNG and the running metric sums: a resumed run continues bit for bit.
The same file runs under ``python``, ``torchrun`` and ``scaletrain launch``. ``st.cfg`` is the resolved config
(defaults < the config given < argv), for the loop's own knobs; ``st.steps`` the steps completed;
``st.last_metrics`` the last logged means (over the finite values logged in the interval, on every rank).

``scaletrain train`` and ``fit()`` are a loop on a session too (train/run.py: ``with st.step():
train_step(job, batches)``): one trainer, whose log records (epoch, the logged means, lr, samples/s and
tokens/s, MFU where the model's FLOPs are known, phase times per rank, memory) and summary (steady-state
throughput, the goodput account, the bottleneck, stragglers) are the same for both; set ``st.flops_per_sample``
(the model's FLOPs per training sample, forward and backward) for MFU in them. A session of one model
with one optimizer writes its checkpoints as fit() does, by the model's own parameter names (``scaletrain
checkpoint export`` reads them); with more, every model and optimizer is under its name.

FSDP (``--parallel.strategy=fsdp`` or ``hsdp``): every model set up is sharded per block (parallel/units.py)
and its optimizers are built on (or moved to) the sharded parameters; the checkpoint is one DCP checkpoint
holding every model and optimizer under the model's name: a DDP checkpoint resumes under FSDP and a DCP one
under DDP, each loading the saved step exactly. At another world size too: DCP reshards the state, the loaders
go on from the same place in the epoch (each rank's batch stays as given, so the global batch follows the world
size), and ranks the saving run did not have seed their RNG from run.seed + rank (tested: 2 ranks -> 1 -> 2).
What FSDP cannot do in a session: a second derivative through a sharded model (the GAN's R1 penalty: the
parameters it needs were freed after the first backward; st.backward says so in one line), and a model called
outside ``with st.step():`` gathers its shards collectively, so every rank must call it.

``with st.evaluating():`` around the loop's own evaluation between steps keeps its time out of the step times
and counts it as eval in the summary's goodput account, as fit()'s evaluations are.

``st.optimizer_step(opt)`` in place of ``opt.step()`` gives a loop of one's own what the trainer's step does:
gradient clipping (optim.grad_clip), the non-finite guard (a step whose gradient norm is NaN or infinite is
not applied, decided on the device by a fused optimizer; train.nonfinite=raise then stops at the next log step
naming the rank and step, =skip warns and goes on, holding back a non-fused optimizer's step at the cost of a
host sync per step, which raise does not pay) and fp16's loss scaling (train.precision=fp16-mixed, CUDA: st.backward scales
the loss, st.optimizer_step unscales and steps through a GradScaler, which is in the checkpoints). Under
fp16-mixed it is required: a bare ``opt.step()`` on scaled gradients is refused. A NaN or infinite loss passed
to st.backward() is named at the next log step whichever step the user calls.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import numbers
import os
import statistics
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    WeightedRandomSampler,
    default_collate,
)

from scaletrain import __version__, runtime
from scaletrain.batch import map_tensors, to_device, tokens_per_sample
from scaletrain.checkpoint import rng
from scaletrain.config import Config, load, step_window
from scaletrain.data import ShardedLoader, StreamLoader, Weighted
from scaletrain.data.loader import stop_workers
from scaletrain.errors import (
    CheckpointError,
    ConfigError,
    DiskFull,
    TrainingFailed,
    UserError,
    first_line,
    install_excepthook,
)
from scaletrain.layout import check_pipeline
from scaletrain.models.init import is_meta, materialize, refuse_sync_batchnorm, refuse_unfilled
from scaletrain.observe import flight
from scaletrain.observe.arrivals import Arrivals
from scaletrain.observe.console import Console
from scaletrain.observe.goodput import run_totals
from scaletrain.observe.memory import MemoryBreakdown, model_state_bytes, peak_bytes
from scaletrain.observe.metrics import MetricsWriter, write_json
from scaletrain.observe.noise_scale import PREFIX as NOISE_SUMS
from scaletrain.observe.noise_scale import GradProbe, NoiseScaleLog, attach_probe
from scaletrain.observe.profile import StepProfiler
from scaletrain.observe.stragglers import bottleneck, phase_fractions
from scaletrain.observe.throughput import device_peak, per_second, throughput
from scaletrain.observe.timeline import Timeline
from scaletrain.observe.timeline import merge as merge_timeline
from scaletrain.observe.timing import PHASES, NullTimer, StepTimer, attach_comm_hook, attach_forward_mark
from scaletrain.parallel import (
    Layout,
    gradient_twice,
    has_dtensors,
    is_fsdp,
    mixed_gradient_dtypes,
    parallelize,
    resolve_layout,
    set_gradient_sync,
    sharded_parts,
    uncompiled,
    units_line,
    unsharded_gradients,
    unused_parameters,
)
from scaletrain.parallel.pipeline import PipelineRunner, clip_with_norm, is_stage, stage_grad_norm
from scaletrain.runtime import Runtime
from scaletrain.sharded import is_dtensor, local_shard, plain
from scaletrain.train.chaos import Chaos
from scaletrain.train.checkpointing import (
    FORMAT_DCP,
    FORMAT_FULL,
    OPTIMIZER,
    OPTIMIZER_GROUPS,
    Checkpointer,
    Resume,
    describe_versions,
    find_resume,
    rank_file,
    read_model,
    read_trainer,
    read_tree,
)
from scaletrain.train.guard import NonFiniteGuard, clipped_norm, nonfinite_where, supports_device_skip
from scaletrain.train.interval import RankReport, gather
from scaletrain.train.precision import (
    autocast,
    autocast_forward,
    check_precision,
    grad_scaler,
    policy_casts,
    slow_here,
)
from scaletrain.train.preempt import Interrupted, Preempted, PreemptFlag, restart_line
from scaletrain.train.resume import load_dcp, load_full_into_sharded, model_misfit, saved_model_shapes
from scaletrain.train.rundir import agree_run_dir, release_run_dir
from scaletrain.train.services import WEIGHTS, RunServices, save_weights, write_outputs
from scaletrain.train.state import (
    dedupe,
    load_model_tensors,
    load_optimizer_tree,
    model_tensors,
    optimizer_tree,
    with_aliases,
)
from scaletrain.train.trace import TraceFile, digest

log = logging.getLogger(__name__)

OptimizerArg = Optimizer | Callable[[list[nn.Parameter]], Optimizer]


@dataclasses.dataclass
class _Model:
    name: str
    module: nn.Module  # the bare model: saving and restoring
    wrapped: nn.Module  # what the user calls: DDP-wrapped when the world is larger than 1
    optimizers: list[Optimizer]
    forwards: int = 0  # DDP: calls of ``wrapped`` since the last step ended (Session._through_ddp)
    unsynced: bool = False  # its last forward with gradients skipped their all-reduce (an accumulation's micro-batch)
    ends: list[nn.Parameter] = dataclasses.field(default_factory=list)  # its first and last trainable parameters
    first_step_hooks: list[Any] = dataclasses.field(default_factory=list)  # FSDP: Session._sharded_grads, once

    def __post_init__(self) -> None:  # a backward reaches one of them: the step's look for gradients costs two
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        self.ends = trainable[:1] + trainable[-1:]


def _ddp_sync_switches(wrapped: nn.Module) -> None:
    """DDP's switches for a loop's own gradient accumulation on a model DDP does not wrap (under FSDP, or one
    process's bare model): ``with model.no_sync():`` (DDP's idiom) and ``model.require_backward_grad_sync =
    False`` (nanoGPT's), each read at the next forward as DDP reads them; under FSDP the micro-batch's backward then
    keeps its gradients local and unsharded until a synchronized one reduce-scatters their sum
    (Session._sync_or_not), on one process there is nothing to synchronize. A DDP loop run with
    --parallel.strategy=fsdp, or as one process, stopped at its first micro-batch ("'FSDPSequential' object has no
    attribute 'no_sync'")."""
    if isinstance(wrapped, DDP) or hasattr(wrapped, "no_sync") or hasattr(wrapped, "require_backward_grad_sync"):
        return
    wrapped.require_backward_grad_sync = True

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        before = wrapped.require_backward_grad_sync
        wrapped.require_backward_grad_sync = False
        try:
            yield
        finally:
            wrapped.require_backward_grad_sync = before

    wrapped.no_sync = no_sync


@dataclasses.dataclass
class Opened:
    """What scaletrain train and fit() resolve before their session opens (train/run.py): the runtime, the console,
    the checkpoint chosen for the model they built (an older one where the newest does not fit it), the stop
    flag, the layout (auto resolved from the model) and when the run began."""
    rt: Runtime
    console: Console
    resume: Resume | None
    preempt: PreemptFlag
    layout: Layout
    started: float


def _as_session(trainer: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's trainer state in a session's terms. fit() before it ran on a session (scaletrain 0.x)
    saved one model, one loader and the LR schedule at the top level."""
    if "models" in trainer:
        return trainer
    return {**trainer, "models": ["model"], "loaders": [trainer["loader"]] if "loader" in trainer else [],
            "tracked": {"scheduler": trainer["scheduler"]} if "scheduler" in trainer else {}}


def _user_frame() -> types.FrameType | None:
    """The frame of the user's code that called into this session (the loop, its `with st.step()` or its
    `for batch in loader`), past scaletrain's own frames and contextlib's."""
    package = str(Path(__file__).resolve().parents[1]) + os.sep  # not a user's scaletrain_jobs/ beside it
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(package)
                                 or frame.f_code.co_filename == contextlib.__file__):
        frame = frame.f_back
    return frame


def _rank_as_session(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """A rank's saved state with the logged sums and their counts (name#n). fit() before sessions kept one
    running loss; sessions before counts logged every name every step (so the count is the steps)."""
    if state is None:
        return None
    sums = dict(state.get("sums", {}))
    if "loss_sum" in state:
        sums.update({"loss": state["loss_sum"], "loss#n": state["loss_count"]})
    for name in [k for k in sums if not k.endswith("#n") and not k.startswith(NOISE_SUMS)]:
        sums.setdefault(f"{name}#n", float(state.get("since", 0)))
    return {**state, "sums": sums}


def _bare(resume: Resume) -> bool:
    """Whether a checkpoint holds one model and one optimizer by their own names (the layout fit() writes, and
    a session of one model and one optimizer), not under the model's name."""
    return bool(resume.meta.get("bare")) or not resume.meta.get("session")


class Loader:
    """One rank's shard of a data set for a loop of one's own: ``for batch in loader`` is the rest of the
    current epoch (then the next epoch begins), every batch on the session's device, until the session is done.
    Resumable: its position is in the session's checkpoints, and a resumed run continues mid-epoch with the next
    unseen batch. Read inside session.evaluating(), it is one whole pass instead (every sample once over the
    ranks, as many batches on each; a stream from its start), and its position stays where training left it."""

    def __init__(self, session: Session, inner: ShardedLoader | StreamLoader, key: tuple[Any, ...] = (),
                 source: tuple[Any, ...] = ()) -> None:
        self._session, self.inner = session, inner
        self.key, self.source = key, source  # what st.loader() was given (Session.loader), held
        self.waited = 0.0  # seconds this rank waited for batches since the last step began
        self.drawn = 0  # batches handed out since the last step began
        self.tokens = 0  # their tokens (token-id batches: each batch's own width, padded batches of any length)
        self.stepped = 0  # training batches handed out by the end of the last step, this session
        self.since_step = 0  # training batches handed out since the last step ended (an accumulation's count)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self.inner.epoch

    def __len__(self) -> int:
        if self._session._evaluating and isinstance(self.inner, ShardedLoader):
            return len(self.inner.whole_pass_batches())  # an evaluation's pass: every sample once (__iter__)
        if isinstance(self.inner, StreamLoader):
            # TypeError, as a DataLoader over an IterableDataset raises: what tqdm and others catch for "no length"
            raise TypeError("len(loader): a stream's length is unknown until a pass of it ends; train for "
                            "train.max_steps steps (session.total_steps) rather than epochs")
        return self.inner.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        st = self._session
        if st._evaluating:
            # Read inside st.evaluating(): one whole pass, every sample once over the ranks and as many batches
            # on each (a collective forward, FSDP's, runs alike everywhere), the tail kept, the training position
            # untouched: the next evaluation sees the same samples, and a resume is as exact as without it. A
            # stream's too, read from its start.
            for batch in self.inner.whole_pass():
                yield to_device(batch, st.device)
            return
        batches = self.inner.epoch_batches()  # a generator: nothing moves until a batch is drawn
        while True:
            if st.done and not st._in_step:
                # train.max_steps steps ran: the epoch ends here, as a loop with no `if st.done: break` expects
                # (it trained on past the last step, "step 31/20", its schedule run out); nothing is drawn and no
                # epoch begun, so the position saved is where training stopped
                return
            st._start_training()  # the RNG is restored before anything can draw from it
            started = time.perf_counter()
            st.chaos.delay("data")
            try:
                batch = next(batches)
            except StopIteration:
                return
            waited = time.perf_counter() - started
            self.drawn += 1
            self.since_step += 1
            self.tokens += tokens_per_sample(batch) * self.inner.batch_size
            if st._trace is not None:
                st._trace.batch(batch, self.inner.last_indices)
            if st._in_step:  # drawn inside the step (micro-batches of an accumulation): its wait and copy
                st.timer.host("data", waited)
                batch = to_device(batch, st.device)
                st.timer.mark("h2d")
                yield batch
            else:  # before the step: st.step() counts the wait in the step it begins
                self.waited += waited
                yield to_device(batch, st.device)


def from_dataloader(given: DataLoader, batch_size: int, shuffle: bool | None,
                    collate_fn: Callable[[list[Any]], Any] | None, *,
                    who: str = "session.loader()") -> tuple[Any, int, bool | None, Any, int, Any]:
    """(dataset, batch size, shuffle, collate_fn, workers, worker_init_fn) of a DataLoader handed to
    session.loader() or fit(): what it was built with, each unless given to ``who`` itself. Its sampler says shuffle (random or in order; a
    DistributedSampler's own shuffle: the session shards anyway); a WeightedRandomSampler's weights, draws per
    epoch and replacement make the data set a Weighted one (drawn from run.seed, sharded and resumed as any);
    one that chooses samples another way (a subset, batches of its own making) cannot be sharded and resumed
    exactly: one line."""
    stream = isinstance(given.dataset, IterableDataset)
    batches = given.batch_sampler
    plain = type(batches) is BatchSampler  # batch_size=N makes one; so does BatchSampler(sampler, N) given
    sampler = batches.sampler if plain else given.sampler
    dataset = given.dataset
    if plain and isinstance(sampler, WeightedRandomSampler) and not stream:
        dataset = Weighted(dataset, sampler.weights, sampler.num_samples, sampler.replacement)
        shuffle = True if shuffle is None else shuffle
    elif not stream and not (plain and isinstance(sampler, (RandomSampler, SequentialSampler, DistributedSampler))):
        how = f"its sampler {type(sampler).__name__}" if plain else f"its batch_sampler {type(batches).__name__}" \
            if batches is not None else "no batches (batch_size=None)"
        as_given = "st.loader(loader.dataset, batch_size=..., " if who.startswith("session") else \
            "fit(model, loader.dataset, config={'data.batch_size': ...}, "
        raise UserError(f"{who}: a DataLoader reading {how} cannot be sharded over ranks and resumed exactly; fix: "
                        f"pass its dataset, as {as_given}collate_fn=loader.collate_fn), with any choice or "
                        "grouping of samples made in the dataset (weights: a WeightedRandomSampler is read)")
    if shuffle is None and not stream:
        shuffle = sampler.shuffle if isinstance(sampler, DistributedSampler) else isinstance(sampler, RandomSampler)
    size = batches.batch_size if plain else given.batch_size
    own = given.collate_fn if given.collate_fn is not default_collate else None  # torch's default: scaletrain's
    return dataset, batch_size or size or 0, shuffle, collate_fn or own, given.num_workers, given.worker_init_fn


def loaders_read(train_data: Any, eval_data: Any, collate_fn: Callable[[list[Any]], Any] | None) -> tuple[
        Any, Any, Callable[[list[Any]], Any] | None, dict[str, Any], Callable[[int], None] | None]:
    """DataLoaders given to fit() (and plan_fit()) (a script written for plain torch, or for Lightning's trainer.fit): their datasets,
    their collate_fn (unless fit() was given one), and their batch size, shuffle and workers as the defaults of
    data.batch_size, data.eval_batch_size, data.shuffle and data.num_workers (a config or the command line wins).
    The batch size is per rank, as the loader's was per process; the samples are sharded and resumed as any
    dataset's, reshuffled from run.seed. Last, the training loader's worker_init_fn (None without one)."""
    given: dict[str, Any] = {}
    init = None
    if isinstance(train_data, DataLoader):
        train_data, batch, shuffle, own, workers, init = from_dataloader(train_data, 0, None, None, who="fit()")
        given.update({"data.batch_size": batch, "data.num_workers": workers,
                      **({"data.shuffle": shuffle} if shuffle is not None else {})})
        collate_fn = collate_fn or own
    if isinstance(eval_data, DataLoader):
        eval_data, batch, _, own, _, _ = from_dataloader(eval_data, 0, False, None, who="fit(eval_data=...)")
        given["data.eval_batch_size"] = batch
        collate_fn = collate_fn or own
    return train_data, eval_data, collate_fn, given, init


class Session:
    """See the module docstring. Use it as a context manager (or call close()): closing waits for the last
    checkpoint, writes summary.json and the final weights, and ends the process group."""

    def __init__(self, config: Config | Mapping[str, Any] | str | None = None, *,
                 argv: list[str] | None = None, opened: Opened | None = None) -> None:
        self._opened = opened
        self.started = time.perf_counter() if opened is None else opened.started
        # scaletrain train and fit() hand over the config they resolved: the command line is in it already
        cfg = resolve_config(config, argv if opened is None else [], defaults={"run.name": "session"})
        if opened is None:  # scaletrain train and fit() checked it already
            check_workers(cfg)
        self.rt: Runtime = runtime.init(cfg.dist) if opened is None else opened.rt
        if opened is None:
            # A stop (preemption, Ctrl-C) or one of our errors leaving the user's script ends it as the CLI
            # does; installed after init_process_group, which wraps the hook it finds in one that buffers stderr.
            install_excepthook()
        self._closed, self._in_step, self._training, self._timing = False, False, False, False
        self._evaluating = False  # inside st.evaluating(): batches drawn are not training's
        self._restoring = False  # inside _restore(): DCP steps the optimizers once to build their state
        self._progress = {"steps": 0, "closed": False}  # what an unclosed session's warning at exit reads
        self._models: list[_Model] = []
        self._stage: nn.Module | None = None  # parallel.pp > 1: this rank's pipeline stage (the model set up)
        self._noise: NoiseScaleLog | None = None  # log.grad_noise_scale: the model's gradient noise scale
        self._arrivals: Arrivals | None = None  # tensor parallelism: when this rank issued its group's collectives
        self._tracked: dict[str, Any] = {}  # st.track(): name -> an object with state_dict()
        self._generators: dict[str, Any] = {}  # st.track() of random number generators: saved per rank
        self._restored_groups: dict[int, list[dict[str, Any]]] = {}  # id(optimizer) -> its groups as resumed
        self._loaders: list[Loader] = []
        self.held_loaders: list[DataLoader] = []  # the trainer's evaluation loaders: their workers stop at close
        self.preempt = opened.preempt if opened is not None else \
            PreemptFlag(f"[rank {self.rt.rank}] " if self.rt.world_size > 1 else "").install()
        self.services: RunServices | None = None  # run dir, metrics, checkpoints, stragglers, preemption
        self.writer = MetricsWriter(None)
        self.checkpointer: Checkpointer | None = None
        try:
            self._open(cfg)
        except BaseException:
            self._release()
            raise
        if opened is None and self.rt.is_main:  # a loop of one's own: its outputs are written by close()
            weakref.finalize(self, _never_closed, self._progress, cfg.run_dir)

    def _open(self, cfg: Config) -> None:
        rt, opened = self.rt, self._opened
        self._nnodes = max(1, rt.world_size // rt.local_world_size)
        self.chaos = Chaos(cfg.chaos, rt.rank, rt.world_size)  # first: a rank beyond the world writes nothing
        self.total_steps = cfg.train.max_steps  # 0: the loop decides when it is done
        self._closing = False  # close() has begun its final gathers
        # the caller holds the models set up (a loop's own; fit()'s when given built, not as a class): a sharded
        # one keeps the process group open past close() (runtime.close)
        self.caller_holds = True
        self.flops_per_sample = 0.0  # model FLOPs per training sample, where known: MFU in the records
        # the trainer's own cross-entropy on a built-in model under tensor parallelism: logits kept split
        # (parallel/tensor.py loss_context); a loop of one's own sees ordinary logits
        self.loss_parallel = False
        # train.compile, or a model was given as torch.compile(model) returned it: compiled the same way
        self.compiled = cfg.train.compile
        self.compile_mode = cfg.train.compile_mode
        self.skip: set[str] = cfg.debug.skipped()  # debug.skip_restore: parts a resume leaves as built
        if opened is not None:  # scaletrain train / fit(): the run resolved these before building its model
            self.layout: Layout | None = opened.layout
            self.cfg, self.console, self.resume = cfg, opened.console, opened.resume
        else:
            check_precision(cfg.train.precision, rt.device, cfg.parallel.strategy)  # fp16-mixed: CUDA, unsharded
            # The layout, once for every model set up (auto: per model, from its memory, in parallelize)
            self.layout = None if cfg.parallel.strategy == "auto" else \
                resolve_layout(cfg.parallel, cfg.memory, rt.world_size, self._nnodes)
            runtime.set_deterministic(cfg.train.deterministic)
            runtime.seed_all(cfg.run.seed)  # the models built next get the same initial weights on every rank
            self.cfg = cfg = agree_run_dir(cfg, rt)
            self.console = Console(rt.is_main, progress=cfg.train.progress and cfg.train.max_steps > 0)
            self.resume = find_resume(cfg.checkpoint, cfg.run_dir, rt,
                                      lambda m: self.console.print(f"warning: {m}"))
        self._trainer = _as_session(read_trainer(self.resume)) if self.resume else {}
        self._rank_state = _rank_as_session(self._read_rank_state())
        self.steps = int(self._trainer.get("step", 0))  # optimizer steps completed (st.step() blocks)
        self.train_time = float(self._trainer.get("train_time_s", 0.0))
        # samples drawn before this session: a resume at another global batch goes on counting from the saved count
        # (a checkpoint from before the count was saved: its steps at its own global batch)
        drawn = self._trainer.get("samples")
        if drawn is None and self.resume is not None:
            drawn = self.steps * int(self.resume.meta.get("global_batch", 0))
        self._drawn_before = int(drawn or 0)
        self.services = services = RunServices.open(cfg, rt, self.console, self.resume, started=self.started)
        self.writer, self.checkpointer = services.writer, services.checkpointer
        if self.layout is not None and self.layout.pp > 1:  # a stage's replicas are its straggler peers
            services.stragglers.peers = _stage_peers(self.layout)
        self.timer: StepTimer = StepTimer(rt.device) if cfg.log.phase_times or cfg.log.trace else NullTimer(rt.device)
        self._watcher = runtime.watch_for_failures(rt, cfg.run_dir, lambda: self.steps + 1)
        window = step_window(cfg.debug.profile)
        self._profiler = StepProfiler(cfg.run_dir, rt.rank, window, rt.device) if window else None
        if cfg.log.trace:  # every step's phases kept as spans: RUN_DIR/timeline.json at the end
            self.timer.timeline = Timeline(cfg.run_dir, rt.rank)
        self._sums: dict[str, torch.Tensor] = {}  # this rank's logged values since the last log step
        self._since = 0  # steps since the last log step (restored on resume: the logged sums span them)
        self._ran = 0  # of those, the steps this process ran (what the interval's time measures)
        self._samples = 0  # samples this rank drew from its loaders since the last log step
        self._tokens = 0  # of which tokens, where the samples are token ids
        self._seen = [0.0, 0.0]  # samples and tokens of every rank over the run's logged intervals
        self.scaler = grad_scaler(cfg.train.precision, rt.device)  # enabled under fp16-mixed only
        if self._trainer.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(self._trainer["scaler"])
        # Skipped steps (the same on every rank) and the first non-finite loss (this rank): decided on the device.
        self.guard = NonFiniteGuard(rt.device, scaler_owns_skips=self.scaler.is_enabled(), device_skip=False)
        if self._rank_state is not None and "guard" in self._rank_state:
            self.guard.load_state_dict(self._rank_state["guard"])
        self._skipped_seen = float(self.guard.skipped.item()) if self.resume is not None else 0.0
        self._bad_said = bool(self.guard.first_bad_loss.item() >= 0)  # said (skip) before the checkpoint
        self._scaled = False  # an optimizer stepped through the scaler in this step: update it at the end
        self._stepping: Optimizer | None = None  # the optimizer st.optimizer_step is stepping
        self._applied_bad_possible = False  # a non-fused optimizer stepped without a hold-back (raise mode)
        self._interval_started = self._first_step_at = time.perf_counter()
        self._records: list[dict[str, Any]] = []  # this process's log intervals (steady state, goodput)
        self._checkpoint_s = 0.0  # seconds the loop was blocked by saves
        self.best = self._best_before()  # the last save_best(): its step, record and checkpoint
        self._eval_s = 0.0  # seconds in st.evaluating()
        self._trace = _Trace(cfg.run_dir, rt.rank) if cfg.debug.trace else None
        self.last_metrics: dict[str, float] = {}
        self.last_mem: dict[str, Any] = {}  # the last log step's memory record
        self.summarize: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # adds to the summary at close
        self._eval_before = 0.0  # seconds evaluated before the first step (start-up's, counted as eval)
        self._state_bytes: MemoryBreakdown | None = None  # model state on this rank, counted after the first step
        self._lead_fracs: list[float] = []  # GPU: per log interval, the median rank's lead over its step time
        _, self._peak_flops = device_peak(rt.device, cfg.train.precision, tf32=cfg.train.tf32)
        if opened is None:  # scaletrain train / fit() say all of this in their own header
            self._say_opened()

    def _best_before(self) -> dict[str, Any] | None:
        """On resume, the best checkpoint so far: best.json's if it is not past the step resumed (a save at the step
        of a periodic one named it after that save), else the one the checkpoint's trainer state names."""
        from scaletrain.checkpoint import commit

        if self.resume is None:
            return None
        root = self.checkpointer.root
        marked = commit.read_best(root)
        if marked is not None and marked["step"] <= self.steps:
            return {**marked, "path": str(root / commit.step_name(marked["step"]))}
        return self._trainer.get("best")

    def _say_opened(self) -> None:
        rt, cfg = self.rt, self.cfg
        where = f"{rt.backend} on {rt.device}" if rt.distributed else f"single process on {rt.device}"
        self.console.print(f"scaletrain {__version__} session | world {rt.world_size} ({where}) | run dir "
                           f"{cfg.run_dir}")
        slow = slow_here(cfg.train.precision, rt.device)
        if slow:
            self.console.print(f"warning: {slow}")
        restarted = restart_line(rt, self.resume.step if self.resume else None)
        if restarted is not None:
            self.console.print(restarted)  # torchrun restarted the group: which worker failed, how, where
        if self.resume is not None:
            self.console.print(f"resumed from {self.resume.path}: step {self.steps}")
            was = int(self.resume.meta["world_size"])
            if was != rt.world_size:  # DCP reshards, the loaders keep their place in the epoch (global)
                self.console.print(f"resume: the checkpoint was made with {was} rank(s), this run has "
                                   f"{rt.world_size}: the loaders go on from the same place in the epoch"
                                   + ("; ranks without saved state seed their RNG from run.seed + rank"
                                      if rt.world_size > was else ""))
            self.writer.write({"kind": "resume", "step": self.steps, "path": str(self.resume.path),
                               "world_size_was": self.resume.meta["world_size"], "world_size": rt.world_size})

    # -- what the user sets up ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.rt.device

    @property
    def rank(self) -> int:
        return self.rt.rank

    @property
    def world_size(self) -> int:
        return self.rt.world_size

    @property
    def done(self) -> bool:
        """True once ``total_steps`` steps ran (train.max_steps; scaletrain train: the batch plan's steps);
        never when it is 0: the loop decides."""
        return 0 < self.total_steps <= self.steps

    def given_compiled(self, mode: str) -> None:
        """A model came as torch.compile(model, mode=...) returned it: compile it (scaletrain does, as train.compile
        does), in its mode unless train.compile_mode names one."""
        self.compiled = True
        if self.cfg.train.compile_mode == "default":
            self.compile_mode = mode

    def setup(self, model: nn.Module, *optimizers: OptimizerArg, name: str = "") -> tuple[Any, ...]:
        """Move ``model`` to the device, wrap it for the layout (DDP when the world is larger than 1), build or
        adopt its optimizers, and on resume restore both. Returns (the model to call, *the optimizers)."""
        self._usable("setup")
        if self._training:
            raise UserError("session.setup() after the first step; fix: set up every model and optimizer before "
                            "the loop starts")
        if not isinstance(model, nn.Module):
            raise UserError(f"session.setup(): the model is a {type(model).__name__}; fix: pass a torch.nn.Module")
        # torch.compile(model) given: its own module, compiled as train.compile does it (before DDP or FSDP wrap
        # it, block by block under FSDP), so checkpoints and weights carry the model's own names, not _orig_mod.*
        model, given_mode = uncompiled(model)
        if given_mode is not None:
            self.given_compiled(given_mode)
        if any(m.module is model for m in self._models):
            raise UserError(f"session.setup(): this {type(model).__name__} is set up already; fix: call setup() "
                            "once per model, with all of its optimizers")
        if not any(p.requires_grad for p in model.parameters()):
            raise UserError(f"session.setup(): {type(model).__name__} has no parameter that requires grad; fix: "
                            "set up the models you train")
        name = name or f"model{len(self._models)}"
        if any(m.name == name for m in self._models) or "." in name:
            raise UserError(f"session.setup(name={name!r}): names must be unique and without dots; fix: name="
                            f"'model{len(self._models)}'")
        refuse_sync_batchnorm(model, self.device, self.world_size)
        sharded_parts(model)
        if not is_meta(model):  # a built-in model built on the meta device gets its memory once split, below
            model.to(self.device)
            if self.world_size > 1 and not has_dtensors(model):
                _same_start(model, name)
        else:
            refuse_unfilled(model)
        given = [opt for opt in optimizers if isinstance(opt, Optimizer)]
        for opt in given:
            _check_optimizer(opt, model)
        if self.layout is not None and self.layout.pp > 1 and (given or self._models):
            raise UserError("session.setup() with parallel.pp > 1: a pipeline runs one model, whose optimizers are "
                            "built on this rank's stage; fix: set up one model, with its optimizer as a function "
                            "of the parameters (lambda params: torch.optim.AdamW(params))")
        names = {id(p): n for n, p in model.named_parameters()}
        cfg = self.cfg
        wrapped = parallelize(model, self.device, self.world_size, cfg.parallel, compile=self.compiled,
                              compile_mode=self.compile_mode,
                              precision=cfg.train.precision, memory=cfg.memory, nnodes=self._nnodes,
                              optimizer=cfg.optim.name, layout=self.layout, loss_parallel=self.loss_parallel)
        if is_stage(wrapped):  # pp > 1: this rank keeps its stage of the model (the model's names for its part)
            model = self._stage = wrapped
        if is_meta(model):  # its part only, now: the same weights as one process's model by name
            materialize(model, self.device)
            log.info("built on the meta device; this rank filled its part: %s parameters",
                     f"{sum(local_shard(p).numel() for p in model.parameters()):,}")
        if self.layout is not None and self.layout.tp > 1 and cfg.log.phase_times and self._arrivals is None:
            self._arrivals = _tp_arrivals(model, self.layout)
        if has_dtensors(wrapped):  # FSDP/TP replaced the parameters: an optimizer built before takes the new ones
            now = dict(model.named_parameters())
            for opt in given:
                for group in opt.param_groups:
                    group["params"] = [now[names[id(p)]] for p in group["params"]]
        params = [p for p in model.parameters() if p.requires_grad]
        built = [opt if isinstance(opt, Optimizer) else opt(params) for opt in optimizers]
        for opt in built:
            if opt not in given:  # built here from the function given: checked now
                _check_optimizer(opt, model)
        probe = self._noise_probe(wrapped, params) if cfg.log.grad_noise_scale else None
        timed = self.timer if cfg.log.phase_times or cfg.log.trace else None
        attach_comm_hook(wrapped, timed, overlap=cfg.parallel.overlap, probe=probe)
        attach_forward_mark(wrapped, timed)
        if self.layout is None:  # auto: decided by this model's memory; the strategy given was checked at open
            check_precision(cfg.train.precision, self.device, "fsdp" if is_fsdp(wrapped) else "ddp")
        if self.scaler.is_enabled():
            for opt in built:
                opt.register_step_pre_hook(self._unscaled_step)
        units = units_line(model, cfg.parallel.fsdp_units, sharded=is_fsdp(wrapped),
                           blocks=cfg.memory.activation_checkpointing != "none" or self.compiled)
        if units and self._opened is None:  # scaletrain train / fit() name the units in their header
            self.console.print(f"{name} ({type(model).__name__.removeprefix('FSDP')}): {units}")
        if self._opened is None and self._stage is None and not policy_casts(wrapped) and cfg.train.precision != "fp32":
            # A loop of one's own gets the run's precision without opening st.autocast() itself, as Accelerate's
            # and Lightning Fabric's set-up models do (bf16-mixed under DDP trained in fp32 silently before)
            autocast_forward(wrapped, self.autocast)
        entry = _Model(name, model, wrapped, built)
        for opt in built:  # forward and backward end where an optimizer steps, whether or not st.backward() ran
            opt.register_step_pre_hook(self._optimizer_starting)
            opt.register_step_post_hook(self._optimizer_done)
        if self._opened is None:  # a pipeline stage too: under FSDP, _sync_or_not reads its switch
            _ddp_sync_switches(wrapped)
        if self._opened is None and (isinstance(wrapped, DDP) or is_fsdp(wrapped)):  # the trainer holds its own
            wrapped.register_forward_pre_hook(lambda *_, entry=entry: self._sync_or_not(entry))
        if is_fsdp(wrapped):  # the first step's gradients are FSDP's sharded ones (not after a reentrant checkpoint)
            for opt in built:
                entry.first_step_hooks.append(opt.register_step_pre_hook(lambda *_, e=entry: self._sharded_grads(e)))
        if isinstance(wrapped, DDP):
            wrapped.register_forward_pre_hook(lambda *_: setattr(entry, "forwards", entry.forwards + 1))
            for opt in built:
                opt.register_step_pre_hook(lambda *_, entry=entry: self._through_ddp(entry))
        if self.resume is not None:
            self._restore(entry)
            for opt in built:  # as saved: a scheduler built on it next resets them to its start (track() below)
                self._restored_groups[id(opt)] = [copy.deepcopy({k: v for k, v in g.items() if k != "params"})
                                                  for g in opt.param_groups]
        self._models.append(entry)
        return (wrapped, *built)

    def loader(self, dataset: Any, *, batch_size: int = 0, shuffle: bool | None = None, accum: int = 1,
               collate_fn: Callable[[list[Any]], Any] | None = None,
               worker_init_fn: Callable[[int], None] | None = None) -> Loader:
        """This rank's shard of ``dataset`` (a torch Dataset, or (inputs, targets) tensors), ``batch_size`` per
        rank (0 = data.batch_size), reshuffled every epoch from run.seed, in the same order at any world size.
        ``accum``: batches per optimizer step (gradient accumulation): each `with st.step():` draws that many,
        a forward and backward each; all but the last keep their gradients local (DDP's no_sync, FSDP's
        set_requires_gradient_sync), so gradients cross the network once per step, and a step that ends inside
        an accumulation is one line. The epoch ends on a whole step, and a
        checkpoint's loader position is kept in steps, so a resume at another world size can keep the global
        batch by accumulating more (scaletrain train does). A stream (an IterableDataset) is read in its order
        (data/loader.py StreamLoader). ``collate_fn``: a list of samples -> a batch, as a DataLoader takes it (a
        padding collator); default scaletrain.batch.collate. ``worker_init_fn``: run in each DataLoader worker
        as it starts, as a DataLoader runs it (get_worker_info().dataset reads and sets the data set's own
        attributes). A DataLoader of one's own (a script written for plain torch, or for Accelerate's prepare())
        is read for its dataset, batch size, collate_fn, shuffle, workers and worker_init_fn, and its samples
        sharded and resumed as above (its sampler's order is not kept: a loader of the session reshuffles from
        run.seed)."""
        from scaletrain.data import in_memory, train_size

        self._usable("loader")
        if isinstance(dataset, DataLoader):
            dataset, batch_size, shuffle, collate_fn, workers, init = from_dataloader(dataset, batch_size, shuffle,
                                                                                      collate_fn)
            worker_init_fn = worker_init_fn or init
        else:
            workers = 0
        b = batch_size or self.cfg.data.batch_size
        shuffle = self.cfg.data.shuffle if shuffle is None else shuffle
        source = dataset if isinstance(dataset, tuple) else (dataset,)  # (inputs, targets): the same tensors
        key = (tuple(id(part) for part in source), b, accum, shuffle)
        again = next((loader for loader in self._loaders if loader.key == key), None)
        if again is not None and self._training:
            # The same data, made again once the loop runs: a loop that makes its loader inside `for epoch in
            # ...` (as it made its DataLoader) goes on with the one it made first. A new one each epoch began at
            # epoch 0 every time (the same order every epoch) and added a position to every checkpoint.
            return again
        # a Dataset or a stream as it is; (inputs, targets) made one; a wrong type: one line
        stream = isinstance(dataset, IterableDataset)
        data = dataset if stream else in_memory(dataset, eval_data=dataset, collate_fn=collate_fn).train
        dp_rank, dp_size = (self.layout.dp_rank(self.rank), self.layout.dp_size) if self.layout else \
            (self.rank, self.world_size)
        if stream:  # read in its order (data/loader.py StreamLoader)
            return self._add_loader(StreamLoader(data, batch_size=b, rank=dp_rank, world=dp_size, accum=accum,
                                                 pin_memory=self.device.type == "cuda", collate_fn=collate_fn),
                                    key, source)
        size = train_size(data) or 0  # a weighted set's: the samples an epoch draws
        if size < b * self.world_size * accum:
            raise UserError(f"session.loader(): {size} samples cannot give every one of {self.world_size} "
                            f"rank(s) {accum} batch(es) of {b}; fix: a smaller batch_size or more data")
        return self._add_loader(ShardedLoader(data, batch_size=b, rank=dp_rank, world=dp_size, accum=accum,
                                              seed=self.cfg.run.seed, shuffle=shuffle,
                                              num_workers=self.cfg.data.num_workers or workers,
                                              pin_memory=self.device.type == "cuda", collate_fn=collate_fn,
                                              worker_init_fn=worker_init_fn),
                                key, source)

    def _add_loader(self, inner: ShardedLoader | StreamLoader, key: tuple[Any, ...] = (),
                    source: tuple[Any, ...] = ()) -> Loader:
        """``inner`` restored from the checkpoint (the loaders in the order they were made) and kept, under
        ``key`` (what st.loader was given: the same data made again is this loader), ``source`` held so that
        no other object takes its ids."""
        saved = self._trainer.get("loaders", [])
        if len(saved) > len(self._loaders) and "data" not in self.skip:
            inner.load_state_dict(saved[len(self._loaders)])
        inner.track_indices = self._trace is not None
        loader = Loader(self, inner, key, source)
        self._loaders.append(loader)
        return loader

    def track(self, obj: Any, *, name: str = "", _new: bool = False) -> Any:
        """Anything else a resume needs (an LR scheduler, a GradScaler, an EMA of the weights): an object with
        ``state_dict()`` and ``load_state_dict()``; or a random number generator of the loop's own (a
        torch.Generator, np.random.default_rng(), random.Random), whose state each rank saves and gets back as
        its own. Its state goes into every checkpoint and, on resume, is restored here. Track in the same order
        (or with the same ``name=``) in every run. Returns ``obj``."""
        from scaletrain.checkpoint.tree import split

        self._usable("track")
        if self._training:
            raise UserError("session.track() after the first step; fix: track everything before the loop starts")
        if rng.is_generator(obj):
            return self._track_generator(obj, name)
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UserError(f"session.track(): a {type(obj).__name__} has no state_dict()/load_state_dict(); fix: "
                            "track an object that has both (an LR scheduler, a GradScaler, a module) or a random number "
                            "generator")
        name = name or f"{type(obj).__name__}{len(self._tracked)}"
        if name in self._tracked or any(t is obj for t in self._tracked.values()):
            raise UserError(f"session.track(name={name!r}): tracked already; fix: track each object once, each "
                            "name once")
        try:
            tensors, _ = split(obj.state_dict())
        except TypeError as err:
            raise UserError(f"session.track(): the state of this {type(obj).__name__} cannot be checkpointed ({err}); "
                            "fix: keep tensors, numbers, strings, lists and dicts in its state_dict()") from None
        sharded = next((k for k, t in tensors.items() if is_dtensor(t)), None)
        if sharded is not None:
            raise UserError(f"session.track(): the state of this {type(obj).__name__} holds a sharded tensor (a DTensor "
                            f"at {sharded}), which rank 0 alone cannot save; fix: keep plain (unsharded) tensors in its "
                            "state_dict()")
        if self.resume is not None:
            saved = self._trainer.get("tracked", {})
            adopted = self._adopted_name(obj)  # the name a scheduler of a session optimizer is tracked by unasked
            if name not in saved and adopted in saved and adopted not in self._tracked:
                name = adopted  # tracked unasked before, by st.track() now: the same state
            if name not in saved and _new:  # the trainer's own state that older checkpoints lack: starts afresh
                self._tracked[name] = obj
                return obj
            if name not in saved:
                raise CheckpointError(self.resume.path, f"it tracked {sorted(saved)}, not {name!r}",
                                      "track the same objects, in the same order (or with the same name=)")
            obj.load_state_dict(saved[name])
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                self._regroup(obj)
        self._tracked[name] = obj
        return obj

    def _track_generator(self, gen: Any, name: str, *, new: bool = False) -> Any:
        """st.track() of a random number generator of the loop's own: every rank's state goes into its own rank
        file (ranks seed theirs apart: torch.Generator().manual_seed(seed + rank)) and each rank's is put back on
        resume; a rank the checkpoint's smaller world did not have keeps its generator as built. Named by the
        loop's variable for it by default (as _adopt_untracked names it). ``new``: adopted unasked, a checkpoint
        from before may lack it (it then starts as built)."""
        if not name:
            frame = _user_frame()
            known = {**frame.f_globals, **frame.f_locals} if frame is not None else {}
            name = next((k for k, v in known.items() if v is gen), "") or f"generator{len(self._generators)}"
        if name in self._generators or name in self._tracked or any(g is gen for g in self._generators.values()):
            raise UserError(f"session.track(name={name!r}): tracked already; fix: track each object once, each "
                            "name once")
        if rng.stateless(gen):
            raise UserError(f"session.track(): a {type(gen).__name__} draws from the operating system and has no "
                            "state to save; fix: a seeded random.Random, or leave it untracked (it cannot resume "
                            "exactly)")
        if self._rank_state is not None and "rng" not in self.skip:
            assert self.resume is not None
            saved = self._rank_state.get("generators", {})
            if name not in saved and new:
                self._generators[name] = gen
                return gen
            if name not in saved:
                raise CheckpointError(self.resume.path, f"rank {self.rank}'s state holds the generators "
                                      f"{sorted(saved)}, not {name!r}",
                                      "track the same generators, in the same order (or with the same name=)")
            try:
                rng.set_generator_state(gen, saved[name])
            except ValueError as err:
                raise CheckpointError(self.resume.path, f"the generator {name!r} does not fit this "
                                      f"{type(gen).__name__}: {err}", "track the same kind of generator under "
                                      "this name") from None
        self._generators[name] = gen
        return gen

    def autocast(self) -> contextlib.AbstractContextManager:
        """The run's compute precision (train.precision) for the forward passes inside it (a no-op where FSDP's
        mixed-precision policy alone casts: scaletrain's own models, precision.policy_casts)."""
        return autocast(self.cfg.train.precision, self.device,
                        policy=bool(self._models) and all(policy_casts(m.wrapped) for m in self._models))

    @property
    def sharded(self) -> bool:
        """True when the models set up are split across ranks (FSDP/HSDP shards, tensor parallelism: their
        parameters are DTensors; pipeline stages: each rank holds its stage's): the checkpoints are DCP."""
        return self._stage is not None or any(has_dtensors(m.wrapped) for m in self._models)

    def _comm_in_compute(self) -> str:
        """The collectives this run's timer counts in compute (they wait inside forward and backward), for the
        verdict; '' where comm is timed (DDP's all-reduce, a pipeline's waiting) or there is none."""
        if self._stage is not None or self.world_size == 1:
            return ""
        parts = ["FSDP's all-gathers and reduce-scatters"] if any(is_fsdp(m.wrapped) for m in self._models) else []
        parts += ["tensor parallelism's collectives"] if self.cfg.parallel.tp > 1 else []
        return " and ".join(parts)

    def _box(self, models: list[_Model] | None = None, *, bare: bool | None = None) -> nn.Module:
        """The models in one container, each under its name: one state dict for DCP (keys ``name.param``);
        ``bare`` (default: one model with one optimizer set up): the one model itself, keys as it names them."""
        models = self._models if models is None else models
        if self._single() if bare is None else bare:
            return models[0].module
        return nn.ModuleDict({m.name: m.module for m in models})

    def _single(self) -> bool:
        """One model with one optimizer: its checkpoints are in fit()'s layout, by the model's own names."""
        return len(self._models) == 1 and len(self._models[0].optimizers) == 1

    def _noise_probe(self, wrapped: nn.Module, params: list[nn.Parameter]) -> GradProbe:
        """log.grad_noise_scale's probe on the model being set up (observe/noise_scale.py), its smoothed
        estimate restored on resume."""
        if self._models:
            raise UserError("log.grad_noise_scale measures the gradient of one model; this session sets up a "
                            "second; fix: --log.grad_noise_scale=false with several models")
        layout = self.layout
        probe = attach_probe(wrapped, params, self._sums, self.device, world_size=self.world_size,
                             tp=layout.tp if layout else 1, pp=layout.pp if layout else 1,
                             precision=self.cfg.train.precision)
        self._noise = NoiseScaleLog(probe)
        if "noise_scale" in self._trainer:
            self._noise.load_state_dict(self._trainer["noise_scale"])
        return probe

    # -- inside the loop -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step of the user's loop (several models and backward passes may be in it)."""
        self._usable("step")
        if self._in_step:
            raise UserError("session.step() inside another session.step(); fix: one `with st.step():` per step")
        if not self._models:
            raise UserError("session.step() before session.setup(); fix: set up the model(s) first")
        self._start_training()
        step = self.steps + 1
        self.chaos.before_step(step)
        if self._profiler is not None:
            self._profiler.before(step)
        self._in_step = True
        waited = sum(loader.waited for loader in self._loaders)
        if not self._timing:  # later steps start where the previous one ended: the batch wait is in them
            self.timer.start(waited=waited)  # the first one's batch came before it, and its wait is the step's too
            self._timing = True
        # gradients held as the step begins: the loop ran forward and backward before it (accumulation written
        # around `with st.step():` only at the optimizer's step), which is compute, not time in no phase; else the
        # loop's time since the last step was getting this batch (the wait in st.loader, the loop around it, a
        # batch prepared by hand or read from a loader of its own): data, so the phases add up to the step
        ahead = any(p.grad is not None for m in self._models for p in m.ends)
        self.timer.host("data", waited, before="compute" if ahead else "data")
        self._count_drawn()
        if self._trace is not None:
            self._trace.started(self)
        if self.compiled and self.device.type == "cuda" and self.compile_mode in ("reduce-overhead", "max-autotune"):
            # CUDA graphs: a new step, whose replays may reuse the memory of the last step's outputs (the loss the
            # loop logged is summed into a tensor of its own by then)
            torch.compiler.cudagraph_mark_step_begin()
        try:
            yield
            self._whole_accumulation(step)
            if self._scaled:
                self.scaler.update()  # once per step, after every optimizer stepped
                self._scaled = False
            self.timer.mark("optim")
            self.timer.end(step)
            if self._profiler is not None:
                self._profiler.after(step)
            self._count_drawn()  # batches drawn inside the step (accumulation)
            for m in self._models:  # forwards before the next step's block count for it (accumulation outside)
                m.forwards = 0
            self.steps = self._progress["steps"] = step
            self._since += 1
            self._ran += 1
            self.preempt.tick()
            self.console.advance()
            self._after_step()
        except RuntimeError as err:  # a peer died or hung in a collective: one line naming it
            # DDP says so at the forward after the backward that left parameters without a gradient: this step's
            # if the model ran more than once in it (a GAN's critic), else the step before
            again = any(m.forwards > 1 for m in self._models) or step == 1
            unused = unused_parameters(err, [m.wrapped for m in self._models], step if again else step - 1) \
                or gradient_twice(err)
            if unused is not None:
                raise unused from err
            failure = runtime.collective_failure(err, self.rt, step, self.cfg.dist.timeout_s, self.cfg.run_dir)
            if failure is err:
                raise  # the user's own error: its traceback as it was
            raise failure from err
        except AssertionError as err:
            mixed = mixed_gradient_dtypes(err, self.cfg.train.precision)
            if mixed is None:
                raise
            raise mixed from err
        finally:
            self._in_step = False
        self.timer.start()  # the next step begins now: waiting for its batch is part of it

    def _sync_or_not(self, entry: _Model) -> None:
        """Before a forward of a set-up model with gradients: while a loader's accumulation is inside a step's
        micro-batches (st.loader(..., accum=N), its batches 1 .. N-1 of the step drawn), its backward keeps the
        gradients local, as the trainer's no_sync() does; the last micro-batch's backward averages their sum over
        the ranks: one all-reduce (FSDP: reduce-scatter) per optimizer step instead of N."""
        if not torch.is_grad_enabled() or self._evaluating:
            return
        accumulating = any(loader.inner.accum > 1 and loader.since_step % loader.inner.accum
                           for loader in self._loaders)
        if is_fsdp(entry.wrapped):  # and the loop's own switch, read at forward as DDP reads it (_ddp_sync_switches)
            accumulating = accumulating or not entry.wrapped.require_backward_grad_sync
        if accumulating != entry.unsynced:
            entry.unsynced = accumulating
            set_gradient_sync(entry.wrapped, not accumulating)

    def _whole_accumulation(self, step: int) -> None:
        """At a step's end: every loader with accumulation handed out whole steps of micro-batches since the last
        step, else the optimizer stepped on gradients not yet averaged over the ranks (and a checkpoint now would
        hold a position inside a step): one line."""
        for loader in self._loaders:
            accum, drawn = loader.inner.accum, loader.since_step
            loader.since_step = 0
            if accum > 1 and drawn % accum:
                raise UserError(f"session.loader(accum={accum}) hands {accum} micro-batches to each optimizer step, "
                                f"and step {step} ended after {drawn} (gradients are averaged over the ranks at a "
                                f"step's last micro-batch); fix: draw all {accum} inside one "
                                "`with st.step():`, a forward and backward each, or accum=1 for a step per batch")

    def _count_drawn(self) -> None:
        for loader in self._loaders:  # this rank's batches (the ranks of a TP group or a pipeline share one)
            self._samples += loader.drawn * loader.inner.batch_size
            self._tokens += loader.tokens
            loader.stepped += loader.drawn
            loader.waited, loader.drawn, loader.tokens = 0.0, 0, 0

    def _model_state(self) -> MemoryBreakdown:
        """Parameters, gradients and optimizer state on this rank, counted from the live tensors."""
        return model_state_bytes(self._box(), [opt for m in self._models for opt in m.optimizers])

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` (of the scaled loss under fp16-mixed), timed (compute and the exposed gradient
        communication), its value watched for NaN or infinity (named with the rank and step at the next log
        step)."""
        if not self._in_step:
            raise UserError("session.backward() outside `with st.step():`; fix: call it inside the step")
        self.chaos.delay("compute")
        loss = self.chaos.poison(self.steps + 1, loss)
        self.guard.watch_loss(self.steps + 1, plain(loss.detach()))  # loss parallel's is a DTensor
        try:
            self.scaler.scale(loss).backward()
        except RuntimeError as err:
            if self.sharded and "storage of size 0" in str(err):  # a parameter FSDP had freed after use
                raise UserError("session.backward(): this loss needs a second derivative through a sharded model "
                                "(autograd.grad(create_graph=True), as a gradient penalty does), which FSDP "
                                "cannot give: its parameters were freed after the first backward; fix: "
                                "--parallel.strategy=ddp") from None
            raise
        self.timer.backward_done()
        if self._noise is not None and self._noise.probe.per_micro_batch:  # one process: a micro-batch's
            self._noise.probe.small_done()  # gradient, its loss divided by the accumulation as train_step's is

    def pipeline_step(self, runner: PipelineRunner, inputs: torch.Tensor, target: torch.Tensor, *,
                      sync: bool = True) -> torch.Tensor:
        """What backward() is for a pipelined model (parallel.pp > 1): one forward and backward of ``runner``'s
        stage over the micro-batches of ``inputs`` and ``target`` (this data-parallel rank's batch; every stage
        is given it), timed as compute, the loss watched for NaN or infinity on the last stage. ``sync``: False
        on accumulation steps but the last. Returns the batch's mean loss on the last stage, NaN elsewhere
        (st.log() averages the finite values: the last stages')."""
        if not self._in_step:
            raise UserError("session.pipeline_step() outside `with st.step():`; fix: call it inside the step")
        self.chaos.delay("compute")
        self.timer.mark("compute")  # this rank's own time (an injected delay), before the stages' step
        loss = runner.step(inputs, target, sync=sync)
        self.timer.pipeline_done(runner.busy)  # its own chunks are compute, its waits for the others comm
        if self.chaos.poisons(self.steps + 1):  # chaos.nan_rank: as a NaN loss would, NaN gradients on this stage
            with torch.no_grad():
                for p in runner.stage_module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(math.nan)
            loss = torch.full((), math.nan, device=self.device)
        if loss is None:  # a stage before the last: no loss of its own
            return torch.full((), math.nan, device=self.device)
        loss = plain(loss)  # loss parallel's is a DTensor
        self.guard.watch_loss(self.steps + 1, loss)
        return loss

    def optimizer_step(self, optimizer: Optimizer, *, clip: float | None = None) -> torch.Tensor | None:
        """``optimizer.step()`` as the run needs it: under fp16-mixed the gradients are unscaled first (and the
        step skipped on overflow, as GradScaler does); their norm is clipped to ``clip`` (default
        optim.grad_clip; 0: not clipped); a step whose gradient norm is NaN or infinite is not applied by a fused
        optimizer, nor under train.nonfinite=skip by any (raise stops at the next log step, skip warns). Returns the gradient norm before
        clipping (a device tensor: nothing waits for it), or None where none was computed (fp16 without
        clipping: the scaler checks)."""
        if not self._in_step:
            raise UserError("session.optimizer_step() outside `with st.step():`; fix: call it inside the step")
        if not any(optimizer is opt for m in self._models for opt in m.optimizers):
            raise UserError("session.optimizer_step(): this optimizer was not set up; fix: pass it to "
                            "st.setup(model, optimizer) with its model")
        clip = self.cfg.optim.grad_clip if clip is None else clip
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self._stage is not None:  # the whole model's norm: every stage's share, over the pipeline group
            self.scaler.unscale_(optimizer)
            norm = stage_grad_norm(self._stage, self._stage.mesh.get_group("pp"))
            if clip > 0:
                clip_with_norm(self._stage, clip, norm)
        else:
            norm = clipped_norm(params, clip, self.scaler, optimizer)
        if self._noise is not None and norm is not None:  # the averaged gradient's norm, before clipping
            self._noise.probe.add_big(norm)
            if not self._noise.probe.per_micro_batch:
                self._noise.probe.small_done()
        step, fused = self.steps + 1, supports_device_skip(optimizer)
        # Holding back a step for an optimizer that cannot skip on the device costs a host sync every step:
        # only where train.nonfinite=skip asks for it. Under raise the run stops at the next log step, before
        # anything after the step is saved.
        skip = self.cfg.train.nonfinite == "skip"
        self._applied_bad_possible = self._applied_bad_possible or not (fused or skip)
        apply = self.guard.gate(step, optimizer, norm, device_skip=fused, may_sync=skip) if norm is not None else True
        self._stepping = optimizer
        try:
            if apply:
                self.scaler.step(optimizer)
        finally:
            self._stepping = None
            self.guard.disarm(optimizer)
        self._scaled = self._scaled or self.scaler.is_enabled()
        if self.steps == 0 or self._state_bytes is None:  # the first step's: gradients and optimizer state exist
            now = self._model_state()  # several optimizers: each part's largest over the step's optimizer steps
            self._state_bytes = now if self._state_bytes is None else self._state_bytes.largest(now)
        return norm

    def _optimizer_starting(self, *_: Any) -> None:
        if self._in_step:  # not an optimizer state's initialization by DCP on resume, say
            self.timer.optimizer_starting()
        elif self._opened is None and not self._restoring:
            # A loop without `with st.step():` trained through its whole loader with nothing counted, logged,
            # checkpointed or stopped at train.max_steps, and said "0 steps" at its end.
            raise UserError("optimizer.step() outside `with st.step():`: the session counts, logs, checkpoints and "
                            "resumes only the steps taken inside one; fix: put each step's forward, backward and "
                            "optimizer.step() inside `with st.step():`")

    def _optimizer_done(self, optimizer: Optimizer, *_: Any) -> None:
        if self._in_step:
            self.timer.optimizer_done()
        if self._trace is not None:
            self._trace.applied(optimizer)

    def _sharded_grads(self, entry: _Model) -> None:
        """A step pre-hook of an FSDP model's optimizers at the first step in a step (removed after it):
        parallel.unsharded_gradients."""
        if not self._in_step:  # DCP initializing optimizer state on resume
            return
        for handle in entry.first_step_hooks:
            handle.remove()
        entry.first_step_hooks.clear()
        wrong = unsharded_gradients(entry.wrapped)
        if wrong is not None:
            raise wrong

    def _through_ddp(self, entry: _Model) -> None:
        """A step pre-hook of a DDP model's optimizers: the model setup() returned must have run since the last
        step. Calling the model given to setup(), or its parts (gan.D(x)), computes gradients DDP never sees: they
        are not averaged, and the ranks' weights drift apart without a word. A host-side count, no sync."""
        if entry.forwards == 0 and self._in_step:  # (DCP initializes optimizer state by a step, on resume)
            raise UserError(f"session.setup(name={entry.name!r}): its optimizer is stepping, but the model setup() "
                            "returned was not called since the last step: calling the model given to setup(), or "
                            "its parts (gan.D(x)), skips DDP's gradient all-reduce, and the ranks' weights drift "
                            "apart; fix: call the model setup() returned (model, opt = st.setup(net, ...); "
                            "model(x)), or set up each part you call as a model of its own (st.setup(gan.D, opt_d))")

    def _unscaled_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """A step pre-hook under fp16-mixed: refuses optimizer.step() on scaled gradients."""
        if self._stepping is not optimizer:
            raise UserError("optimizer.step() under train.precision=fp16-mixed: the gradients are scaled; fix: "
                            "st.optimizer_step(optimizer) unscales them and steps through the loss scaler")

    def log(self, **metrics: torch.Tensor | float) -> None:
        """Values of this step (tensors stay on the device: nothing waits for them); the log line and
        metrics.jsonl show their mean over the interval's steps and over the ranks. Every rank logs the same
        names."""
        self._usable("log")
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() != 1:  # shape only: no sync
                raise UserError(f"session.log({key}=...): a tensor of shape {tuple(value.shape)}; the log shows one "
                                f"number per name; fix: log its mean ({key}={key}.mean()) or one value")
            if not isinstance(value, (torch.Tensor, numbers.Real)):  # numpy's scalars are Real too
                raise UserError(f"session.log({key}=...): a {type(value).__name__} ({value!r:.40}); the log shows "
                                "numbers; fix: log a number or a one-element tensor")
            v = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else \
                torch.tensor(float(value), device=self.device)
            v = v.to(self.device)
            finite = torch.isfinite(v)  # a NaN (a skipped step's loss) is named by the guard, not averaged in
            zero = torch.zeros((), device=self.device)
            self._sums[key] = self._sums.get(key, zero) + torch.where(finite, v, 0.0)
            self._sums[f"{key}#n"] = self._sums.get(f"{key}#n", zero) + finite

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Between steps, the loop's own evaluation (or sampling, or anything that is not training): its time is
        left out of the interval's step time and phase times and counted as ``eval`` in the goodput account, as
        fit()'s evaluations are; the no-progress watchdog waits for it, as for a save. Under FSDP a model called
        here gathers its shards collectively: every rank evaluates."""
        self._usable("evaluating")
        if self._in_step:
            raise UserError("session.evaluating() inside `with st.step():`; fix: evaluate between steps")
        started = time.perf_counter()
        self._evaluating = True
        try:
            with self.preempt.saving():
                yield
        finally:
            self._evaluating = False
            spent = time.perf_counter() - started
            self._eval_s += spent
            self._interval_started += spent
            if not self._training:
                self._eval_before += spent
            if self._timing:
                self.timer.start()  # the next step's time begins after the evaluation

    def save(self) -> None:
        """A checkpoint now, at the last completed step (every rank calls it)."""
        self._usable("save")
        self._save(final=True)

    def save_best(self, **record: float) -> None:
        """After an evaluation whose result is your best so far: keep the checkpoint of the last completed step
        (saved now, in the background, unless one was) whatever checkpoint.keep says, until the next save_best
        names another. checkpoints/best.json names it with ``record`` (``st.save_best(eval_loss=0.31)``) and
        summary.json's best_checkpoint too; `scaletrain checkpoint export RUN --best` exports it. Every rank
        calls it, between steps."""
        from scaletrain.checkpoint import commit

        self._usable("save_best")
        if self._in_step:
            raise UserError("session.save_best() inside `with st.step():`; fix: call it after your evaluation, "
                            "between steps")
        bad = next((k for k, v in record.items() if not isinstance(v, (int, float, torch.Tensor))), None)
        if bad is not None:
            raise UserError(f"session.save_best({bad}={record[bad]!r}): expected a number; fix: pass numbers "
                            "(st.save_best(eval_loss=loss))")
        if not self._models or self.steps == 0:
            return  # nothing trained yet: the initial weights are not a checkpoint
        ckpt = self.checkpointer
        assert ckpt is not None
        numbers = {k: float(v) for k, v in record.items()}
        self.best = {"step": self.steps, **numbers, "path": str(ckpt.root / commit.step_name(self.steps))}
        if ckpt.last_step != self.steps:
            self._save(final=False)  # its trainer state names it the best
        ckpt.keep_best(self.steps, numbers)

    # -- step boundaries -----------------------------------------------------------------------------------

    def _start_training(self) -> None:
        if self._training:
            return
        if self._opened is None:  # a loop of the user's own; the trainer and fit() track what they step themselves
            self._adopt_untracked()
        self._training = True
        if self._rank_state is not None and "rng" in self._rank_state and "rng" not in self.skip:
            rng.restore(self._rank_state["rng"], self.device)
        else:  # a new run, or a rank the checkpoint's smaller world did not have: dropout and noise differ by rank
            torch.manual_seed(self.cfg.run.seed + self.rank)
        if self._trace is not None and self.resume is not None:
            self._trace.resumed(self)
        elif self._trace is not None:
            self._trace.begun(self)
        if self.resume is not None and not self._loaders:  # the console prints on rank 0
            self.console.print(f"warning: resumed at step {self.steps}, but this loop reads no st.loader: a DataLoader "
                               "of its own starts its epoch again, so the batches after the resume are not the ones "
                               "the run would have seen; for an exact resume read the data through st.loader(dataset)")
        if self.total_steps:
            self.console.start_progress(self.total_steps, self.steps)
        if self._noise is not None and self._loaders:  # one process: each micro-batch's loss was divided by this
            self._noise.probe.set_accum(self._loaders[0].inner.accum)
        self._interval_started = self._first_step_at = time.perf_counter()

    def _adopted_name(self, obj: Any) -> str:
        """The name _adopt_untracked tracks an LR scheduler of the session's ``i``-th optimizer by ('' for
        anything else)."""
        optimizers = [opt for m in self._models for opt in m.optimizers]
        opt = getattr(obj, "optimizer", None)
        return next((f"lr_scheduler_of_optimizer{i}" for i, o in enumerate(optimizers) if o is opt), "")

    def _regroup(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        """Built after setup() restored its optimizer, a scheduler's constructor set the optimizer's
        hyperparameters to its start: the lr, and OneCycleLR's and CyclicLR's momentum (or Adam's betas) too.
        The groups as saved go back, so the next step is the saved run's (only the lr went back before, and a
        resumed OneCycleLR's SGD stepped with the first step's momentum)."""
        groups = self._restored_groups.get(id(scheduler.optimizer))
        if groups is None:  # an optimizer the session did not set up: the saved position's lr, at least
            groups = [{"lr": lr} for lr in scheduler.get_last_lr()]
        for group, kept in zip(scheduler.optimizer.param_groups, groups):
            for key, value in kept.items():
                if isinstance(group.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                    group[key].copy_(value)  # a tensor lr (capturable, compiled optimizers) stays the same tensor
                else:
                    group[key] = copy.deepcopy(value)

    def _adopt_untracked(self) -> None:
        """What a resume needs and the loop never gave to st.track(), tracked here as the first step begins, each
        said in one line: an LR scheduler built on an optimizer of the session (the loop's own OneCycleLR, ported
        as it was), an average of a set-up model's weights (torch's AveragedModel: an EMA, SWA), and the loop's
        own enabled GradScaler (a CUDA AMP script's: its scale and growth count). Untracked,
        a resume started them over, silently: a OneCycleLR of 60 steps stopped at 30 ended at lr 0.156 instead of
        0.0003, and an EMA averaged from the resumed weights on. One heap scan, once (30 ms beside a trainer's
        imports, after a collection of the garbage that an earlier session in this process left). Several of a kind
        for one optimizer or model cannot be told apart from one run to the next: a warning names them, as it
        names an average the checkpoint cannot hold (of sharded parameters)."""
        import gc

        from torch.optim.lr_scheduler import LRScheduler
        from torch.optim.swa_utils import AveragedModel

        optimizers = [opt for m in self._models for opt in m.optimizers]
        shapes = [[tuple(p.shape) for p in m.module.parameters()] for m in self._models]
        covered = set()  # tracked already: as itself, as a tracked wrapper's .scheduler, as a composite's part
        for t in self._tracked.values():
            covered |= {id(t), id(getattr(t, "scheduler", None))}
        schedulers, averages, scalers = [], [], []
        gc.collect()  # a finished session's scheduler or average, unreachable in a cycle, is not this one's
        for o in gc.get_objects():  # type(), not isinstance(): a __class__ may be a property that warns
            kind = type(o)
            if id(o) in covered:
                continue
            if issubclass(kind, LRScheduler) and any(o.optimizer is opt for opt in optimizers):
                schedulers.append(o)
            elif issubclass(kind, AveragedModel):
                shape = [tuple(p.shape) for p in o.module.parameters()]
                if shape in shapes:
                    averages.append((o, shape))
            elif issubclass(kind, torch.amp.GradScaler) and o is not self.scaler and o.is_enabled():
                scalers.append(o)  # the loop's own loss scaler (a CUDA AMP script's), not the session's
        for whole in [*schedulers, *self._tracked.values()]:  # SequentialLR's and ChainedScheduler's parts
            covered |= {id(part) for part in getattr(whole, "_schedulers", ())}
        schedulers = [o for o in schedulers if id(o) not in covered]
        for i, opt in enumerate(optimizers):
            mine = [o for o in schedulers if o.optimizer is opt]
            self._adopt(mine, self._adopted_name(mine[0]) if mine else "", f"optimizer {i}", "sched = st.track(sched)")
        for m, own in zip(self._models, shapes):  # an average of two models' shape is the first one's
            tracked = {id(t) for t in self._tracked.values()}
            self._adopt([o for o, shape in averages if id(o) not in tracked and shape == own],
                        f"average_of_{m.name}", m.name if m.name.startswith("model") else f"model {m.name}",
                        "ema = st.track(ema)")
        self._adopt(scalers, "grad_scaler", "the loop", "scaler = st.track(scaler)")
        self._adopt_generators()

    def _adopt_generators(self) -> None:
        """The random number generators of the loop's own (its variables and their attributes, one deep:
        torch.Generator().manual_seed(seed + rank) for noise, np.random.default_rng(seed) for augmentation)
        that no st.track() was given, tracked per rank under their variable names, said in one line. Untracked,
        a resume drew from them as seeded again: the resumed run diverged at its first step, with nothing
        saved to say why."""
        frame = _user_frame()
        if frame is None:
            return
        found = rng.named_generators({**frame.f_globals, **frame.f_locals})
        adopted = []
        for name, gen in found.items():
            if any(g is gen for g in self._generators.values()):
                continue
            taken = name in self._generators or name in self._tracked
            name = f"generator{len(self._generators)}" if taken else name
            fresh = self._rank_state is not None and name not in self._rank_state.get("generators", {})
            self._track_generator(gen, name, new=True)
            adopted.append(f"{name} ({type(gen).__name__}{', made after the checkpoint: starts as built' if fresh else ''})")
        if adopted:
            self.console.print(f"checkpointed with the run: the loop's own random generator{'s' * (len(adopted) > 1)} "
                               f"{', '.join(adopted)}, each rank's (tracked as st.track() would: a resume goes on "
                               "from their state)")

    def _adopt(self, found: list[Any], name: str, of: str, fix: str) -> None:
        if not found:
            return
        kinds = ", ".join(type(o).__name__ for o in found)
        if len(found) > 1:
            self.console.print(f"warning: {len(found)} of {of} ({kinds}) are not tracked: a resume would start them "
                               f"over; fix: {fix} for each, in the same order every run")
            return
        fresh = self.resume is not None and name not in self._trainer.get("tracked", {})
        try:
            self.track(found[0], name=name, _new=True)
        except UserError as err:  # an average of sharded parameters: the checkpoint cannot hold it yet
            self.console.print(f"warning: the {kinds} of {of} is not checkpointed ({err}): a resume starts it over")
            return
        self.console.print(f"checkpointed with the run: the {kinds} of {of} (tracked as st.track() would: a resume "
                           "goes on from its state)")
        if fresh:
            self.console.print(f"warning: the checkpoint holds no state of the {kinds} of {of} (made before it was "
                               "tracked): it starts over")

    def _after_step(self) -> None:
        cfg = self.cfg
        ckpt = self.checkpointer
        assert ckpt is not None
        due = ckpt.due(self.steps, self.total_steps or -1)
        log_step = self.steps % cfg.log.every == 0 or self.done
        assert self.services is not None
        stop = self._log() if log_step else self.services.stop_signal(self.preempt)
        if self._trace is not None:
            self._trace.step(self)
        interrupt = self.chaos.interrupt_after(self.steps)  # the same on every rank: no agreement needed
        if stop or interrupt or due:
            if not log_step:  # nothing is saved after a non-finite step unchecked: the counters, gathered now
                rows = self._gather(phases=False)
                self._nonfinite(rows)
                stop = stop or next((r.signal for r in rows if r.signal), 0)
            self._save(final=bool(stop or interrupt))
        self.services.log_saves()
        if stop or interrupt:
            self._stopped(PreemptFlag.name(stop) if stop else "chaos.interrupt_step")

    def _gather(self, *, phases: bool = True) -> list[RankReport]:
        """Every rank's RankReport (train/interval.py): one all_gather, one host sync. The phase times only with
        ``phases`` (collecting them starts a new interval: a log step's)."""
        try:
            return gather(self.rt, self._sums, self.guard, signal=self.preempt.signum, peak=peak_bytes(self.device),
                          times=self.timer.collect() if phases else [0.0] * len(PHASES),
                          lead=self.timer.lead_s if phases else 0.0, samples=self._samples, tokens=self._tokens,
                          arrivals=self._arrivals.read() if phases and self._arrivals is not None
                          and self._arrivals.due() else None)
        except RuntimeError as err:  # rows of other lengths: other numbers of names
            if self._closing and not self.done and self.total_steps:
                # this rank left the loop before the run's end, and the others' next collective was not its
                # closing gather: they went on stepping (a break on this rank's own condition, an early stop
                # decided from its own loss)
                raise UserError(f"session: rank {self.rank} left the loop at step {self.steps} of "
                                f"{self.total_steps} (st.done was False) and closed the session, while the other "
                                f"ranks went on to the next step ({type(err).__name__} in the closing gather); "
                                "fix: leave the loop on every rank at the same step: on st.done, or on a decision "
                                "every rank shares (all-reduce the flag that stops one)") from err
            raise UserError("session.log(): the ranks logged different names (or numbers of them) in this "
                            f"interval ({type(err).__name__}); fix: log the same names on every rank") from err

    def _log(self) -> int:
        rows = self._gather()
        if self.timer.timeline is not None:
            self.timer.timeline.flush()
        if len({r.names for r in rows}) > 1:
            raise UserError("session.log(): the ranks logged different names in this interval; fix: log the same "
                            "names on every rank")
        self._nonfinite(rows)
        elapsed = time.perf_counter() - self._interval_started
        self.train_time += elapsed
        ran = max(self._ran, 1)
        means = {}
        for name in sorted(k for k in self._sums if not k.endswith("#n") and not k.startswith(NOISE_SUMS)):
            count = sum(r.sums[f"{name}#n"] for r in rows)
            means[name] = sum(r.sums[name] for r in rows) / count if count else math.nan
        # The ranks of a tensor-parallel group read the same batch: counted once, by the group's first rank.
        readers = [r for i, r in enumerate(rows) if self.layout is None or self.layout.reads(i)]
        samples, tokens = sum(r.samples for r in readers), sum(r.tokens for r in readers)
        self._seen = [self._seen[0] + samples, self._seen[1] + tokens]
        rate = samples / elapsed if elapsed > 0 else 0.0
        phases = [r.phases for r in rows]
        assert self.services is not None
        late = self._arrivals.update([r.arrivals for r in rows], [p["pre_comm"] for p in phases], ran, elapsed) \
            if self._arrivals is not None else None
        straggler = self.services.interval(phases, ran, late)
        epoch = self._loaders[0].epoch + 1 if self._loaders else None
        lr = self._models[0].optimizers[0].param_groups[0]["lr"] if self._models and self._models[0].optimizers \
            else None
        record: dict[str, Any] = {"kind": "train", "step": self.steps, **({"epoch": epoch} if epoch else {}),
                                  **means, **({"lr": float(lr)} if lr is not None else {}), "samples_per_s": rate,
                                  **throughput(rate, flops=self.flops_per_sample, tokens_per_sample=tokens / samples
                                               if samples else 0, world_size=self.world_size, peak=self._peak_flops),
                                  "step_time_s": elapsed / ran, "skipped_steps": int(self._skipped_seen)}
        if self.cfg.log.phase_times:
            record.update(self._phases(rows))
        record["mem"] = self._memory(rows)
        self._records.append({"step": self.steps, "steps": ran, "step_time_s": elapsed / ran, "samples_per_s": rate})
        if straggler is not None:
            record["straggler"] = straggler
        noise = self._noise.interval([r.sums for r in rows], samples=samples, steps=ran) \
            if self._noise is not None else None
        if noise is not None:
            record["grad_noise_scale"] = noise
        self.writer.write(record)
        if "loss" in means:
            self.console.status(f"loss {means['loss']:.4f}")
        parts = [f"step {self.steps:>6}" + (f"/{self.total_steps}" if self.total_steps else "")]
        parts += [f"epoch {epoch}"] if epoch else []
        parts += [f"{k} {v:.4f}" for k, v in means.items()]
        parts += [f"lr {lr:.3e}"] if lr is not None else []
        parts += [f"B_noise {noise['b_simple']:,.0f}"] if noise is not None and math.isfinite(noise["b_simple"]) \
            else []
        # samples are counted as a session's loaders hand them out: a loop reading its own DataLoader shows none
        parts += [f"{per_second(rate)} samples/s"] if samples or self._loaders else []
        parts += [f"{record['step_time_s']:.4f} s/step"]
        self.console.print(" | ".join(parts))
        self.last_metrics = means
        for value in self._sums.values():
            value.zero_()
        self._since, self._ran, self._samples, self._tokens = 0, 0, 0, 0
        self._interval_started = time.perf_counter()
        return next((r.signal for r in rows if r.signal), 0)

    def _phases(self, rows: list[RankReport]) -> dict[str, Any]:
        """``phase_s`` (per rank) and ``phase_stats`` (over ranks) of the interval; on a GPU ``gpu_lead_s``."""
        per_rank = {phase: [r.phases[phase] for r in rows] for phase in PHASES}
        stats = {phase: {"min": min(v), "median": statistics.median(v), "max": max(v),
                         "slowest_rank": max(range(len(v)), key=v.__getitem__)} for phase, v in per_rank.items()}
        if self.device.type != "cuda":
            return {"phase_s": per_rank, "phase_stats": stats}
        leads = [r.lead_s for r in rows]
        step_s = statistics.median(per_rank["step"])
        if step_s > 0:
            self._lead_fracs.append(statistics.median(leads) / step_s)
        return {"phase_s": per_rank, "phase_stats": stats, "gpu_lead_s": leads}

    def _memory(self, rows: list[RankReport]) -> dict[str, Any]:
        """metrics.jsonl's ``mem``: per-rank peaks, and this rank's model state counted from the live tensors."""
        peaks = [r.peak_bytes for r in rows]
        mem: dict[str, Any] = {"peak_bytes": max(peaks), "rank_peak_bytes": peaks}
        if self._state_bytes is not None:
            mem.update(self._state_bytes.as_dict())
            # On a GPU the allocator's peak is model state + activations (+ temporaries); a CPU's RSS also
            # holds the interpreter and the data, so the rest of the peak is not activations there.
            mem["activations_bytes"] = max(0, peaks[0] - self._state_bytes.model_state_bytes) \
                if self.device.type == "cuda" else 0
        self.last_mem = mem
        return mem

    def _nonfinite(self, rows: list[RankReport]) -> None:
        """Act on the guard's counters (skipped, first skipped step, first non-finite loss): train.nonfinite=raise
        stops naming the rank and step, skip warns once per newly skipped step."""
        skipped = max(r.skipped for r in rows)
        bad = sorted((int(r.first_bad_loss), rank) for rank, r in enumerate(rows) if r.first_bad_loss >= 0)
        fix = "lower the learning rate, clip gradients (--optim.grad_clip=1.0), or more warmup"
        if skipped > self._skipped_seen:
            where = nonfinite_where([r.first_skipped for r in rows], [r.first_bad_loss for r in rows])
            if self.cfg.train.nonfinite == "raise":
                applied = "was not applied" if not self._applied_bad_possible else \
                    "may have been applied (an optimizer that is not fused cannot skip it without a sync)"
                raise TrainingFailed(f"{where}; the step {applied} and nothing after it was saved; fix: {fix}, "
                                     "or --train.nonfinite=skip to skip such steps")
            self.console.print(f"warning: {where}: not applied ({int(skipped)} optimizer step(s) skipped so far)")
            self._skipped_seen, self._bad_said = skipped, True
        elif bad and not self._bad_said:
            step, rank = bad[0]
            raise TrainingFailed(f"non-finite loss on rank {rank} at step {step}; fix: {fix}; st.optimizer_step(opt) "
                                 "in place of opt.step() does not apply such a step")

    # -- checkpoints ---------------------------------------------------------------------------------------

    def samples_drawn(self) -> int:
        """Training samples the first st.loader handed out to steps over the whole run, all ranks and every attempt:
        a resume at another world size changes the global batch, not what was drawn before it. Counted from its
        batches (each rank draws alike), not from steps x its accum: a loop accumulating over batches it draws
        itself, from a loader made without accum=, draws more than one batch a step."""
        first = self._loaders[0] if self._loaders else None
        return self._drawn_before + (first.stepped * first.inner.micro_samples if first is not None else 0)

    def _batches_per_step(self) -> int:
        """The first loader's batches per optimizer step: its accum=, or, for a loop accumulating over batches it
        draws itself from a loader made without it, as many as this attempt's steps drew each (evenly)."""
        first = self._loaders[0] if self._loaders else None
        if first is None:
            return 1
        given = first.inner.step_samples // first.inner.micro_samples
        steps = self.steps - (self.resume.step if self.resume is not None else 0)
        drawn, extra = divmod(first.stepped, steps) if steps > 0 else (given, 0)
        return drawn if drawn and not extra else given

    def _save(self, *, final: bool) -> None:
        ckpt = self.checkpointer
        assert ckpt is not None
        if not self._models or self.steps == 0:
            return
        partial = time.perf_counter() - self._interval_started if self._ran else 0.0  # since the last log step
        trainer = {"step": self.steps, "samples": self.samples_drawn(),
                   "loaders": [loader.inner.state_dict() for loader in self._loaders],
                   "train_time_s": self.train_time + partial, "models": [m.name for m in self._models],
                   "tracked": {name: _held(obj.state_dict()) for name, obj in self._tracked.items()},
                   "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
                   **({"best": self.best} if self.best is not None else {}),
                   **({"noise_scale": self._noise.state_dict()} if self._noise is not None else {})}
        rank_state = {"rng": rng.capture(self.device), "since": self._since, "guard": self.guard.state_dict(),
                      "sums": {k: float(v.item()) for k, v in self._sums.items()},
                      **({"generators": self._generator_states()} if self._generators else {})}
        first = self._loaders[0].inner if self._loaders else None
        single = self._single()
        accum = self._batches_per_step()
        meta = {"format": FORMAT_FULL, "session": True, "bare": single, "step": self.steps,
                "world_size": self.world_size,
                # the first loader's batch: a resume at another world size keeps this global batch if it can
                "global_batch": accum * first.micro_samples if first else 0,
                "batch_size": first.batch_size if first else 0,
                "accum_steps": accum,
                "epoch": first.epoch + 1 if first else 0,
                **({"layout": self.layout.as_dict()} if self.layout is not None else {}),
                "loader": first.state_dict() if first else {},
                "config_digest": self.cfg.digest(), "config": self.cfg.to_toml(), **describe_versions(),
                # their classes: a resume with another optimizer is refused before its state is loaded into it
                "optimizers": {m.name: [type(o).__name__ for o in m.optimizers] for m in self._models}}
        with self.preempt.saving():
            if self.sharded:  # every rank writes its shards of every model and optimizer through DCP
                blocked = ckpt.save_sharded(self.steps, self._box(), [o for m in self._models for o in m.optimizers],
                                            trainer, rank_state, {**meta, "format": FORMAT_DCP},
                                            background=not final)
            elif single:  # the model's own names, as fit() writes them and scaletrain export reads them
                m = self._models[0]
                blocked = ckpt.save(self.steps, model_tensors(m.module), optimizer_tree(m.module, m.optimizers[0]),
                                    trainer, rank_state, meta, background=not final)
            else:
                models: dict[str, torch.Tensor] = {}
                optims: dict[str, Any] = {}
                for m in self._models:
                    models.update({f"{m.name}.{k}": v for k, v in m.module.state_dict().items()})
                    for i, opt in enumerate(m.optimizers):
                        optims[f"{m.name}/{i}"] = optimizer_tree(m.module, opt)
                blocked = ckpt.save(self.steps, dedupe(models), optims, trainer, rank_state, meta,
                                    background=not final)
            if final:
                ckpt.wait()
        self.timer.add("ckpt", blocked)
        self._checkpoint_s += blocked
        self._interval_started += blocked  # a save's stall is not training time

    def _generator_states(self) -> dict[str, Any]:
        return {name: rng.generator_state(gen) for name, gen in self._generators.items()}

    def _read_rank_state(self) -> dict[str, Any] | None:
        if self.resume is None:
            return None
        name = rank_file(self.rt.rank)
        if name not in self.resume.manifest["files"]:
            return None
        return read_tree(self.resume, name)

    def _restore(self, entry: _Model, weights_of: Resume | None = None) -> None:
        self._restoring = True
        try:
            self._restore_state(entry, weights_of)
        finally:
            self._restoring = False

    def _restore_state(self, entry: _Model, weights_of: Resume | None = None) -> None:
        """The checkpoint's state of one model and its optimizers (debug.skip_restore leaves weights or
        optimizer as built). Either layout: a single model and optimizer by their own names (fit()'s, and a
        one-model session's), or every model under its name. ``weights_of``: another checkpoint's weights only
        (checkpoint.load_best), not the resume's state."""
        resume = weights_of or self.resume
        assert resume is not None
        trainer = self._trainer if weights_of is None else _as_session(read_trainer(weights_of))
        skip = self.skip if weights_of is None else {*self.skip, "optimizer"}
        saved_names = trainer.get("models", [])
        if entry.name not in saved_names:
            raise CheckpointError(resume.path, f"it holds the models {saved_names}, not {entry.name!r}",
                                  "set up the same models, in the same order (or with the same name=)")
        bare = _bare(resume)
        prefix = "" if bare else f"{entry.name}."
        box = self._box([entry], bare=bare)
        # compared by the model's name and its parameters' (net.lin.weight), whichever layout was saved
        named = f"{entry.name}."
        held = entry.module.state_dict()
        want = {named + k: tuple(v.shape) for k, v in held.items() if isinstance(v, torch.Tensor)}
        saved = {named + k[len(prefix):]: v for k, v in saved_model_shapes(resume).items() if k.startswith(prefix)}
        if self._stage is not None:  # a pipeline stage holds its part of the saved model
            saved = {k: v for k, v in saved.items() if k in want}
        misfit = model_misfit(want, saved) if "weights" not in skip else None
        if misfit is not None:
            raise CheckpointError(resume.path, misfit, "set up the model the checkpoint was made with (the same "
                                  "configuration), or start a new --run.dir")
        weights, optimizers = "weights" not in skip, "optimizer" not in skip
        was = resume.meta.get("optimizers", {}).get(entry.name)  # their classes (older checkpoints: not said)
        now = [type(o).__name__ for o in entry.optimizers]
        if optimizers and was is not None and was != now:
            raise CheckpointError(resume.path, f"the optimizer state of {entry.name!r} is {', '.join(was)}'s, this run "
                                  f"sets up {', '.join(now)}", "set up the optimizers the checkpoint was made with (the "
                                  "state of one is not another's), or start a new --run.dir")
        if resume.meta.get("format") == FORMAT_DCP:
            self._restore_dcp(entry, box, bare, resume, skip)
        elif has_dtensors(entry.wrapped):  # a consolidated checkpoint (a DDP or one-process run) into shards
            # (a pipeline stage, FSDP- or TP-split, takes its part of them)
            tensors = {k: v for k, v in with_aliases(*read_model(resume)).items()
                       if k.startswith(prefix) and (self._stage is None or k in held)}
            trees = self._optimizer_trees(entry, bare, resume)
            tree = {"state": {prefix + k: v for t in trees for k, v in t["state"].items()},
                    "param_groups": [{**g, "params": [prefix + p for p in g["params"]]}
                                     for t in trees for g in t["param_groups"]]}
            load_full_into_sharded(box, entry.optimizers, tensors if weights else None,
                                   tree if optimizers else None)
        else:
            if weights:
                tensors, aliases = read_model(resume)
                if self._stage is not None:  # this stage's part of one process's weights
                    tensors, aliases = {k: v for k, v in with_aliases(tensors, aliases).items() if k in held}, {}
                if not bare:
                    tensors = {k[len(prefix):]: v for k, v in with_aliases(tensors, aliases).items()
                               if k.startswith(prefix)}
                    aliases = {}
                load_model_tensors(entry.module, {k: v.to(self.device) for k, v in tensors.items()}, aliases,
                                   str(resume.path))
            if optimizers:
                for opt, tree in zip(entry.optimizers, self._optimizer_trees(entry, bare, resume)):
                    load_optimizer_tree(entry.module, opt, tree, str(resume.path / OPTIMIZER))
        if self._rank_state is not None and weights_of is None:
            self._since = int(self._rank_state.get("since", 0))
            for k, v in self._rank_state.get("sums", {}).items():
                self._sums[k] = torch.tensor(float(v), device=self.device)

    def _optimizer_trees(self, entry: _Model, bare: bool, resume: Resume) -> list[dict[str, Any]]:
        """The saved optimizer trees of ``entry`` (consolidated format), one per optimizer set up; a pipeline
        stage's parameters' part of them."""
        trees = read_tree(resume, OPTIMIZER)
        if bare:
            trees = {f"{entry.name}/0": trees}
        for i in range(len(entry.optimizers)):
            if f"{entry.name}/{i}" not in trees:
                raise CheckpointError(resume.path, f"no optimizer {i} for {entry.name!r}",
                                      "set up the same optimizers for each model")
        mine = [trees[f"{entry.name}/{i}"] for i in range(len(entry.optimizers))]
        return mine if self._stage is None else [_stage_tree(tree, self._stage) for tree in mine]

    def _restore_dcp(self, entry: _Model, box: nn.Module, bare: bool, resume: Resume, skip: set[str]) -> None:
        """A DCP checkpoint (made by a sharded run) into one model and its optimizers, sharded or not, at any
        world size (DCP reshards). Collective: every rank sets up the same models in the same order."""
        prefix = "" if bare else f"{entry.name}."
        groups = [g for g in read_tree(resume, OPTIMIZER_GROUPS) if g["params"] and g["params"][0].startswith(prefix)]
        names = {id(p): name for name, p in box.named_parameters()}
        if self._stage is not None:  # a pipeline stage: its own parameters of the whole model's groups
            groups = _stage_groups(groups, set(names.values()), self._stage.held_as)
        live = [sorted(names[id(p)] for p in g["params"]) for opt in entry.optimizers for g in opt.param_groups]
        if [sorted(g["params"]) for g in groups] != live and "optimizer" not in skip:
            raise CheckpointError(resume.path, f"the optimizer param groups of {entry.name!r} differ",
                                  "set up the same optimizers, with the same parameter groups")
        load_dcp(box, entry.optimizers, resume, self.rank, skip, groups=groups)

    def _stopped(self, reason: str) -> None:
        assert self.services is not None
        record = self.services.stopped(self.steps, reason)
        self.close(finished=False)
        raise (Interrupted if reason == "SIGINT" else Preempted)(record)

    # -- the end -------------------------------------------------------------------------------------------

    def close(self, *, finished: bool = True, error: BaseException | None = None) -> dict[str, Any]:
        """Wait for the last checkpoint; when ``finished``, save one at the end (checkpoint.every > 0), write
        model.safetensors and summary.json (each tried even when the disk is full, as fit() does); end the
        process group. Returns the summary. Not ``finished`` because of ``error`` (by default the exception
        in flight, when close runs in an except or finally block): metrics.jsonl's last record says so."""
        if self._closed:
            return {}
        if not finished:
            self._failed(error if error is not None else sys.exc_info()[1])
        summary: dict[str, Any] = {}
        ckpt, services = self.checkpointer, self.services
        try:
            if finished and self.steps:
                if ckpt is not None and self.cfg.checkpoint.every > 0 and ckpt.last_step != self.steps:
                    self._save(final=False)  # as fit()'s last save: a failure is said once the outputs are written
                self._closing = True  # a failing gather from here on: the ranks may have left the loop apart
                if self._ran:
                    self._log()
                if self.timer.timeline is not None:
                    self.timer.timeline.flush()  # every rank's, before the summary's all-reduce
                summary = self._summary()
                if self.timer.timeline is not None and self.rt.is_main:
                    summary["timeline"] = str(merge_timeline(self.cfg.run_dir, self.world_size))
            if services is not None:
                services.settle(self.preempt)
            if finished and self.steps and self.cfg.checkpoint.load_best:
                self._load_best(summary)
            if finished and self.steps:
                summary_file = self.cfg.run_dir / "summary.json"
                write_outputs(self.steps, ckpt, [(WEIGHTS, self._write_weights), *(
                    [("summary.json", lambda: write_json(summary_file, summary))] if self.rt.is_main else [])])
        except DiskFull as err:  # metrics.jsonl: say what stays the latest checkpoint
            if services is None:
                raise
            raise services.disk_full(err) from None
        finally:
            self._release()
        return summary

    def _summary(self) -> dict[str, Any]:
        """The run's summary (the same on every rank): throughput and MFU in steady state (the log intervals
        after the warm-up, compile included), the goodput account, phases, the bottleneck, stragglers, memory;
        then whatever ``self.summarize`` adds (scaletrain train / fit(): epochs, evaluation, plan vs actual)."""
        assert self.services is not None
        cfg = self.cfg
        peak = torch.tensor([float(peak_bytes(self.device))], device=self.device)
        if self.rt.distributed:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        wall = time.perf_counter() - self.started
        totals = self.services.phase_totals
        steady, rate, good = run_totals(self._records, wall_s=wall, startup_s=self._first_step_at - self.started - self._eval_before,
                                        phase_totals=totals, eval_s=self._eval_s, checkpoint_s=self._checkpoint_s,
                                        earlier=self.services.earlier)
        timed = sum(r["step_time_s"] * r["steps"] for r in self._records)
        overall = self._seen[0] / timed if timed else 0.0
        rate = overall if rate is None else rate
        per = self._seen[1] / self._seen[0] if self._seen[0] else 0.0  # tokens per sample drawn
        rates = throughput(rate, flops=self.flops_per_sample, tokens_per_sample=per, world_size=self.world_size,  # type: ignore[arg-type]
                           peak=self._peak_flops)
        if "mfu" in rates and cfg.memory.activation_checkpointing == "full":
            rates["hfu"] = rates["mfu"] * 4 / 3  # the hardware also recomputes each block's forward in backward
        first = self._loaders[0].inner if self._loaders else None
        counted: dict[str, Any] = {"samples": self.samples_drawn()} if first is not None else {}
        if not self._seen[0]:  # no batch came through st.loader: nothing was counted, so no rate (not 0 samples/s)
            rate = overall = None
            rates = {k: None for k in rates if k.startswith(("samples", "tokens", "flops", "mfu", "hfu"))}
        summary = {
            "steps": self.steps, **counted, "world_size": self.world_size, "wall_s": wall, "train_s": self.train_time,
            "samples_per_s": rate, **rates, "samples_per_s_overall": overall, "steady_state": steady, "goodput": good,
            "metrics": self.last_metrics, "phase_frac": phase_fractions(totals),
            "bottleneck": bottleneck(totals, device=self.device.type, num_workers=cfg.data.num_workers,
                                     stream=bool(self._loaders) and isinstance(self._loaders[0].inner, StreamLoader),
                                     bucket_mb=cfg.parallel.bucket_mb, precision=cfg.train.precision,
                                     compiled=self.compiled,
                                     gpu_lead=statistics.median(self._lead_fracs) if self._lead_fracs else None,
                                     pipeline=(cfg.parallel.pp, check_pipeline(cfg.parallel), cfg.parallel.pp_schedule)
                                     if self._stage is not None else None, comm_in_compute=self._comm_in_compute()),
            "stragglers": self.services.stragglers.summary(), "peak_mem_bytes": int(peak.item()),
            "mem": self.last_mem, "skipped_steps": int(self._skipped_seen), "models": [m.name for m in self._models],
            **({"strategy": self.layout.strategy} if self.layout is not None else {}),
            "run_dir": str(cfg.run_dir), "device": str(self.device), "backend": self.rt.backend,
            "config_digest": cfg.digest(),
            "torch": torch.__version__, "scaletrain": __version__}
        if self._noise is not None and self._noise.last_b_big:
            summary["grad_noise_scale"] = self._noise.summary(self.world_size, per)
        if self.best is not None:
            summary["best_checkpoint"] = self.best
        return self.summarize(summary) if self.summarize is not None else summary

    def _load_best(self, summary: dict[str, Any]) -> None:
        """checkpoint.load_best, at a finished run's end (every save committed): the best checkpoint's weights into
        the models set up, so that model.safetensors and a model the caller holds are the best; their optimizers,
        the loaders and the RNG stay at the last step, as the last checkpoint has them. Collective."""
        from scaletrain.checkpoint import commit

        best = self.best
        if best is None:
            self.console.print("warning: checkpoint.load_best: no checkpoint was kept as the best (no evaluation "
                               "improved on the one before the first step), so the model keeps the last step's "
                               "weights")
            return

        def verified() -> Resume | str:
            path = Path(best["path"])
            try:
                return Resume(path, commit.verify(path))
            except CheckpointError as err:
                return str(err)

        found = runtime.rank0_decides(self.rt, verified)
        if isinstance(found, str):  # damaged or deleted since: the run's outputs matter more than this
            self.console.print(f"warning: checkpoint.load_best: {found.split('; fix:')[0]}; the model keeps the last "
                               "step's weights")
            return
        for entry in self._models:
            self._restore(entry, weights_of=found)
        if "best_checkpoint" in summary:
            summary["best_checkpoint"]["loaded"] = True
        self.console.print(f"loaded the weights of the best checkpoint (step {best['step']}) into the model: "
                           "model.safetensors holds them (checkpoint.load_best)")

    def _write_weights(self) -> None:
        """model.safetensors: one model's by its own names (however many optimizers it has: the README's
        load_model(model, path) takes them), several models' each under its name."""
        save_weights(self._box(bare=len(self._models) == 1), self.cfg.run_dir / WEIGHTS, sharded=self.sharded,
                     is_main=self.rt.is_main,
                     meta={"config_digest": self.cfg.digest(), "step": str(self.steps)})

    def _release(self) -> None:
        for loader in getattr(self, "_loaders", []):  # their DataLoader workers, while their queues are whole
            if isinstance(loader.inner, ShardedLoader):
                loader.inner.stop_workers()
        for held in getattr(self, "held_loaders", []):
            stop_workers(held)
        if getattr(self, "_watcher", None) is not None:
            self._watcher.stop()
        if getattr(self, "_profiler", None) is not None:
            self._profiler.stop()  # a run that ended inside the window: what was recorded
        self._closed = True
        self._progress["closed"] = True
        if hasattr(self, "console"):
            self.console.stop_progress()
        self.preempt.uninstall()
        if self.services is not None:
            self.services.close()
        self.writer.close()
        if getattr(self, "_trace", None) is not None:
            self._trace.close()
        for m in self._models:
            m.wrapped = m.module  # drop the DDP wrapper: it holds the process group
        if hasattr(self, "cfg"):
            release_run_dir(self.cfg.run_dir)  # after the last write to it
        # a model the caller holds, sharded over the group: the group stays open (until exit) for it
        held = getattr(self, "caller_holds", False) and any(has_dtensors(m.module) for m in self._models)
        runtime.close(self.rt, keep=held)

    def _usable(self, what: str) -> None:
        if self._closed:
            raise UserError(f"session.{what}() after the session closed; fix: call it inside `with "
                            "scaletrain.session(...) as st:`")

    def __enter__(self) -> Session:  # noqa: PYI034 -- typing.Self is 3.11+; we support 3.10
        return self

    def __exit__(self, kind: object, err: object, tb: object) -> None:
        self.close(finished=kind is None, error=err if isinstance(err, BaseException) else None)

    def _failed(self, error: BaseException | None) -> None:
        """The run's last record when it ends on an error (not a stop, which wrote its own): the step and the
        error's first line, so that `scaletrain report` says failed, and why, instead of "unfinished"."""
        if error is None or isinstance(error, (Interrupted, Preempted)) or self.services is None:
            return
        with contextlib.suppress(OSError, DiskFull):  # the error itself matters more than its record
            self.writer.write({"kind": "failed", "step": self.steps, "error": first_line(error)[:500]})


class _Trace(TraceFile):
    """debug.trace for a session: per step, digests of the batches drawn and of the state after the step
    (every model and optimizer, RNG, every loader), in train/trace.py's format, which verify-resume compares."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        super().__init__(run_dir, rank)
        self.used: dict[int, tuple[weakref.ref, int]] = {}  # id(param) -> its gradient an optimizer step used

    def batch(self, batch: Any, indices: list[int]) -> None:
        from scaletrain.batch import leaves

        self.batch_drawn(leaves(batch), indices)

    def _state(self, st: Session) -> dict[str, str]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        from scaletrain.train.state import IMPLEMENTATION

        skip = ("lr", "initial_lr", *IMPLEMENTATION)
        # The whole state by the models' names, the same under DDP and FSDP (gathered: collective there), so
        # that a resume across layouts can be checked against the checkpoint's step.
        full = StateDictOptions(full_state_dict=True)
        box = st._box()
        weights = get_model_state_dict(box, options=full)
        if st.world_size > 1 and any(isinstance(m.wrapped, DDP) and m.wrapped.broadcast_buffers for m in st._models):
            # DDP gives every rank rank 0's buffers at each forward: the statistics a rank's own BatchNorm kept
            # between steps are never used, and a checkpoint (rank 0's) gives it rank 0's. The buffers the next
            # step runs with are rank 0's, on every layout alike: those are the state (a collective, as above)
            params = {name for name, _ in box.named_parameters()}
            buffers = sorted(k for k in weights if k not in params)
            weights.update(zip(buffers, runtime.rank0_values([weights[k] for k in buffers])))
        optims = {}
        for m in st._models:
            if not all(opt.state for opt in m.optimizers):  # reading it would initialize it (a zero step)
                optims[m.name] = {}
                continue
            tree = get_optimizer_state_dict(st._box([m]), m.optimizers, options=full)
            groups = [{k: v for k, v in g.items() if k not in skip} for g in tree["param_groups"]]
            optims[m.name] = {"state": tree["state"], "param_groups": groups}
        return {"weights": digest(weights),
                "optimizer": digest(optims), "rng": digest([rng.capture(st.device), st._generator_states()]),
                "scheduler": digest([[g["lr"] for m in st._models for o in m.optimizers for g in o.param_groups],
                                     {name: obj.state_dict() for name, obj in st._tracked.items()}]),
                "loader": digest([loader.inner.state_dict() for loader in st._loaders])}

    lr = 0.0  # the lr the step runs at (the first param group's), read as it starts
    held: tuple[str, ...] = ()  # the models holding gradients no optimizer step used, as the step starts

    def applied(self, optimizer: Optimizer) -> None:
        """After ``optimizer``'s step: the gradients it used, as weak references (no memory kept) with their
        version counters (an in-place add bumps it)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.used[id(p)] = (weakref.ref(p.grad), p.grad._version)

    def _unused(self, p: torch.Tensor) -> bool:
        seen = self.used.get(id(p))
        return p.grad is not None and (seen is None or seen[0]() is not p.grad or seen[1] != p.grad._version)

    def started(self, st: Session) -> None:
        self.lr = next((g["lr"] for m in st._models for o in m.optimizers for g in o.param_groups), 0.0)
        # Gradients a step starts with that no optimizer step used are state no checkpoint holds: a GAN loop
        # whose generator loss reaches the discriminator after its zero_grad() hands them to the next step's
        # update, and a resumed run starts without them. (A loop's own backward before `with st.step():`
        # holds fresh ones in every run alike; the last step's, used, are left to a zero_grad() first.)
        self.held = tuple(m.name for m in st._models if any(self._unused(p) for p in m.module.parameters()))

    def step(self, st: Session) -> None:
        lr = self.lr
        logged = {k: float(v.item()) for k, v in st._sums.items()}  # host sync: debug.trace only
        self.write({"step": st.steps, "lr": lr, "held": list(self.held), "loss": digest(logged), **self.drawn(),
                    **self._state(st)})

    def resumed(self, st: Session) -> None:
        self.write({"step": st.steps, "event": "resume", **self._state(st)})

    def begun(self, st: Session) -> None:
        """The state a new run starts its first step from: two runs of a reproducible job start alike."""
        self.write({"step": 0, "event": "start", **self._state(st)})


def session(config: Config | Mapping[str, Any] | str | None = None, *, argv: list[str] | None = None) -> Session:
    """A Session for a loop of one's own (see scaletrain.train.session). ``config``: a Config, a mapping of
    dotted keys, or a recipe/TOML path; ``argv``: ``--section.key=value`` strings on top (by default the
    command line's: sys.argv[1:]'s --section.key options; ``argv=[]``: none)."""
    from scaletrain.errors import Reported, Stopped, install_excepthook

    try:
        return Session(config, argv=argv)
    except (Reported, Stopped):
        install_excepthook()
        raise


def _tp_arrivals(model: nn.Module, layout: Layout) -> Arrivals | None:
    """The Arrivals of this rank's tensor-parallel group (its name read off a tensor-parallel parameter's
    mesh), or None where torch's Flight Recorder is off (dist.flight_recorder=0): nothing to read then."""
    if not flight.enabled():
        return None
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            return Arrivals(mesh.get_group("tp").group_name, layout.groups("tp"))
    return None


def _stage_peers(layout: Layout) -> dict[int, list[int]]:
    """Each rank's straggler peers in a pipeline: the other ranks of its stage and tensor-parallel place (its
    data-parallel replicas, which do the same work); none where a stage has no replica (the detector then
    compares it with every rank: a slow stage and a slow rank are one there)."""
    return {r: [o for o in group if o != r] for group in layout.groups("dp_replicate", "dp_shard") for r in group}


def _stage_tree(tree: dict[str, Any], stage: nn.Module) -> dict[str, Any]:
    """One process's optimizer tree (a consolidated checkpoint) cut to a pipeline stage's parameters."""
    mine, held_as = {name for name, _ in stage.named_parameters()}, stage.held_as
    return {"state": {held_as.get(n, n): v for n, v in tree["state"].items() if held_as.get(n, n) in mine},
            "param_groups": _stage_groups(tree["param_groups"], mine, held_as)}


def _stage_groups(groups: list[dict[str, Any]], mine: set[str], held_as: dict[str, str]) -> list[dict[str, Any]]:
    """The saved param groups of the whole model (any layout's) cut to a pipeline stage's parameters ``mine``;
    a weight the stage holds a copy of under the copy's name (``held_as``: {the name stored: the copy})."""
    cut = [{**g, "params": [held_as.get(n, n) for n in g["params"] if held_as.get(n, n) in mine]} for g in groups]
    return [g for g in cut if g["params"]]


def _never_closed(progress: dict[str, Any], run_dir: Path) -> None:
    """At exit (or when a session is dropped) without close(): its checkpoints are whole, but model.safetensors
    and summary.json were never written, and the run never counts as finished; said, not silently exit 0. Not
    after an exception nobody caught: its traceback says what happened."""
    if progress["closed"] or not progress["steps"] or getattr(sys, "last_value", None) is not None:
        return
    print(f"scaletrain: warning: the session in {run_dir} was never closed after {progress['steps']} step(s): "
          "model.safetensors and summary.json were not written (its checkpoints are whole); fix: `with "
          "scaletrain.session(...) as st:` around the loop, or st.close() after it", file=sys.stderr)


def _held(state: Any) -> Any:
    """A tracked object's state as of now: its tensors copied to the host (an EMA's state_dict() holds its live
    weights, which the next step changes while a background save is still writing them)."""
    return map_tensors(state, lambda t: t.detach().to("cpu", copy=True))


def _same_start(model: nn.Module, name: str) -> None:
    """Every rank starts from rank 0's weights. A model built before the session (fit(model), a script's own
    construction) without a seed common to the ranks has other initial weights on each: DDP broadcasts rank 0's
    when it wraps, but FSDP would keep each rank's rows of its own (a model mixed from several initialisations,
    its unsharded buffers differing between replicas), and a pipeline each stage's from another draw. One
    all-gather of a fingerprint (the sum and the sum of squares of every tensor, in float64) says whether they
    differ; only then are the parameters and buffers broadcast from rank 0 (as Accelerate's sync_module_states
    does), with a warning."""
    tensors = [t for t in (*model.parameters(), *model.buffers()) if not t.is_complex()]
    if not tensors:
        return
    with torch.no_grad():
        mine = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for t in tensors]).sum(0)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        if all(torch.equal(e, every[0]) for e in every[1:]):
            return
        for t in tensors:
            dist.broadcast(t.data, src=0)
    if dist.get_rank() == 0:
        log.warning("%s's initial weights differed between the ranks (built before the session, without a seed "
                    "they share); every rank now starts from rank 0's, as DDP would make them", name)


def _check_optimizer(opt: Any, model: nn.Module) -> None:
    if not isinstance(opt, Optimizer):
        raise UserError(f"session.setup(): an optimizer argument gave a {type(opt).__name__}; fix: pass a torch "
                        "optimizer or a function of the parameters returning one")
    check_optimizer(opt, model)


def check_optimizer(opt: Optimizer, model: nn.Module, *, who: str = "session.setup()",
                    foreign: str = "of another model; fix: set up each model with its own optimizers",
                    stepped: str = "set up before training") -> None:
    """An optimizer given for ``model`` (to session.setup() or fit()): of its parameters only, and not stepped
    yet (its state would be restored over, or trained on, as if new). ``foreign``, ``stepped``: what ``who``
    says of each."""
    mine = {id(p) for p in model.parameters()}
    if any(id(p) not in mine for g in opt.param_groups for p in g["params"]):
        raise UserError(f"{who}: the optimizer holds parameters {foreign}")
    if opt.state:
        raise UserError(f"{who}: the optimizer has taken steps already; fix: {stepped}")


def resolve_config(config: Config | Mapping[str, Any] | str | None, argv: list[str] | None, *,
                   defaults: Mapping[str, Any], pinned: Mapping[str, Any] | None = None) -> Config:
    """What session() and fit() take: a Config, a mapping of dotted keys over ``defaults``, or a recipe/TOML path
    with ``pinned`` over it; then ``argv``'s --section.key=value strings on top of any of them (None: those of
    the command line, cli.options.command_line_options)."""
    from scaletrain.cli.options import command_line_options, parse_overrides

    cli = parse_overrides(command_line_options(sys.argv[1:]) if argv is None else argv)
    if isinstance(config, Config):
        return load(None, overrides=_flat(config), cli_overrides=cli) if cli else config
    if isinstance(config, str):
        return load(config, overrides=pinned, cli_overrides=cli)
    return load(None, overrides={**defaults, **(config or {})}, cli_overrides=cli)


def check_workers(cfg: Config) -> None:
    """fit() and session() join the workers a launcher started; they start none. ``--nproc 2`` given to a script
    that python runs as one process trained on one, without a word, and the user believed it was two."""
    from scaletrain.env import launcher_overrides, under_launcher

    if under_launcher():
        if said := launcher_overrides(cfg.dist.nproc):
            print(said, file=sys.stderr)
        return
    for key, value in (("dist.nproc", cfg.dist.nproc), ("dist.nnodes", cfg.dist.nnodes)):
        if value > 1:
            script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "SCRIPT.py"
            raise ConfigError(key, value, "1 in a script run as one process: fit() and session() join the "
                              "workers a launcher starts, and start none themselves",
                              f"scaletrain launch --nproc {cfg.dist.nproc} {script} (or torchrun "
                              f"--nproc_per_node {cfg.dist.nproc} {script}); on several machines add --nnodes and "
                              "--rdzv-endpoint to the launcher")


def _flat(cfg: Config) -> dict[str, Any]:
    return {f"{sec}.{k}": v for sec, values in cfg.to_dict().items() for k, v in values.items()}


__all__ = ["Loader", "Session", "session"]
