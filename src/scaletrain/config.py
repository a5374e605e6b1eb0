"""The config tree: typed sections, TOML recipes, command-line overrides, validation.

Precedence is defaults < recipe/TOML file < command line. Every field carries a one-line docstring that
becomes its ``--help`` text. Parsing is a pure function of its inputs; every mistake raises
:class:`~scaletrain.errors.ConfigError` naming the key, the value, what is allowed and the fix.
Sections are frozen once built: validated once, then read-only.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import inspect
import itertools
import json
import re
import sys
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import tomli_w

from scaletrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _check(ok: bool, key: str, value: Any, expected: str, fix: str) -> None:
    if not ok:
        raise ConfigError(key, value, expected, fix)


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    """Run name; the default run directory is runs/<name>."""
    dir: str = ""
    """Run directory for config.toml, metrics.jsonl, summary.json, model.safetensors ('' = runs/<name>)."""
    seed: int = 0
    """Seed for model init and data order; dropout on rank r draws from seed + r."""

    def __post_init__(self) -> None:
        _check(bool(self.name.strip()), "run.name", self.name, "a non-empty name", "--run.name=myrun")
        _check(self.seed >= 0, "run.seed", self.seed, "an integer >= 0", "--run.seed=0")


@dataclass(frozen=True)
class DistConfig:
    device: str = "auto"
    """Device: auto (cuda:LOCAL_RANK if CUDA is present, else cpu), cpu, cuda, or cuda:N."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    nproc: int = 1
    """Worker processes to start on this machine (through torchrun) when not already under torchrun."""
    timeout_s: int = 600
    """Seconds a collective may wait for the other ranks before the job fails."""
    nnodes: int = 1
    """Machines in the job (each runs the same command; they meet at rdzv_endpoint)."""
    rdzv_endpoint: str = ""
    """HOST:PORT where the machines of a multi-node job meet ('' = this machine, a free port)."""
    rdzv_id: str = ""
    """Job id shared by all machines of one job ('' = scaletrain-<run.name>; under 'launch': scaletrain-<SCRIPT>)."""
    max_restarts: int = 0
    """Times torchrun restarts the worker group after a worker fails."""

    def __post_init__(self) -> None:
        dev = self.device
        ok = dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())
        _check(ok, "dist.device", dev, "auto, cpu, cuda or cuda:N", "--device=auto")
        _check(self.nproc >= 1, "dist.nproc", self.nproc, "an integer >= 1", "--nproc 2")
        _check(self.timeout_s >= 1, "dist.timeout_s", self.timeout_s, "an integer >= 1", "--dist.timeout_s=600")
        _check(self.nnodes >= 1, "dist.nnodes", self.nnodes, "an integer >= 1", "--nnodes 2")
        _check(self.nnodes == 1 or bool(self.rdzv_endpoint), "dist.rdzv_endpoint", self.rdzv_endpoint,
               "HOST:PORT of the first machine when nnodes > 1", "--rdzv-endpoint=node0:29500")
        host, _, port = self.rdzv_endpoint.rpartition(":")
        _check(not self.rdzv_endpoint or (bool(host) and port.isdigit()), "dist.rdzv_endpoint",
               self.rdzv_endpoint, "HOST:PORT", "--rdzv-endpoint=node0:29500")
        _check(self.max_restarts >= 0, "dist.max_restarts", self.max_restarts, "an integer >= 0",
               "--max-restarts 3")


