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
``st.last_metrics`` the last logged means.

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
import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.optim import Optimizer

from scaletrain import __version__, runtime
from scaletrain.batch import to_device, tokens_per_sample
from scaletrain.checkpoint import rng
from scaletrain.config import Config, load
from scaletrain.data import ShardedLoader
from scaletrain.errors import (
    CheckpointError,
    DiskFull,
    TrainingFailed,
    UserError,
    install_excepthook,
)
from scaletrain.observe.console import Console
from scaletrain.observe.goodput import run_totals
from scaletrain.observe.memory import peak_bytes
from scaletrain.observe.metrics import MetricsWriter, write_json, write_whole
from scaletrain.observe.stragglers import phase_fractions
from scaletrain.observe.timing import PHASES, NullTimer, StepTimer, attach_comm_hook, attach_fsdp_mark
from scaletrain.parallel import Layout, is_fsdp, parallelize, resolve_layout, units_line
from scaletrain.runtime import Runtime
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
from scaletrain.train.precision import autocast, check_precision, grad_scaler, slow_here
from scaletrain.train.preempt import Interrupted, Preempted, PreemptFlag, restart_line
from scaletrain.train.resume import load_dcp, load_full_into_sharded, model_misfit, saved_model_shapes
from scaletrain.train.rundir import agree_run_dir
from scaletrain.train.services import WEIGHTS, RunServices, write_outputs
from scaletrain.train.state import (
    dedupe,
    full_model_state,
    load_model_tensors,
    load_optimizer_tree,
    optimizer_tree,
    stored_once,
    with_aliases,
)
from scaletrain.train.trace import TraceFile, digest

OptimizerArg = Optimizer | Callable[[list[nn.Parameter]], Optimizer]


@dataclasses.dataclass
class _Model:
    name: str
    module: nn.Module  # the bare model: saving and restoring
    wrapped: nn.Module  # what the user calls: DDP-wrapped when the world is larger than 1
    optimizers: list[Optimizer]


class Loader:
    """One rank's shard of a data set for a loop of one's own: ``for batch in loader`` is the rest of the
    current epoch (then the next epoch begins), every batch on the session's device. Resumable: its position is
    in the session's checkpoints, and a resumed run continues mid-epoch with the next unseen batch."""

    def __init__(self, session: Session, inner: ShardedLoader) -> None:
        self._session, self.inner = session, inner
        self.waited = 0.0  # seconds this rank waited for batches since the last step began
        self.drawn = 0  # batches handed out since the last step began
        self.tokens_per_sample = -1  # read from the first batch (0: not token ids)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self.inner.epoch

    def __len__(self) -> int:
        return self.inner.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        batches = self.inner.epoch_batches()
        while True:
            self._session._start_training()  # the RNG is restored before anything can draw from it
            started = time.perf_counter()
            self._session.chaos.delay("data")
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.waited += time.perf_counter() - started
            self.drawn += 1
            if self.tokens_per_sample < 0:
                self.tokens_per_sample = tokens_per_sample(batch)
            if self._session._trace is not None:
                self._session._trace.batch(batch, self.inner.last_indices)
            yield to_device(batch, self._session.device)