@dataclass(frozen=True)
class DataConfig:
    source: Literal["digits", "stdlib", "bin", "memory"] = "digits"
    """Data: digits (sklearn's 8x8 digits), stdlib (bytes of Python's own stdlib .py files), bin (token .bin memmaps), memory (tensors/arrays passed to fit())."""
    path: str = ""
    """For source=bin: a directory holding train.bin and val.bin (uint16 tokens, the nanoGPT layout)."""
    batch_size: int = 32
    """Samples per rank per micro-step; global batch = batch_size x world size x accumulation."""
    eval_batch_size: int = 0
    """Samples per rank per eval step (0 = batch_size)."""
    seq_len: int = 128
    """Tokens per sample for text sources (stdlib, bin)."""
    val_fraction: float = 0.2
    """Held-out fraction for sources without their own split (digits, memory without eval data)."""
    shuffle: bool = True
    """Reshuffle the training set every epoch from the seed (the order is independent of world size)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 = load in the training process)."""

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, "data.batch_size", self.batch_size, "an integer >= 1", "--data.batch_size=32")
        _check(self.eval_batch_size >= 0, "data.eval_batch_size", self.eval_batch_size, "an integer >= 0",
               "--data.eval_batch_size=0 (same as batch_size)")
        _check(self.seq_len >= 1, "data.seq_len", self.seq_len, "an integer >= 1", "--data.seq_len=128")
        _check(0.0 < self.val_fraction < 1.0, "data.val_fraction", self.val_fraction, "a number in (0, 1)",
               "--data.val_fraction=0.2")
        _check(self.num_workers >= 0, "data.num_workers", self.num_workers, "an integer >= 0", "--data.num_workers=0")
        _check(self.source != "bin" or bool(self.path), "data.path", self.path,
               "a directory with train.bin and val.bin when data.source=bin", "--data.path=data/mycorpus")


@dataclass(frozen=True)
class ModelConfig:
    name: Literal["mlp", "cnn", "gpt"] = "cnn"
    """Built-in model: mlp, cnn (for 8x8 images) or gpt (causal transformer over tokens)."""
    hidden: int = 128
    """mlp and cnn: width of the hidden dense layer."""
    channels: int = 32
    """cnn: channels of the first convolution (the second has twice as many)."""
    n_layer: int = 4
    """gpt: transformer blocks."""
    n_head: int = 4
    """gpt: attention heads (must divide n_embd)."""
    n_embd: int = 128
    """gpt: embedding width."""
    dropout: float = 0.0
    """Dropout probability (0 disables it)."""
    vocab_size: int = 0
    """gpt: vocabulary size (0 = taken from the data)."""

    def __post_init__(self) -> None:
        for key in ("hidden", "channels", "n_layer", "n_head", "n_embd"):
            value = getattr(self, key)
            _check(value >= 1, f"model.{key}", value, "an integer >= 1", f"--model.{key}=4")
        _check(self.n_embd % self.n_head == 0, "model.n_head", self.n_head,
               f"a divisor of model.n_embd={self.n_embd}", "choose n_head so that n_embd % n_head == 0")
        _check(0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "a number in [0, 1)", "--model.dropout=0.1")
        _check(self.vocab_size >= 0, "model.vocab_size", self.vocab_size, "an integer >= 0 (0 = from the data)",
               "--model.vocab_size=0")


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["sgd", "adamw"] = "adamw"
    """Optimizer: sgd (with momentum) or adamw."""
    lr: float = 1e-3
    """Base learning rate (the peak after warmup, before scaling by the linear rule)."""
    scale_lr: bool = False
    """Linear scaling rule: peak lr = lr x global_batch / base_batch (Goyal et al. 2017)."""
    base_batch: int = 256
    """The global batch at which lr was tuned (used by scale_lr)."""
    momentum: float = 0.9
    """sgd: momentum."""
    nesterov: bool = False
    """sgd: Nesterov momentum."""
    weight_decay: float = 0.0
    """Decoupled weight decay (adamw) or L2 penalty (sgd)."""
    beta1: float = 0.9
    """adamw: first-moment decay."""
    beta2: float = 0.999
    """adamw: second-moment decay."""
    grad_clip: float = 0.0
    """Clip the global gradient norm to this value (0 = no clipping)."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", self.lr, "a number > 0", "--optim.lr=1e-3")
        _check(self.base_batch >= 1, "optim.base_batch", self.base_batch, "an integer >= 1", "--optim.base_batch=256")
        _check(0.0 <= self.momentum < 1.0, "optim.momentum", self.momentum, "a number in [0, 1)", "--optim.momentum=0.9")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "a number >= 0",
               "--optim.weight_decay=0.01")
        for key in ("beta1", "beta2"):
            value = getattr(self, key)
            _check(0.0 <= value < 1.0, f"optim.{key}", value, "a number in [0, 1)", f"--optim.{key}=0.9")
        _check(not self.nesterov or self.momentum > 0, "optim.nesterov", True, "false when optim.momentum = 0",
               "--optim.momentum=0.9 or --optim.nesterov=false")
        _check(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "a number >= 0 (0 = off)", "--optim.grad_clip=1.0")


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_steps: int = 0
    """Steps of linear warmup from warmup_start x peak lr up to the peak lr."""
    warmup_start: float = 0.0
    """LR at step 0 as a fraction of the peak (Goyal et al. start from the unscaled lr: 1/k)."""
    decay: Literal["cosine", "linear", "step", "constant"] = "cosine"
    """After warmup: cosine or linear decay to min_lr_ratio x peak, step decay, or constant."""
    min_lr_ratio: float = 0.0
    """cosine/linear: final lr as a fraction of the peak."""
    step_every: int = 0
    """step decay: multiply the lr by gamma every this many steps after warmup (0 = a third of them)."""
    gamma: float = 0.1
    """step decay: the factor applied at each step."""

    def __post_init__(self) -> None:
        _check(self.warmup_steps >= 0, "schedule.warmup_steps", self.warmup_steps, "an integer >= 0",
               "--schedule.warmup_steps=100")
        _check(0.0 <= self.warmup_start <= 1.0, "schedule.warmup_start", self.warmup_start, "a number in [0, 1]",
               "--schedule.warmup_start=0")
        _check(0.0 <= self.min_lr_ratio <= 1.0, "schedule.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]",
               "--schedule.min_lr_ratio=0.1")
        _check(self.step_every >= 0, "schedule.step_every", self.step_every, "an integer >= 0",
               "--schedule.step_every=1000")
        _check(0.0 < self.gamma <= 1.0, "schedule.gamma", self.gamma, "a number in (0, 1]", "--schedule.gamma=0.1")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    """Passes over the training set (ignored when max_steps > 0)."""
    max_steps: int = 0
    """Optimizer steps to run; > 0 overrides epochs."""
    accum_steps: int = 1
    """Micro-steps accumulated per optimizer step (gradients are all-reduced on the last one only)."""
    global_batch: int = 0
    """Samples per optimizer step across all ranks; > 0 derives accum_steps from it (0 = use accum_steps)."""
    precision: Literal["fp32", "bf16-mixed", "fp16-mixed"] = "fp32"
    """Compute precision: fp32, or bf16/fp16 compute with fp32 master weights (autocast; FSDP's MixedPrecisionPolicy under fsdp/hsdp); fp16 adds a gradient scaler (CUDA only)."""
    tf32: bool = True
    """CUDA: let fp32 matmuls and convolutions use TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32), as PyTorch recommends on Ampere and newer; false = full fp32."""
    compile: bool = False
    """Compile the model with torch.compile before wrapping it for data parallelism."""
    eval_every: int = 0
    """Evaluate every this many optimizer steps (0 = at the end of every epoch, and at the end)."""
    eval_batches: int = 100
    """Eval batches per rank per evaluation, spread evenly over the held-out split (0 = the whole split)."""
    progress: bool = True
    """Show a progress bar on rank 0 when the console is a terminal."""
    deterministic: bool = False
    """Deterministic kernels (torch.use_deterministic_algorithms, cuDNN deterministic): bitwise-repeatable GPU runs, somewhat slower."""
    nonfinite: Literal["raise", "skip"] = "raise"
    """A non-finite loss or gradient on any rank: raise (stop, naming rank and step) or skip the step and count it."""

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "train.epochs", self.epochs, "an integer >= 1", "--train.epochs=10")
        _check(self.max_steps >= 0, "train.max_steps", self.max_steps, "an integer >= 0 (0 = use epochs)",
               "--train.max_steps=1000")
        _check(self.accum_steps >= 1, "train.accum_steps", self.accum_steps, "an integer >= 1",
               "--train.accum_steps=1")
        _check(self.global_batch >= 0, "train.global_batch", self.global_batch, "an integer >= 0 (0 = derived)",
               "--train.global_batch=256")
        _check(self.eval_every >= 0, "train.eval_every", self.eval_every, "an integer >= 0", "--train.eval_every=0")
        _check(self.eval_batches >= 0, "train.eval_batches", self.eval_batches,
               "an integer >= 0 (0 = the whole held-out split)", "--train.eval_batches=100")