class Session:
    """See the module docstring. Use it as a context manager (or call close()): closing waits for the last
    checkpoint, writes summary.json and the final weights, and ends the process group."""

    def __init__(self, config: Config | Mapping[str, Any] | str | None = None, *,
                 argv: list[str] | None = None) -> None:
        from scaletrain.cli.options import parse_overrides

        self.started = time.perf_counter()
        cli = parse_overrides(argv or [])
        if isinstance(config, Config):
            cfg = load(None, overrides=_flat(config), cli_overrides=cli) if cli else config
        elif isinstance(config, str):
            cfg = load(config, cli_overrides=cli)
        else:
            cfg = load(None, overrides={"run.name": "session", **(config or {})}, cli_overrides=cli)
        self.rt: Runtime = runtime.init(cfg.dist)
        # A stop (preemption, Ctrl-C) or one of our errors leaving the user's script ends it as the CLI does;
        # installed after init_process_group, which wraps the hook it finds in one that buffers stderr.
        install_excepthook()
        self._closed, self._in_step, self._training, self._timing = False, False, False, False
        self._models: list[_Model] = []
        self._tracked: dict[str, Any] = {}  # st.track(): name -> an object with state_dict()
        self._loaders: list[Loader] = []
        self.preempt = PreemptFlag(f"[rank {self.rt.rank}] " if self.rt.world_size > 1 else "").install()
        self.services: RunServices | None = None  # run dir, metrics, checkpoints, stragglers: as fit()'s loop's
        self.writer = MetricsWriter(None)
        self.checkpointer: Checkpointer | None = None
        try:
            self._open(cfg)
        except BaseException:
            self._release()
            raise

    def _open(self, cfg: Config) -> None:
        rt = self.rt
        check_precision(cfg.train.precision, rt.device, cfg.parallel.strategy)  # fp16-mixed: CUDA, not sharded
        self._nnodes = max(1, rt.world_size // rt.local_world_size)
        # The layout, once for every model set up (auto: per model, from its memory, in parallelize)
        self.layout: Layout | None = None if cfg.parallel.strategy == "auto" else \
            resolve_layout(cfg.parallel, cfg.memory, rt.world_size, self._nnodes)
        self.chaos = Chaos(cfg.chaos, rt.rank, rt.world_size)  # first: a rank beyond the world writes nothing
        runtime.set_deterministic(cfg.train.deterministic)
        runtime.seed_all(cfg.run.seed)  # the models built next get the same initial weights on every rank
        self.cfg = cfg = agree_run_dir(cfg, rt)
        self.console = Console(rt.is_main, progress=False)
        self.resume: Resume | None = find_resume(cfg.checkpoint, cfg.run_dir, rt,
                                                 lambda m: self.console.print(f"warning: {m}"))
        self._trainer = read_trainer(self.resume) if self.resume else {}
        self._rank_state = self._read_rank_state()
        self.steps = int(self._trainer.get("step", 0))  # optimizer steps completed (st.step() blocks)
        self.train_time = float(self._trainer.get("train_time_s", 0.0))
        run_dir = cfg.run_dir
        self.services = services = RunServices.open(cfg, rt, self.console, self.resume, started=self.started)
        self.writer, self.checkpointer = services.writer, services.checkpointer
        self.timer: StepTimer = StepTimer(rt.device) if cfg.log.phase_times else NullTimer(rt.device)
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
        self._eval_s = 0.0  # seconds in st.evaluating()
        self._trace = _Trace(run_dir, rt.rank) if cfg.debug.trace else None
        self.last_metrics: dict[str, float] = {}
        where = f"{rt.backend} on {rt.device}" if rt.distributed else f"single process on {rt.device}"
        self.console.print(f"scaletrain {__version__} session | world {rt.world_size} ({where}) | run dir {run_dir}")
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
        """True once train.max_steps steps ran (never when max_steps is 0: the loop decides)."""
        return 0 < self.cfg.train.max_steps <= self.steps

    def setup(self, model: nn.Module, *optimizers: OptimizerArg, name: str = "") -> tuple[Any, ...]:
        """Move ``model`` to the device, wrap it for the layout (DDP when the world is larger than 1), build or
        adopt its optimizers, and on resume restore both. Returns (the model to call, *the optimizers)."""
        self._usable("setup")
        if self._training:
            raise UserError("session.setup() after the first step; fix: set up every model and optimizer before "
                            "the loop starts")
        if not isinstance(model, nn.Module):
            raise UserError(f"session.setup(): the model is a {type(model).__name__}; fix: pass a torch.nn.Module")
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
        model.to(self.device)
        given = [opt for opt in optimizers if isinstance(opt, Optimizer)]
        for opt in given:
            _check_optimizer(opt, model)
        names = {id(p): n for n, p in model.named_parameters()}
        cfg = self.cfg
        wrapped = parallelize(model, self.device, self.world_size, cfg.parallel, compile=cfg.train.compile,
                              precision=cfg.train.precision, memory=cfg.memory, nnodes=self._nnodes,
                              optimizer=cfg.optim.name, layout=self.layout)
        if is_fsdp(wrapped):  # fully_shard replaced the parameters: an optimizer built before takes the shards
            now = dict(model.named_parameters())
            for opt in given:
                for group in opt.param_groups:
                    group["params"] = [now[names[id(p)]] for p in group["params"]]
        params = [p for p in model.parameters() if p.requires_grad]
        built = [opt if isinstance(opt, Optimizer) else opt(params) for opt in optimizers]
        for opt in built:
            if opt not in given:  # built here from the function given: checked now
                _check_optimizer(opt, model)
        attach_comm_hook(wrapped, self.timer if cfg.log.phase_times else None, overlap=cfg.parallel.overlap)
        attach_fsdp_mark(wrapped, self.timer if cfg.log.phase_times else None)
        if self.layout is None:  # auto: decided by this model's memory; the strategy given was checked at open
            check_precision(cfg.train.precision, self.device, "fsdp" if is_fsdp(wrapped) else "ddp")
        if self.scaler.is_enabled():
            for opt in built:
                opt.register_step_pre_hook(self._unscaled_step)
        units = units_line(model, cfg.parallel.fsdp_units, sharded=is_fsdp(wrapped),
                           blocks=cfg.memory.activation_checkpointing != "none" or cfg.train.compile)
        if units:
            self.console.print(f"{name} ({type(model).__name__.removeprefix('FSDP')}): {units}")
        entry = _Model(name, model, wrapped, built)
        if self.resume is not None:
            self._restore(entry)
        self._models.append(entry)
        return (wrapped, *built)

    def loader(self, dataset: Any, *, batch_size: int = 0, shuffle: bool | None = None) -> Loader:
        """This rank's shard of ``dataset`` (a torch Dataset, or (inputs, targets) tensors), ``batch_size`` per
        rank (0 = data.batch_size), reshuffled every epoch from run.seed, in the same order at any world size."""
        from scaletrain.data import in_memory

        self._usable("loader")
        data = in_memory(dataset, eval_data=dataset).train if not isinstance(dataset, torch.utils.data.Dataset) \
            else dataset
        b = batch_size or self.cfg.data.batch_size
        if len(data) < b * self.world_size:  # type: ignore[arg-type]
            raise UserError(f"session.loader(): {len(data)} samples cannot give every one of {self.world_size} "  # type: ignore[arg-type]
                            f"rank(s) a batch of {b}; fix: a smaller batch_size or more data")
        dp_rank, dp_size = (self.layout.dp_rank(self.rank), self.layout.dp_size) if self.layout else \
            (self.rank, self.world_size)
        inner = ShardedLoader(data, batch_size=b, rank=dp_rank, world=dp_size, accum=1,
                              seed=self.cfg.run.seed, shuffle=self.cfg.data.shuffle if shuffle is None else shuffle,
                              num_workers=self.cfg.data.num_workers, pin_memory=self.device.type == "cuda")
        saved = self._trainer.get("loaders", [])
        if len(saved) > len(self._loaders):
            inner.load_state_dict(saved[len(self._loaders)])
        inner.track_indices = self._trace is not None
        loader = Loader(self, inner)
        self._loaders.append(loader)
        return loader

    def track(self, obj: Any, *, name: str = "") -> Any:
        """Anything else a resume needs (an LR scheduler, a GradScaler, an EMA of the weights): an object with
        ``state_dict()`` and ``load_state_dict()``. Its state goes into every checkpoint and, on resume, is
        restored here. Track in the same order (or with the same ``name=``) in every run. Returns ``obj``."""
        from scaletrain.checkpoint.tree import split

        self._usable("track")
        if self._training:
            raise UserError("session.track() after the first step; fix: track everything before the loop starts")
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UserError(f"session.track(): a {type(obj).__name__} has no state_dict()/load_state_dict(); fix: "
                            "track an object that has both (an LR scheduler, a GradScaler, a module)")
        name = name or f"{type(obj).__name__}{len(self._tracked)}"
        if name in self._tracked or any(t is obj for t in self._tracked.values()):
            raise UserError(f"session.track(name={name!r}): tracked already; fix: track each object once, each "
                            "name once")
        try:
            split(obj.state_dict())
        except TypeError as err:
            raise UserError(f"session.track(): the state of a {type(obj).__name__} cannot be checkpointed ({err}); "
                            "fix: keep tensors, numbers, strings, lists and dicts in its state_dict()") from None
        if self.resume is not None:
            saved = self._trainer.get("tracked", {})
            if name not in saved:
                raise CheckpointError(self.resume.path, f"it tracked {sorted(saved)}, not {name!r}",
                                      "track the same objects, in the same order (or with the same name=)")
            obj.load_state_dict(saved[name])
            if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
                # Built after setup() restored its optimizer, the scheduler's constructor set the optimizer's
                # lr to the schedule's start; the saved position's lr goes back.
                for group, lr in zip(obj.optimizer.param_groups, obj.get_last_lr()):
                    group["lr"] = lr
        self._tracked[name] = obj
        return obj

    def autocast(self) -> contextlib.AbstractContextManager:
        """The run's compute precision (train.precision) for the forward passes inside it (under FSDP the
        sharding's mixed-precision policy casts, and this is a no-op)."""
        return autocast(self.cfg.train.precision, self.device, sharded=self.sharded)

    @property
    def sharded(self) -> bool:
        """True when the models set up are sharded (FSDP/HSDP): the checkpoints are DCP."""
        return any(is_fsdp(m.wrapped) for m in self._models)

    def _box(self, models: list[_Model] | None = None) -> nn.Module:
        """The models in one container, each under its name: one state dict for DCP (keys ``name.param``)."""
        return nn.ModuleDict({m.name: m.module for m in (self._models if models is None else models)})

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
        self._in_step = True
        if not self._timing:  # later steps start where the previous one ended: the batch wait is in them
            self.timer.start()
            self._timing = True
        self.timer.host("data", sum(loader.waited for loader in self._loaders))
        for loader in self._loaders:
            drawn = loader.drawn * loader.inner.micro_samples // self.world_size
            self._samples += drawn
            self._tokens += drawn * max(loader.tokens_per_sample, 0)
            loader.waited, loader.drawn = 0.0, 0
        try:
            yield
            if self._scaled:
                self.scaler.update()  # once per step, after every optimizer stepped
                self._scaled = False
            self.timer.mark("optim")
            self.timer.end()
            self.steps = step
            self._since += 1
            self._ran += 1
            self.preempt.tick()
            self._after_step()
        except RuntimeError as err:  # a peer died or hung in a collective: one line naming it
            raise runtime.collective_failure(err, self.rt, step, self.cfg.dist.timeout_s) from err
        finally:
            self._in_step = False
        self.timer.start()  # the next step begins now: waiting for its batch is part of it

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` (of the scaled loss under fp16-mixed), timed (compute and the exposed gradient
        communication), its value watched for NaN or infinity (named with the rank and step at the next log
        step)."""
        if not self._in_step:
            raise UserError("session.backward() outside `with st.step():`; fix: call it inside the step")
        self.chaos.delay("compute")
        loss = self.chaos.poison(self.steps + 1, loss)
        self.guard.watch_loss(self.steps + 1, loss.detach())
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
        norm = clipped_norm(params, clip, self.scaler, optimizer)
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
        return norm

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
            v = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else \
                torch.tensor(float(value), device=self.device)
            self._sums[key] = self._sums.get(key, torch.zeros((), device=self.device)) + v.to(self.device)

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
        try:
            with self.preempt.saving():
                yield
        finally:
            spent = time.perf_counter() - started
            self._eval_s += spent
            self._interval_started += spent
            if self._timing:
                self.timer.start()  # the next step's time begins after the evaluation

    def save(self) -> None:
        """A checkpoint now, at the last completed step (every rank calls it)."""
        self._usable("save")
        self._save(final=True)

    # -- step boundaries -----------------------------------------------------------------------------------

    def _start_training(self) -> None:
        if self._training:
            return
        self._training = True
        if self._rank_state is not None and "rng" in self._rank_state:
            rng.restore(self._rank_state["rng"], self.device)
        else:  # a new run, or a rank the checkpoint's smaller world did not have: dropout and noise differ by rank
            torch.manual_seed(self.cfg.run.seed + self.rank)
        if self._trace is not None and self.resume is not None:
            self._trace.resumed(self)
        self._interval_started = self._first_step_at = time.perf_counter()

    def _after_step(self) -> None:
        cfg = self.cfg
        ckpt = self.checkpointer
        assert ckpt is not None
        due = ckpt.due(self.steps, cfg.train.max_steps or -1)
        # A checkpoint step is a log step too: nothing is saved after a non-finite step unchecked.
        log_step = self.steps % cfg.log.every == 0 or self.done or due
        assert self.services is not None
        stop = self._log() if log_step else self.services.stop_signal(self.preempt)
        if self._trace is not None:
            self._trace.step(self)
        interrupt = self.chaos.interrupt_after(self.steps)  # the same on every rank: no agreement needed
        if stop or interrupt or due:
            self._save(final=bool(stop or interrupt))
        self.services.log_saves()
        if stop or interrupt:
            self._stopped(PreemptFlag.name(stop) if stop else "chaos.interrupt_step")

    def _gather(self) -> list[RankReport]:
        """Every rank's RankReport (train/interval.py): one all_gather, one host sync."""
        try:
            return gather(self.rt, self._sums, self.guard, signal=self.preempt.signum, peak=peak_bytes(self.device),
                          times=self.timer.collect(), lead=self.timer.lead_s, samples=self._samples,
                          tokens=self._tokens)
        except RuntimeError as err:  # rows of other lengths: other numbers of names
            raise UserError("session.log(): the ranks logged different names (or numbers of them) in this "
                            f"interval ({type(err).__name__}); fix: log the same names on every rank") from err

    def _log(self) -> int:
        rows = self._gather()
        if len({r.names for r in rows}) > 1:
            raise UserError("session.log(): the ranks logged different names in this interval; fix: log the same "
                            "names on every rank")
        self._nonfinite(rows)
        elapsed = time.perf_counter() - self._interval_started
        self.train_time += elapsed
        steps, ran = max(self._since, 1), max(self._ran, 1)
        means = {name: sum(r.sums[name] for r in rows) / (len(rows) * steps) for name in sorted(self._sums)}
        samples, tokens = sum(r.samples for r in rows), sum(r.tokens for r in rows)
        self._seen = [self._seen[0] + samples, self._seen[1] + tokens]
        phases = [r.phases for r in rows]
        assert self.services is not None
        straggler = self.services.interval(phases, ran)
        record: dict[str, Any] = {"kind": "train", "step": self.steps, **means,
                                  "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
                                  **({"tokens_per_s": tokens / elapsed} if tokens and elapsed > 0 else {}),
                                  "step_time_s": elapsed / ran}
        self._records.append({"step": self.steps, "steps": ran, "step_time_s": elapsed / ran,
                              "samples_per_s": record["samples_per_s"]})
        if self.cfg.log.phase_times:
            record["phase_s"] = {p: [r[p] for r in phases] for p in PHASES}
        if straggler is not None:
            record["straggler"] = straggler
        self.writer.write(record)
        text = " | ".join(f"{k} {v:.4f}" for k, v in means.items())
        self.console.print(f"step {self.steps:>6} | {text + ' | ' if text else ''}"
                           f"{record['samples_per_s']:,.0f} samples/s | {record['step_time_s']:.4f} s/step")
        self.last_metrics = means
        for value in self._sums.values():
            value.zero_()
        self._since, self._ran, self._samples, self._tokens = 0, 0, 0, 0
        self._interval_started = time.perf_counter()
        return next((r.signal for r in rows if r.signal), 0)

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

    def _save(self, *, final: bool) -> None:
        ckpt = self.checkpointer
        assert ckpt is not None
        if not self._models or self.steps == 0:
            return
        trainer = {"step": self.steps, "loaders": [loader.inner.state_dict() for loader in self._loaders],
                   "train_time_s": self.train_time, "models": [m.name for m in self._models],
                   "tracked": {name: obj.state_dict() for name, obj in self._tracked.items()},
                   "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {}}
        rank_state = {"rng": rng.capture(self.device), "since": self._since, "guard": self.guard.state_dict(),
                      "sums": {k: float(v.item()) for k, v in self._sums.items()}}
        meta = {"format": FORMAT_FULL, "session": True, "step": self.steps, "world_size": self.world_size,
                "global_batch": 0, "batch_size": 0, "accum_steps": 1,
                **({"layout": self.layout.as_dict()} if self.layout is not None else {}),
                "loader": self._loaders[0].inner.state_dict() if self._loaders else {},
                "config_digest": self.cfg.digest(), "config": self.cfg.to_toml(), **describe_versions()}
        with self.preempt.saving():
            if self.sharded:  # every rank writes its shards of every model and optimizer through DCP
                blocked = ckpt.save_sharded(self.steps, self._box(), [o for m in self._models for o in m.optimizers],
                                            trainer, rank_state, {**meta, "format": FORMAT_DCP},
                                            background=not final)
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
        self._interval_started += blocked  # as fit()'s loop: a save's stall is not training time

    def _read_rank_state(self) -> dict[str, Any] | None:
        if self.resume is None:
            return None
        name = rank_file(self.rt.rank)
        if name not in self.resume.manifest["files"]:
            return None
        return read_tree(self.resume, name)

    def _restore(self, entry: _Model) -> None:
        resume = self.resume
        assert resume is not None
        if not resume.meta.get("session"):
            raise CheckpointError(resume.path, "it was made by scaletrain train / fit(), not by a session",
                                  "resume it with the command that made it, or start a new --run.dir")
        saved_names = self._trainer.get("models", [])
        if entry.name not in saved_names:
            raise CheckpointError(resume.path, f"it holds the models {saved_names}, not {entry.name!r}",
                                  "set up the same models, in the same order (or with the same name=)")
        prefix = f"{entry.name}."
        box = self._box([entry])
        want = {k: tuple(v.shape) for k, v in box.state_dict().items() if isinstance(v, torch.Tensor)}
        saved = {k: v for k, v in saved_model_shapes(resume).items() if k.startswith(prefix)}
        misfit = model_misfit(want, saved)
        if misfit is not None:
            raise CheckpointError(resume.path, misfit, "set up the model the checkpoint was made with (the same "
                                  "configuration), or start a new --run.dir")
        if resume.meta.get("format") == FORMAT_DCP:
            self._restore_dcp(entry, box)
        elif is_fsdp(entry.wrapped):
            self._restore_full_into_sharded(entry, box)
        else:
            tensors, aliases = read_model(resume)
            full = with_aliases(tensors, aliases)
            mine = {k[len(prefix):]: v.to(self.device) for k, v in full.items() if k.startswith(prefix)}
            load_model_tensors(entry.module, mine, {}, str(resume.path))
            trees = self._optimizer_trees(entry)
            for opt, tree in zip(entry.optimizers, trees):
                load_optimizer_tree(entry.module, opt, tree, str(resume.path / OPTIMIZER))
        if self._rank_state is not None and entry is not None:
            self._since = int(self._rank_state.get("since", 0))
            for k, v in self._rank_state.get("sums", {}).items():
                self._sums[k] = torch.tensor(float(v), device=self.device)

    def _optimizer_trees(self, entry: _Model) -> list[dict[str, Any]]:
        """The saved optimizer trees of ``entry`` (consolidated format), one per optimizer set up."""
        assert self.resume is not None
        trees = read_tree(self.resume, OPTIMIZER)
        for i in range(len(entry.optimizers)):
            if f"{entry.name}/{i}" not in trees:
                raise CheckpointError(self.resume.path, f"no optimizer {i} for {entry.name!r}",
                                      "set up the same optimizers for each model")
        return [trees[f"{entry.name}/{i}"] for i in range(len(entry.optimizers))]

    def _restore_dcp(self, entry: _Model, box: nn.Module) -> None:
        """A DCP checkpoint (made by a sharded session) into one model and its optimizers, sharded or not, at
        any world size (DCP reshards). Collective: every rank sets up the same models in the same order."""
        resume = self.resume
        assert resume is not None
        prefix = f"{entry.name}."
        groups = [g for g in read_tree(resume, OPTIMIZER_GROUPS) if g["params"] and g["params"][0].startswith(prefix)]
        names = {id(p): name for name, p in box.named_parameters()}
        live = [sorted(names[id(p)] for p in g["params"]) for opt in entry.optimizers for g in opt.param_groups]
        if [sorted(g["params"]) for g in groups] != live:
            raise CheckpointError(resume.path, f"the optimizer param groups of {entry.name!r} differ",
                                  "set up the same optimizers, with the same parameter groups")
        load_dcp(box, entry.optimizers, resume, self.rank, groups=groups)

    def _restore_full_into_sharded(self, entry: _Model, box: nn.Module) -> None:
        """A consolidated checkpoint (a DDP or one-process session) into a sharded model (load_full_into_sharded),
        its names and its optimizers' under the model's name, as the container ``box`` has them."""
        resume = self.resume
        assert resume is not None
        prefix = f"{entry.name}."
        tensors = {k: v for k, v in with_aliases(*read_model(resume)).items() if k.startswith(prefix)}
        trees = self._optimizer_trees(entry)
        tree = {"state": {prefix + k: v for t in trees for k, v in t["state"].items()},
                "param_groups": [{**g, "params": [prefix + p for p in g["params"]]}
                                 for t in trees for g in t["param_groups"]]}
        load_full_into_sharded(box, entry.optimizers, tensors, tree)

    def _stopped(self, reason: str) -> None:
        assert self.services is not None
        record = self.services.stopped(self.steps, reason)
        self.close(finished=False)
        raise (Interrupted if reason == "SIGINT" else Preempted)(record)

    # -- the end -------------------------------------------------------------------------------------------

    def close(self, *, finished: bool = True) -> dict[str, Any]:
        """Wait for the last checkpoint; when ``finished``, save one at the end (checkpoint.every > 0), write
        model.safetensors and summary.json (each tried even when the disk is full, as fit() does); end the
        process group. Returns the summary."""
        if self._closed:
            return {}
        summary: dict[str, Any] = {}
        ckpt, services = self.checkpointer, self.services
        try:
            if finished and self.steps:
                if ckpt is not None and self.cfg.checkpoint.every > 0 and ckpt.last_step != self.steps:
                    self._save(final=False)  # as fit()'s last save: a failure is said once the outputs are written
                if self._ran:
                    self._log()
                summary = self._summary()
            if services is not None:
                services.settle(self.preempt)
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
        assert self.services is not None
        peak = torch.tensor([float(peak_bytes(self.device))], device=self.device)
        if self.rt.distributed:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        wall = time.perf_counter() - self.started
        totals = self.services.phase_totals
        steady, rate, good = run_totals(self._records, wall_s=wall, startup_s=self._first_step_at - self.started,
                                        phase_totals=totals, eval_s=self._eval_s, checkpoint_s=self._checkpoint_s,
                                        earlier=self.services.earlier)
        if rate is None:  # no steady state: the last interval's
            rate = self._records[-1]["samples_per_s"] if self._records else 0.0
        per = self._seen[1] / self._seen[0] if self._seen[0] else 0.0  # tokens per sample drawn
        return {"steps": self.steps, "world_size": self.world_size, "wall_s": wall, "samples_per_s": rate,
                **({"tokens_per_s": rate * per} if per else {}),
                "steady_state": steady, "goodput": good, "train_s": self.train_time, "metrics": self.last_metrics,
                "phase_frac": phase_fractions(totals),
                "stragglers": self.services.stragglers.summary(), "peak_mem_bytes": int(peak.item()),
                "models": [m.name for m in self._models], "device": str(self.device), "backend": self.rt.backend,
                "config_digest": self.cfg.digest(), "torch": torch.__version__, "scaletrain": __version__}

    def _write_weights(self) -> None:
        import safetensors.torch

        box = self._box()
        full = full_model_state(box, sharded=self.sharded)  # collective under FSDP: every rank gathers
        if not self.rt.is_main:
            return
        tensors, aliases = stored_once(box, {k: v.detach().cpu().contiguous() for k, v in full.items()},
                                       sharded=self.sharded)
        meta = {"config_digest": self.cfg.digest(), "step": str(self.steps), "aliases": json.dumps(aliases)}
        write_whole(self.cfg.run_dir / WEIGHTS, sum(t.nbytes for t in tensors.values()),
                    lambda tmp: safetensors.torch.save_file(tensors, str(tmp), metadata=meta))

    def _release(self) -> None:
        self._closed = True
        self.preempt.uninstall()
        if self.services is not None:
            self.services.close()
        self.writer.close()
        if getattr(self, "_trace", None) is not None:
            self._trace.close()
        for m in self._models:
            m.wrapped = m.module  # drop the DDP wrapper: it holds the process group
        runtime.close(self.rt)

    def _usable(self, what: str) -> None:
        if self._closed:
            raise UserError(f"session.{what}() after the session closed; fix: call it inside `with "
                            "scaletrain.session(...) as st:`")

    def __enter__(self) -> Session:  # noqa: PYI034 -- typing.Self is 3.11+; we support 3.10
        return self

    def __exit__(self, kind: object, err: object, tb: object) -> None:
        self.close(finished=kind is None)