@dataclass(frozen=True)
class LogConfig:
    every: int = 10
    """Gather loss, phase times and memory from every rank and log them every this many optimizer steps (the loop's only sync point)."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard events to RUN_DIR/tensorboard (needs the tensorboard package)."""
    phase_times: bool = True
    """Time each step's phases per rank (data, h2d, compute, exposed comm, optim): stragglers and the bottleneck verdict need them."""
    straggler_min_frac: float = 0.25
    """Name a rank a straggler only when it is persistently slower than the others by at least this fraction of the step time (ranks sharing CPUs trade about a tenth of it back and forth; lower it on dedicated hardware)."""

    def __post_init__(self) -> None:
        _check(self.every >= 1, "log.every", self.every, "an integer >= 1", "--log.every=10")
        _check(0 < self.straggler_min_frac, "log.straggler_min_frac", self.straggler_min_frac,
               "a fraction of the step time > 0", "--log.straggler_min_frac=0.25")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0
    """Save a checkpoint every this many optimizer steps, and at the end (0 = only when preempted)."""
    keep: int = 3
    """Complete checkpoints kept; older ones are deleted once a newer one is committed (0 = keep all)."""
    resume: str = "auto"
    """auto (the latest complete checkpoint in the run directory, if any), never, or the path of a checkpoint."""
    preempt_check: Literal["log", "step"] = "log"
    """When the ranks agree on a preemption signal: at the next log step (inside its one gather, no extra collective), or at every step boundary (one non-blocking all-reduce of the flag per step on a Gloo group of its own: the save starts within two steps of the signal)."""
    async_save: bool = True
    """Write checkpoints on a background thread (every rank's, for the DCP shards of FSDP runs); the loop is blocked only while the state is copied to host memory."""

    def __post_init__(self) -> None:
        _check(self.every >= 0, "checkpoint.every", self.every, "an integer >= 0 (0 = off)",
               "--checkpoint.every=500")
        _check(self.keep >= 0, "checkpoint.keep", self.keep, "an integer >= 0 (0 = keep all)", "--checkpoint.keep=3")
        _check(bool(self.resume.strip()), "checkpoint.resume", self.resume, "auto, never or a checkpoint path",
               "--checkpoint.resume=auto")


@dataclass(frozen=True)
class ChaosConfig:
    """Fault injection, off by default: rehearse failures on purpose. Kills, hangs and signals fire on a job's
    first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT = 0), so a restarted job gets past them."""

    kill_rank: int = -1
    """SIGKILL this rank at the start of step kill_step (-1 = off)."""
    kill_step: int = 0
    """The step (1-based optimizer step) at whose start kill_rank dies."""
    nan_rank: int = -1
    """Make this rank's loss NaN at step nan_step (-1 = off)."""
    nan_step: int = 0
    """The step whose loss becomes NaN on nan_rank."""
    hang_rank: int = -1
    """Hang this rank (sleep hang_s) at the start of step hang_step (-1 = off)."""
    hang_step: int = 0
    """The step at whose start hang_rank hangs."""
    hang_s: float = 3600.0
    """Seconds hang_rank sleeps."""
    delay_rank: int = -1
    """Slow this rank down by delay_ms on every step, in delay_phase (-1 = off)."""
    delay_phase: Literal["data", "compute"] = "data"
    """Where the delay goes: data (before the batch arrives) or compute (between forward and backward)."""
    delay_ms: float = 0.0
    """Milliseconds of delay per step on delay_rank."""
    interrupt_step: int = 0
    """Act as if preempted at the end of this step: save a checkpoint and exit 0 (0 = off)."""
    signal_rank: int = -1
    """Send signal_name at the start of signal_step from this rank: rehearses preemption (or Ctrl-C) end to end (-1 = off)."""
    signal_step: int = 0
    """The step at whose start signal_rank is signalled."""
    signal_name: Literal["SIGUSR1", "SIGTERM", "SIGINT"] = "SIGUSR1"
    """SIGUSR1 (as Slurm's --signal) or SIGTERM go to signal_rank's own process; SIGINT goes where a terminal's Ctrl-C goes, to the launcher's whole process group (this process's group without a launcher)."""

    def __post_init__(self) -> None:
        for key in ("kill", "nan", "hang", "delay", "signal"):
            rank = getattr(self, f"{key}_rank")
            _check(rank >= -1, f"chaos.{key}_rank", rank, "a rank >= 0, or -1 for off", f"--chaos.{key}_rank=1")
        for key in ("kill_step", "nan_step", "hang_step", "interrupt_step", "signal_step"):
            value = getattr(self, key)
            _check(value >= 0, f"chaos.{key}", value, "a step >= 0", f"--chaos.{key}=10")
        _check(self.hang_s >= 0, "chaos.hang_s", self.hang_s, "seconds >= 0", "--chaos.hang_s=60")
        _check(self.delay_ms >= 0, "chaos.delay_ms", self.delay_ms, "milliseconds >= 0", "--chaos.delay_ms=30")
        _check(self.signal_name in ("SIGUSR1", "SIGTERM", "SIGINT"), "chaos.signal_name", self.signal_name,
               "SIGUSR1, SIGTERM or SIGINT", "--chaos.signal_name=SIGINT")


RESTORABLE = ("weights", "optimizer", "rng", "data", "scheduler")


@dataclass(frozen=True)
class DebugConfig:
    trace: bool = False
    """Write per-step fingerprints (weights, optimizer, RNG, data, LR) to RUN_DIR/trace/ (a host sync and hashing every step; used by verify-resume)."""
    skip_restore: str = ""
    """Parts of a checkpoint NOT to restore on resume, comma-separated (weights, optimizer, rng, data, scheduler): shows what each part is for."""

    def __post_init__(self) -> None:
        for part in self.skipped():
            _check(part in RESTORABLE, "debug.skip_restore", self.skip_restore,
                   f"a comma-separated subset of {', '.join(RESTORABLE)}", "--debug.skip_restore=rng")

    def skipped(self) -> set[str]:
        return {p.strip() for p in self.skip_restore.split(",") if p.strip()}


@dataclass(frozen=True)
class ParallelConfig:
    strategy: Literal["ddp", "fsdp", "hsdp", "auto"] = "ddp"
    """Data parallelism: ddp (full replicas), fsdp (shard params/grads/optimizer over all ranks), hsdp (shard within a machine, replicate across machines), auto (ddp if it fits the device, else fsdp/hsdp)."""
    dp_replicate: int = 0
    """Ranks holding replicas of each shard, the mesh's dp_replicate degree (0 = from strategy, -1 = the remaining ranks)."""
    dp_shard: int = 0
    """Ranks each replica is sharded over, the mesh's dp_shard degree (0 = from strategy, -1 = the remaining ranks)."""
    reshard_after_forward: bool = True
    """fsdp/hsdp: free gathered parameters after each block's forward and gather again in backward (less memory, more communication)."""
    bucket_mb: float = 25.0
    """ddp: gradient bucket size in MB; smaller buckets start communication earlier in backward."""
    overlap: bool = True
    """ddp: all-reduce each gradient bucket as soon as it is ready, during backward (false: all at the end, to see what overlap buys)."""
    find_unused: bool = False
    """ddp: tolerate parameters that get no gradient in a step (costs a graph traversal every step)."""
    fsdp_units: str = ""
    """Class names of the model's repeated blocks, comma-separated: FSDP's units, what checkpointing and compile wrap ('' = found, docs/fsdp.md)."""

    def __post_init__(self) -> None:
        names = [n.strip() for n in self.fsdp_units.split(",")] if self.fsdp_units.strip() else []
        _check(all(n.isidentifier() for n in names), "parallel.fsdp_units", self.fsdp_units,
               "class names separated by commas, e.g. GPT2Block or Block,MoEBlock", "--parallel.fsdp_units=MyBlock")
        _check(self.bucket_mb > 0, "parallel.bucket_mb", self.bucket_mb, "a number > 0", "--parallel.bucket_mb=25")
        for key in ("dp_replicate", "dp_shard"):
            value = getattr(self, key)
            _check(value >= -1, f"parallel.{key}", value, "a degree >= 1, -1 (the remaining ranks) or 0 (from "
                   "parallel.strategy)", f"--parallel.{key}=-1")
        _check(not (self.dp_replicate == -1 and self.dp_shard == -1), "parallel.dp_shard", -1,
               "at most one degree of -1 (the remaining ranks), since parallel.dp_replicate is -1 too",
               "give one as a number, e.g. --parallel.dp_replicate=2 --parallel.dp_shard=-1")