class _Trace(TraceFile):
    """debug.trace for a session: per step, digests of the batches drawn and of the state after the step
    (every model and optimizer, RNG, every loader), in train/trace.py's format, which verify-resume compares."""

    def batch(self, batch: Any, indices: list[int]) -> None:
        from scaletrain.batch import leaves

        self.batch_drawn(leaves(batch), indices)

    def _state(self, st: Session) -> dict[str, str]:
        from scaletrain.train.state import IMPLEMENTATION

        skip = ("lr", "initial_lr", *IMPLEMENTATION)
        # The whole state by the models' names, the same under DDP and FSDP (gathered: collective there), so
        # that a resume across layouts can be checked against the checkpoint's step.
        full = StateDictOptions(full_state_dict=True)
        weights = get_model_state_dict(st._box(), options=full)
        optims = {}
        for m in st._models:
            if not all(opt.state for opt in m.optimizers):  # reading it would initialize it (a zero step)
                optims[m.name] = {}
                continue
            tree = get_optimizer_state_dict(st._box([m]), m.optimizers, options=full)
            groups = [{k: v for k, v in g.items() if k not in skip} for g in tree["param_groups"]]
            optims[m.name] = {"state": tree["state"], "param_groups": groups}
        return {"weights": digest(weights),
                "optimizer": digest(optims), "rng": digest(rng.capture(st.device)),
                "scheduler": digest([[g["lr"] for m in st._models for o in m.optimizers for g in o.param_groups],
                                     {name: obj.state_dict() for name, obj in st._tracked.items()}]),
                "loader": digest([loader.inner.state_dict() for loader in st._loaders])}

    def step(self, st: Session) -> None:
        lr = next((g["lr"] for m in st._models for o in m.optimizers for g in o.param_groups), 0.0)
        logged = {k: float(v.item()) for k, v in st._sums.items()}  # host sync: debug.trace only
        self.write({"step": st.steps, "lr": lr, "loss": digest(logged), **self.drawn(), **self._state(st)})

    def resumed(self, st: Session) -> None:
        self.write({"step": st.steps, "event": "resume", **self._state(st)})