@dataclass(frozen=True)
class MemoryConfig:
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Per block: none, full (keep block inputs, recompute the rest in backward) or selective (keep attention and every other matmul output)."""
    cpu_offload: bool = False
    """fsdp/hsdp: keep sharded parameters, gradients and optimizer state in host memory; the optimizer step runs on the CPU."""


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())

    def trajectory(self) -> dict[str, dict[str, Any]]:
        """The settings that decide what is computed: everything but where the run happens and writes
        (run.name, run.dir, dist), how it is shown and measured (train.progress, log), how it is saved, and
        fault injection."""
        tree = self.to_dict()
        for section in ("dist", "log", "checkpoint", "chaos", "debug"):
            tree.pop(section, None)
        tree["run"] = {k: v for k, v in tree["run"].items() if k not in ("name", "dir")}
        tree["train"] = {k: v for k, v in tree["train"].items() if k != "progress"}
        return tree

    def digest(self) -> str:
        """SHA-256 (first 16 hex digits) of trajectory(): the same digest means the same training computation,
        wherever it runs; it names a configuration in checkpoints and reports."""
        return hashlib.sha256(tomli_w.dumps(self.trajectory()).encode()).hexdigest()[:16]

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir or f"runs/{self.run.name}")


CLI = "command line"  # the origin whose values are strings to parse
LIBRARY = "the config mapping"  # given to scaletrain.fit/load: Python values, or strings parsed as the CLI does

# Top-level command-line aliases for the flags users type most.
ALIASES = {"nproc": "dist.nproc", "device": "dist.device", "nnodes": "dist.nnodes",
           "rdzv-endpoint": "dist.rdzv_endpoint", "max-restarts": "dist.max_restarts",
           "train.log_every": "log.every"}  # the last: the name log.every had before the [log] section


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in declaration order."""
    hints = get_type_hints(Config)
    return {f.name: hints[f.name] for f in fields(Config)}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring written under each field of a dataclass (Python keeps none at run time)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = nxt.value.value.strip()
    return docs


def all_keys() -> dict[str, tuple[type, str]]:
    """'section.key' -> (its type, its help line), for every field of the tree."""
    keys = {}
    for sec, cls in sections().items():
        hints = get_type_hints(cls)
        docs = field_docs(cls)
        for f in fields(cls):
            keys[f"{sec}.{f.name}"] = (hints[f.name], docs.get(f.name, ""))
    return keys


def describe_type(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(tp))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def coerce(key: str, value: Any, tp: Any, origin: str, from_text: bool = False) -> Any:
    """Check a TOML/Python value against the field's type, or parse a command-line string (from_text), or
    raise ConfigError. A TOML string is not parsed: ``epochs = "3"`` is a type error in a file."""
    from_text = from_text and isinstance(value, str)
    example = f"--{key}=..."
    if get_origin(tp) is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        names = [str(c) for c in choices]
        close = [c for c in names if c.startswith(str(value))][:1] or difflib.get_close_matches(str(value), names, n=1)
        hint = f"--{key}={close[0]}" if close else f"--{key}={choices[0]}"
        raise ConfigError(key, value, describe_type(tp), hint, origin)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and value.lower() in ("true", "1", "yes", "on"):
            return True
        if from_text and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(key, value, "true or false", f"--{key}=true", origin)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text:
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(key, value, "an integer", example.replace("...", "10"), origin)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text:
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(key, value, "a number", example.replace("...", "0.1"), origin)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, value, "a string", f'{key} = "..." in TOML (quoted)', origin)
    raise AssertionError(f"config field {key} has an unsupported type {tp}")


def unknown_key(key: str, value: Any, origin: str) -> ConfigError:
    known = list(all_keys()) + list(ALIASES) + list(sections())
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    fix = f"did you mean --{close[0]}?" if close else "run 'scaletrain train --help' for every key"
    return ConfigError(key, value, f"a key listed by 'scaletrain train --help' ({key} is not one)", fix, origin)