def session(config: Config | Mapping[str, Any] | str | None = None, *, argv: list[str] | None = None) -> Session:
    """A Session for a loop of one's own (see scaletrain.train.session). ``config``: a Config, a mapping of
    dotted keys, or a recipe/TOML path; ``argv``: ``--section.key=value`` strings on top (e.g. sys.argv[1:])."""
    from scaletrain.errors import Reported, Stopped, install_excepthook

    try:
        return Session(config, argv=argv)
    except (Reported, Stopped):
        install_excepthook()
        raise


def _check_optimizer(opt: Any, model: nn.Module) -> None:
    if not isinstance(opt, Optimizer):
        raise UserError(f"session.setup(): an optimizer argument gave a {type(opt).__name__}; fix: pass a torch "
                        "optimizer or a function of the parameters returning one")
    mine = {id(p) for p in model.parameters()}
    if any(id(p) not in mine for g in opt.param_groups for p in g["params"]):
        raise UserError("session.setup(): the optimizer holds parameters of another model; fix: set up each model "
                        "with its own optimizers")
    if opt.state:
        raise UserError("session.setup(): the optimizer has taken steps already; fix: set up before training")


def _flat(cfg: Config) -> dict[str, Any]:
    return {f"{sec}.{k}": v for sec, values in cfg.to_dict().items() for k, v in values.items()}


__all__ = ["Loader", "Session", "session"]