def flatten(tree: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """{'optim': {'lr': 0.1}} -> {'optim.lr': 0.1}; dotted keys are accepted as they are."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, Mapping):
            if name not in sections():
                raise unknown_key(name, f"[{name}] table", origin)
            for key, v in value.items():
                flat[f"{name}.{key}"] = v
        else:
            flat[ALIASES.get(name, name)] = value
    return flat


def _in_python(err: ConfigError, origin: str) -> ConfigError:
    """The error as the library's user would fix it: a command-line fix (--optim.lr=0.1) becomes the mapping
    entry that does the same (config={"optim.lr": 0.1})."""
    if origin != LIBRARY:
        return err if err.origin == origin else err.at(origin)

    def entry(m: re.Match[str]) -> str:
        key, text = ALIASES.get(m[1], m[1]), m[2]
        value = {"true": "True", "false": "False"}.get(text.lower())
        if value is None:
            try:
                value = repr(ast.literal_eval(text))
            except (ValueError, SyntaxError):
                value = json.dumps(text)
        return f'config={{"{key}": {value}}}'

    fix = re.sub(r"--([\w.]+)[= ]([^\s,;?]+)", entry, err.fix)
    fix = re.sub(r"did you mean --([\w.]+)\?", r'did you mean "\1"?', fix)
    return ConfigError(err.key, err.value, err.expected, fix, origin)


def build(layers: list[tuple[str, Mapping[str, Any]]]) -> Config:
    """Build a Config from flat {'section.key': value} layers applied in order (later wins). Command-line and
    library strings are parsed ("false", "3e-4"); a TOML string is not."""
    keys = all_keys()
    chosen: dict[str, tuple[Any, str]] = {}
    for origin, layer in layers:
        for key, value in layer.items():
            key = ALIASES.get(key, key)
            if key not in keys:
                raise _in_python(unknown_key(key, value, origin), origin)
            try:
                chosen[key] = (coerce(key, value, keys[key][0], origin, origin in (CLI, LIBRARY)), origin)
            except ConfigError as err:
                raise _in_python(err, origin) from None
    built = {}
    for sec, cls in sections().items():
        kwargs = {k.split(".", 1)[1]: v for k, (v, _) in chosen.items() if k.startswith(sec + ".")}
        try:
            built[sec] = cls(**kwargs)
        except ConfigError as err:
            origin = chosen.get(err.key, (None, "default"))[1]
            raise _in_python(err, origin) from None
    return Config(**built)


def recipe_names() -> list[str]:
    return sorted(p.name[:-5].replace("_", "-") for p in resources.files("scaletrain.recipes").iterdir()
                  if p.name.endswith(".toml"))


def read_source(source: str) -> tuple[str, dict[str, Any], str]:
    """A recipe name or a TOML path -> (run name, flat overrides, origin label)."""
    names = recipe_names()
    if source in names:
        text = resources.files("scaletrain.recipes").joinpath(source.replace("-", "_") + ".toml").read_text()
        origin, name = f"recipe {source}", source
    else:
        path = Path(source)
        if not path.is_file():
            fix = "check the path" if source.endswith(".toml") else f"use one of the recipes: {', '.join(names)}"
            raise ConfigError("config", source, f"a TOML file or a built-in recipe ({', '.join(names)})", fix,
                              "not found")
        text, origin, name = path.read_text(), str(path), path.stem
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError("config", source, f"valid TOML ({err})", "correct the file at that line",
                          origin) from None
    flat = flatten(tree, origin)
    return name, flat, origin


def load(source: str | None = None, overrides: Mapping[str, Any] | None = None,
         cli_overrides: Mapping[str, str] | None = None) -> Config:
    """defaults < source (recipe name or TOML path) < overrides (library) < cli_overrides (strings)."""
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if source is not None:
        name, flat, origin = read_source(source)
        layers.append(("defaults", {"run.name": name}))
        layers.append((origin, flat))
    if overrides:
        layers.append((LIBRARY, flatten(overrides, LIBRARY)))
    if cli_overrides:
        layers.append((CLI, dict(cli_overrides)))
    return build(layers)
