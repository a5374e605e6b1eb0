"""The config tree: typed sections, TOML recipes, command-line overrides, validation.

Precedence is defaults < recipe/TOML file < command line. Every field carries a one-line docstring that
becomes its ``--help`` text, and its allowed values in its annotation: ``Annotated[int, Range(...)]`` for a
number, ``Annotated[str, Text(...)]`` for a string; a bool's or a Literal's type is its choice set. Parsing is a
pure function of its inputs; every mistake raises :class:`~scaletrain.errors.ConfigError` naming the key, the
value, what is allowed and the fix. Sections are frozen once built: validated once, then read-only.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import inspect
import itertools
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin, get_type_hints

import tomli_w

from scaletrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _check(ok: bool, key: str, value: Any, expected: str, fix: str) -> None:
    if not ok:
        raise ConfigError(key, value, expected, fix)


# Ceilings of the open-ended ranges: what the code a value reaches can take.
I32 = 2**31 - 1  # a C int: sizes, counts and ranks that torch and c10d keep in an int
I64 = 2**63 - 1  # int64_t: step counters
SEED_MAX = 2**32 - 1  # the loader seeds its generator with seed x 1_000_003 + epoch, which must fit in 64 bits
PROCESSES = 1024  # processes one machine starts for one job (workers, data loader workers per rank)
YEAR_S = 365 * 24 * 3600  # seconds: waits and sleeps, far inside timedelta's, c10d's and time.sleep's limits


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else repr(x)


def _finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond a float's range
        return False


@dataclass(frozen=True)
class Range:
    """The values a number field allows, declared in its annotation: ``Annotated[int, Range(1, most=I32)]``.

    ``low`` .. ``high`` is the documented domain (an ``*_open`` end excludes its bound); ``most`` caps a field
    whose domain is open-ended at what the code downstream takes (a C type, a sleep); ``special`` values lie
    outside the range and mean something of their own (-1 = off). NaN and inf are never allowed."""

    low: float
    high: float | None = None
    most: float | None = None
    low_open: bool = False
    high_open: bool = False
    special: tuple[tuple[int, str], ...] = ()
    what: str = ""  # the noun, e.g. "a rank", "seconds" (default: an integer / a number)
    fix: str = ""  # default: --key=<the default value>

    def allows(self, value: float) -> bool:
        if any(value == v for v, _ in self.special):
            return True
        top = self.high if self.high is not None else self.most
        return (_finite(value) and (value > self.low if self.low_open else value >= self.low)
                and (top is None or (value < top if self.high_open else value <= top)))

    def describe(self, tp: Any) -> str:
        bounded = self.high is not None or self.most is not None
        what = self.what or ("an integer" if tp is int else "a number" if bounded else "a finite number")
        if self.high is not None:
            text = (f"{what} in {'(' if self.low_open else '['}{_num(self.low)}, "
                    f"{_num(self.high)}{')' if self.high_open else ']'}")
        else:
            text = f"{what} {'>' if self.low_open else '>='} {_num(self.low)}"
        if self.most is not None:
            text += f" (at most {_num(self.most)})"
        named = [f"{_num(v)} ({meaning})" for v, meaning in self.special]
        if len(named) == 1:
            text += f", or {named[0]}"
        elif named:
            text += ", " + ", ".join(named[:-1]) + f" or {named[-1]}"
        return text


@dataclass(frozen=True)
class Text:
    """The values a string field allows, declared in its annotation: printable text (one line, no control
    characters) that ``ok`` accepts."""

    what: str
    ok: Callable[[str], bool] = str.isprintable
    fix: str = ""

    def allows(self, value: str) -> bool:
        return value.isprintable() and self.ok(value)


def _nonempty(text: str) -> bool:
    return bool(text.strip())


def _device(text: str) -> bool:
    # torch keeps a device index in an int8 (cuda:128 would wrap around to cuda:-128) and refuses cuda:01
    return text in ("auto", "cpu", "cuda") or (re.fullmatch(r"cuda:(0|[1-9][0-9]{0,2})", text) is not None
                                                and int(text[5:]) <= 127)


def _endpoint(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return not text or (bool(host) and re.fullmatch(r"[0-9]{1,5}", port) is not None and 1 <= int(port) <= 65535)


def _address(text: str) -> bool:
    return not text or re.fullmatch(r"[A-Za-z0-9._:\-\[\]]+", text) is not None


def _class_names(text: str) -> bool:
    return not text.strip() or all(n.strip().isidentifier() for n in text.split(","))


def _step_window(text: str) -> bool:
    m = re.fullmatch(r"([1-9][0-9]{0,11})(?:-([1-9][0-9]{0,11}))?", text)
    return not text or (m is not None and int(m.group(2) or m.group(1)) >= int(m.group(1)))


def step_window(text: str) -> tuple[int, int] | None:
    """debug.profile's steps: "10-12" -> (10, 12), "10" -> (10, 10), "" -> None."""
    if not text:
        return None
    first, _, last = text.partition("-")
    return int(first), int(last or first)


def _restorable(text: str) -> bool:
    return all(p.strip() in RESTORABLE for p in text.split(",") if p.strip())


OFF = ((-1, "off"),)


@dataclass(frozen=True)
class RunConfig:
    name: Annotated[str, Text("a non-empty name", _nonempty, "--run.name=myrun")] = "run"
    """Run name; the default run directory is runs/<name>."""
    dir: Annotated[str, Text("a path ('' = runs/<run.name>)", fix="--run.dir=runs/myrun")] = ""
    """Run directory for config.toml, metrics.jsonl, summary.json, model.safetensors ('' = runs/<name>); it must be writable, which is checked before any worker starts."""
    seed: Annotated[int, Range(0, most=SEED_MAX)] = 0
    """Seed for model init and data order; dropout on rank r draws from seed + r (at most 2**32 - 1: the loader derives 64-bit seeds from it)."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class DistConfig:
    device: Annotated[str, Text("auto, cpu, cuda or cuda:N (N <= 127)", _device, "--device=auto")] = "auto"
    """Device: auto (cuda:LOCAL_RANK if CUDA is present, else cpu), cpu, cuda, or cuda:N."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Collective backend: auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    nproc: Annotated[int, Range(1, most=PROCESSES, fix="--nproc 2")] = 1
    """Worker processes to start on this machine (through torchrun) when not already under torchrun."""
    timeout_s: Annotated[int, Range(1, most=YEAR_S, what="seconds")] = 600
    """Seconds a collective may wait for the other ranks before the job fails (at most a year)."""
    nnodes: Annotated[int, Range(1, most=65536, fix="--nnodes 2")] = 1
    """Machines in the job (each runs the same command; they meet at rdzv_endpoint)."""
    rdzv_endpoint: Annotated[str, Text("HOST:PORT with a port in [1, 65535]", _endpoint,
                                       "--rdzv-endpoint=node0:29500")] = ""
    """HOST:PORT where the machines of a multi-node job meet ('' = this machine, a free port)."""
    local_addr: Annotated[str, Text("an IP address or host name", _address, "--dist.local_addr=10.0.0.5")] = ""
    """This machine's address on the network the machines share ('' = its host name; 127.0.0.1 on one machine): the workers' store, when this machine hosts it, listens there only."""
    rdzv_id: Annotated[str, Text("a job id", fix="--dist.rdzv_id=myjob")] = ""
    """Job id shared by all machines of one job ('' = scaletrain-<run.name>; under 'launch': scaletrain-<SCRIPT>)."""
    rdzv_timeout_s: Annotated[int, Range(1, most=YEAR_S, what="seconds", fix="--dist.rdzv_timeout_s=600")] = 600
    """Seconds the machines of a job wait at the rendezvous for all of them to arrive (torchrun's join timeout)."""
    max_restarts: Annotated[int, Range(0, most=I32, fix="--max-restarts 3")] = 0
    """Times torchrun restarts the worker group after a worker fails."""
    flight_recorder: Annotated[int, Range(0, most=I32, what="a count of collectives",
                                          fix="--dist.flight_recorder=2000")] = 2000
    """Collectives each rank remembers with their Python stacks (torch's Flight Recorder, Gloo and NCCL): when one fails or times out every rank writes them to RUN_DIR/flight/ for `scaletrain diagnose` (0 = off)."""
    check_network: bool = False
    """Before step 0 of a job on several machines: measure the bandwidth between every two of them (scaletrain doctor --nodes's check, a few seconds) and warn on rank 0 naming a slow node or link; never stops the run."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check(self.nnodes == 1 or bool(self.rdzv_endpoint), "dist.rdzv_endpoint", self.rdzv_endpoint,
               "HOST:PORT of the first machine when dist.nnodes > 1", "--rdzv-endpoint=node0:29500")


@dataclass(frozen=True)
class DataConfig:
    source: Literal["digits", "stdlib", "bin", "memory"] = "digits"
    """Data: digits (sklearn's 8x8 digits), stdlib (bytes of Python's own stdlib .py files), bin (token .bin memmaps), memory (tensors/arrays passed to fit())."""
    path: Annotated[str, Text("a directory path", fix="--data.path=data/mycorpus")] = ""
    """For source=bin: a directory holding train.bin and val.bin (uint16 tokens, the nanoGPT layout)."""
    batch_size: Annotated[int, Range(1, most=I32)] = 32
    """Samples per rank per micro-step; global batch = batch_size x world size x accumulation."""
    eval_batch_size: Annotated[int, Range(0, most=I32, fix="--data.eval_batch_size=0 (same as batch_size)")] = 0
    """Samples per rank per eval step (0 = batch_size)."""
    seq_len: Annotated[int, Range(1, most=I32)] = 128
    """Tokens per sample for text sources (stdlib, bin)."""
    val_fraction: Annotated[float, Range(0, 1, high_open=True)] = 0.2
    """Held-out fraction for sources without their own split (digits, fit() without eval_data); 0: none held out, no evaluation (a model whose eval-mode output is its predictions, not what its loss takes: torchvision's detection models)."""
    shuffle: bool = True
    """Reshuffle the training set every epoch from the seed (the order is independent of world size)."""
    num_workers: Annotated[int, Range(0, most=PROCESSES)] = 0
    """DataLoader worker processes per rank (0 = load in the training process); a sample's random draws there
    are seeded from the seed, its epoch and its index, so augmentation resumes exactly whatever the count."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check(self.source != "bin" or bool(self.path), "data.path", self.path,
               "a directory with train.bin and val.bin when data.source=bin", "--data.path=data/mycorpus")


@dataclass(frozen=True)
class ModelConfig:
    name: Literal["mlp", "cnn", "gpt", "llama"] = "cnn"
    """Built-in model: mlp, cnn (for 8x8 images), gpt (GPT-2's causal transformer over tokens) or llama (Llama's: RMSNorm, RoPE, grouped-query attention, SwiGLU, no biases, untied head)."""
    hidden: Annotated[int, Range(1, most=I32)] = 128
    """mlp and cnn: width of the hidden dense layer."""
    channels: Annotated[int, Range(1, most=I32)] = 32
    """cnn: channels of the first convolution (the second has twice as many)."""
    n_layer: Annotated[int, Range(1, most=I32)] = 4
    """gpt, llama: transformer blocks."""
    n_head: Annotated[int, Range(1, most=I32)] = 4
    """gpt, llama: attention (query) heads (must divide n_embd)."""
    n_embd: Annotated[int, Range(1, most=I32)] = 128
    """gpt, llama: embedding width."""
    n_kv_head: Annotated[int, Range(0, most=I32)] = 0
    """llama: key/value heads, each shared by n_head / n_kv_head query heads (grouped-query attention; 0 = n_head: one per query head)."""
    ffn_hidden: Annotated[int, Range(0, most=I32)] = 0
    """llama: the SwiGLU MLP's width (0 = 8/3 x n_embd rounded up to a multiple of 256, Llama's rule)."""
    rope_theta: Annotated[float, Range(0, low_open=True)] = 10000.0
    """llama: the base of the rotary position embedding's frequencies (Llama 2: 10000; Llama 3: 500000)."""
    dropout: Annotated[float, Range(0, 1, high_open=True, fix="--model.dropout=0.1")] = 0.0
    """Dropout probability (0 disables it)."""
    vocab_size: Annotated[int, Range(0, most=I32)] = 0
    """gpt, llama: vocabulary size (0 = taken from the data)."""
    bias: bool = True
    """gpt: biases in the linears and layer norms (false: none, as in Llama and nanoGPT's option: fewer parameters, a little faster on a GPU)."""
    loss: Literal["auto", "split", "fused"] = "auto"
    """gpt: the output head and the cross-entropy in training: split (the logits, then the loss) or fused (models.losses.linear_cross_entropy, chunk by chunk: the logits are never kept; less memory, and with the bf16 residual less time at large vocabularies); evaluation forms the logits either way. auto: fused on a GPU with train.compile (measured faster there, benchmarks/RESULTS.md 5d), else split."""
    residual: Literal["auto", "fp32", "bf16"] = "auto"
    """gpt under train.precision=bf16-mixed: the residual stream's dtype between blocks; fp32 (autocast's, the embeddings being fp32) or bf16 (as FSDP's bf16 policy has it: half the bytes for every add, norm and saved input). auto: bf16 on a GPU under bf16-mixed (measured faster there, benchmarks/RESULTS.md 5d), else fp32."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check(self.n_embd % self.n_head == 0, "model.n_head", self.n_head,
               f"a divisor of model.n_embd={self.n_embd}", "choose n_head so that n_embd % n_head == 0")
        if self.name == "llama":
            kv = self.n_kv_head or self.n_head
            _check(self.n_head % kv == 0, "model.n_kv_head", self.n_kv_head,
                   f"a divisor of model.n_head={self.n_head} (or 0: as many as n_head)",
                   f"--model.n_kv_head={_divisor_below(self.n_head, kv)}")
            _check(self.n_embd // self.n_head % 2 == 0, "model.n_head", self.n_head,
                   f"a head width n_embd / n_head that is even (RoPE rotates pairs); {self.n_embd} / {self.n_head} "
                   f"= {self.n_embd // self.n_head}", f"--model.n_head={_even_heads(self.n_embd, self.n_head)}")


def _even_heads(n_embd: int, n_head: int) -> int:
    """The most heads, up to ``n_head``, that divide ``n_embd`` into heads of an even width (1 if none)."""
    return max([d for d in range(1, n_head + 1) if n_embd % d == 0 and n_embd // d % 2 == 0] or [1])


def _divisor_below(n: int, k: int) -> int:
    """The largest divisor of ``n`` not above ``k``."""
    return max(d for d in range(1, min(n, k) + 1) if n % d == 0)


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["sgd", "adamw"] = "adamw"
    """Optimizer: sgd (with momentum) or adamw."""
    lr: Annotated[float, Range(0, low_open=True)] = 1e-3
    """Base learning rate (the peak after warmup, before scaling by the linear rule)."""
    scale_lr: bool = False
    """Linear scaling rule: peak lr = lr x global_batch / base_batch (Goyal et al. 2017)."""
    base_batch: Annotated[int, Range(1, most=I32)] = 256
    """The global batch at which lr was tuned (used by scale_lr)."""
    momentum: Annotated[float, Range(0, 1, high_open=True)] = 0.9
    """sgd: momentum."""
    nesterov: bool = False
    """sgd: Nesterov momentum."""
    weight_decay: Annotated[float, Range(0, fix="--optim.weight_decay=0.01")] = 0.0
    """Decoupled weight decay (adamw) or L2 penalty (sgd)."""
    beta1: Annotated[float, Range(0, 1, high_open=True)] = 0.9
    """adamw: first-moment decay."""
    beta2: Annotated[float, Range(0, 1, high_open=True)] = 0.999
    """adamw: second-moment decay."""
    grad_clip: Annotated[float, Range(0, fix="--optim.grad_clip=1.0")] = 0.0
    """Clip the global gradient norm to this value (0 = no clipping)."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check(not self.nesterov or self.momentum > 0, "optim.nesterov", True, "false when optim.momentum = 0",
               "--optim.momentum=0.9 or --optim.nesterov=false")


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_steps: Annotated[int, Range(0, most=I64, fix="--schedule.warmup_steps=100")] = 0
    """Steps of linear warmup from warmup_start x peak lr up to the peak lr."""
    warmup_start: Annotated[float, Range(0, 1)] = 0.0
    """LR at step 0 as a fraction of the peak (Goyal et al. start from the unscaled lr: 1/k)."""
    decay: Literal["cosine", "linear", "step", "constant"] = "cosine"
    """After warmup: cosine or linear decay to min_lr_ratio x peak, step decay, or constant."""
    min_lr_ratio: Annotated[float, Range(0, 1, fix="--schedule.min_lr_ratio=0.1")] = 0.0
    """cosine/linear: final lr as a fraction of the peak."""
    step_every: Annotated[int, Range(0, most=I64, fix="--schedule.step_every=1000")] = 0
    """step decay: multiply the lr by gamma every this many steps after warmup (0 = a third of them)."""
    gamma: Annotated[float, Range(0, 1, low_open=True)] = 0.1
    """step decay: the factor applied at each step."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class TrainConfig:
    epochs: Annotated[int, Range(1, most=I32, fix="--train.epochs=10")] = 1
    """Passes over the training set (ignored when max_steps > 0)."""
    max_steps: Annotated[int, Range(0, most=I64, fix="--train.max_steps=1000")] = 0
    """Optimizer steps to run; > 0 overrides epochs."""
    accum_steps: Annotated[int, Range(1, most=I32)] = 1
    """Micro-steps accumulated per optimizer step (gradients are all-reduced on the last one only)."""
    global_batch: Annotated[int, Range(0, most=I64, fix="--train.global_batch=256")] = 0
    """Samples per optimizer step across all ranks; > 0 derives accum_steps from it (0 = use accum_steps)."""
    precision: Literal["fp32", "bf16-mixed", "fp16-mixed"] = "fp32"
    """Compute precision: fp32, or bf16/fp16 compute with fp32 master weights (autocast; FSDP's MixedPrecisionPolicy under fsdp/hsdp); fp16 adds a gradient scaler (CUDA only)."""
    tf32: bool = True
    """CUDA: let fp32 matmuls and convolutions use TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32, cudnn.allow_tf32), as PyTorch recommends on Ampere and newer; false = full fp32."""
    compile: bool = False
    """Compile the model with torch.compile before wrapping it for data parallelism."""
    compile_mode: Literal["default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"] = "default"
    """With train.compile: torch.compile's mode. max-autotune-no-cudagraphs tunes each matmul and fused kernel by timing candidates (longer compile); reduce-overhead replays the compiled graphs as CUDA graphs (fewer launches; more memory, static shapes); max-autotune both. CUDA graphs apply on a GPU only."""
    attention: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """CUDA: which kernel scaled_dot_product_attention runs (the built-in GPT and Llama, and a model of one's own that calls it): auto (PyTorch's choice: cuDNN's on an H100), or flash (FlashAttention-2), cudnn, efficient (memory-efficient) or math, with math kept as the fallback for inputs the chosen kernel cannot take. Same results within rounding; the speed differs (benchmarks/RESULTS.md 5d)."""
    eval_every: Annotated[int, Range(0, most=I64)] = 0
    """Evaluate every this many optimizer steps (0 = at the end of every epoch, and at the end)."""
    eval_batches: Annotated[int, Range(0, most=I64)] = 100
    """Eval batches per rank per evaluation, spread evenly over the held-out split (0 = the whole split)."""
    early_stop: Annotated[int, Range(0, most=I64, fix="--train.early_stop=3")] = 0
    """Stop when the held-out train.monitor (the loss) has not improved on its best (by more than train.early_stop_delta) for this many evaluations in a row (0 = never): the run ends finished, at the step of that evaluation, naming the best one."""
    early_stop_delta: Annotated[float, Range(0, fix="--train.early_stop_delta=0.001")] = 0.0
    """With train.early_stop and checkpoint.best: the change of train.monitor that counts as an improvement."""
    loss_mean: Literal["micro_batch", "tokens"] = "micro_batch"
    """How a step's loss averages its targets. micro_batch: each micro-batch's loss is the mean over its own targets, and the micro-batches and ranks weigh alike (no collective). tokens: every target the loss counts weighs alike over the whole step (targets of -100 left out), the loss of the global batch taken at once however it is split, exact with padded sequences of varied lengths (Hugging Face's Trainer counts so); one all-reduce of the count per step, on the device. Needs scaletrain's cross-entropy, or a model's own loss that takes num_items_in_batch (transformers')."""
    monitor: Annotated[str, Text("loss, accuracy or the name of one of fit()'s metrics=", _nonempty,
                                 "--train.monitor=accuracy")] = "loss"
    """The held-out measure train.early_stop and checkpoint.best watch: loss, accuracy (class targets) or one of fit()'s metrics=."""
    monitor_mode: Literal["auto", "min", "max"] = "auto"
    """Whether train.monitor improves by falling (min) or rising (max); auto: min for loss, max for accuracy (a metric of one's own needs min or max)."""
    progress: bool = True
    """Show a progress bar on rank 0 when the console is a terminal."""
    deterministic: bool = False
    """Deterministic kernels (torch.use_deterministic_algorithms, cuDNN deterministic): bitwise-repeatable GPU runs, somewhat slower."""
    nonfinite: Literal["raise", "skip"] = "raise"
    """A non-finite loss or gradient on any rank: raise (stop, naming rank and step) or skip the step and count it."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check(self.compile or self.compile_mode == "default", "train.compile_mode", self.compile_mode,
               "default unless train.compile is true (the mode of a compile that is not asked for)",
               "--train.compile=true")


@dataclass(frozen=True)
class LogConfig:
    every: Annotated[int, Range(1, most=I64)] = 10
    """Gather loss, phase times and memory from every rank and log them every this many optimizer steps (the loop's only sync point)."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard events to RUN_DIR/tensorboard (needs the tensorboard package)."""
    phase_times: bool = True
    """Time each step's phases per rank (data, h2d, compute, exposed comm, optim): stragglers and the bottleneck verdict need them."""
    plan_vs_actual: bool = True
    """At the end of a run of a built-in model, put what `scaletrain plan` predicts for its configuration (model state and peak memory per rank, time per step at the run's MFU) beside what it measured, with the error (summary.json plan_vs_actual; a fraction of a second)."""
    trace: bool = False
    """Write every rank's phase timeline (each step and its data, h2d, compute, comm, optim, checkpoint) to RUN_DIR/timeline.json, one Chrome/Perfetto trace with a row per rank (open it in ui.perfetto.dev); a few hundred bytes per step and rank."""
    grad_noise_scale: bool = False
    """Estimate the gradient noise scale B_simple (McCandlish et al. 2018: the critical batch size) from each rank's gradient before the all-reduce and the averaged one after it, every log step (metrics.jsonl, summary.json); one process needs gradient accumulation. Costs a gradient norm per step."""
    straggler_min_frac: Annotated[float, Range(0, most=1, low_open=True, what="a fraction of the step time")] = 0.25
    """Name a rank a straggler only when it is persistently slower than the others by at least this fraction of the step time (ranks sharing CPUs trade about a tenth of it back and forth; lower it on dedicated hardware)."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class CheckpointConfig:
    every: Annotated[int, Range(0, most=I64, fix="--checkpoint.every=500")] = 0
    """Save a checkpoint every this many optimizer steps, and at the end (0 = only when preempted)."""
    keep: Annotated[int, Range(0, most=I32)] = 3
    """Complete checkpoints kept; older ones are deleted once a newer one is committed (0 = keep all)."""
    best: bool = False
    """scaletrain train and fit(), with held-out data: after each evaluation whose train.monitor (the loss) is the best so far (by more than train.early_stop_delta), save a checkpoint at that step (unless one is there) and keep it whatever checkpoint.keep says until a better one replaces it (checkpoints/best.json and summary.json's best_checkpoint name it; `scaletrain checkpoint export RUN OUT --best` exports it)."""
    load_best: bool = False
    """At the end of a finished run (an early stop too), load the best checkpoint's weights (checkpoint.best, or a loop's st.save_best()) back into the model: model.safetensors and a model given to fit() built then hold them. The last checkpoint keeps the last step's state, to resume from."""
    resume: Annotated[str, Text("auto, never or a checkpoint path", _nonempty, "--checkpoint.resume=auto")] = "auto"
    """auto (the latest complete checkpoint in the run directory, if any), never, or the path of a checkpoint."""
    preempt_check: Literal["log", "step"] = "log"
    """When the ranks agree on a preemption signal: at the next log step (inside its one gather, no extra collective), or at every step boundary (one non-blocking all-reduce of the flag per step on a Gloo group of its own: the save starts within two steps of the signal)."""
    async_save: bool = True
    """Write checkpoints on a background thread (every rank's, for the DCP shards of FSDP runs); the loop is blocked only while the state is copied to host memory."""

    def __post_init__(self) -> None:
        check_fields(self)


CHAOS_RANKS = ("kill", "nan", "hang", "delay", "signal")  # chaos.<name>_rank


@dataclass(frozen=True)
class ChaosConfig:
    """Fault injection, off by default: rehearse failures on purpose. Kills, hangs and signals fire on a job's
    first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT = 0), so a restarted job gets past them. A rank
    named here must be below the world size, checked once the world size is known."""

    kill_rank: Annotated[int, Range(0, most=I32, special=OFF, what="a rank", fix="--chaos.kill_rank=1")] = -1
    """SIGKILL this rank at the start of step kill_step (-1 = off)."""
    kill_step: Annotated[int, Range(0, most=I64, what="a step", fix="--chaos.kill_step=10")] = 0
    """The step (1-based optimizer step) at whose start kill_rank dies."""
    nan_rank: Annotated[int, Range(0, most=I32, special=OFF, what="a rank", fix="--chaos.nan_rank=1")] = -1
    """Make this rank's loss NaN at step nan_step (-1 = off)."""
    nan_step: Annotated[int, Range(0, most=I64, what="a step", fix="--chaos.nan_step=10")] = 0
    """The step whose loss becomes NaN on nan_rank."""
    hang_rank: Annotated[int, Range(0, most=I32, special=OFF, what="a rank", fix="--chaos.hang_rank=1")] = -1
    """Hang this rank (sleep hang_s) at the start of step hang_step (-1 = off)."""
    hang_step: Annotated[int, Range(0, most=I64, what="a step", fix="--chaos.hang_step=10")] = 0
    """The step at whose start hang_rank hangs."""
    hang_s: Annotated[float, Range(0, most=YEAR_S, what="seconds", fix="--chaos.hang_s=60")] = 3600.0
    """Seconds hang_rank sleeps (at most a year)."""
    delay_rank: Annotated[int, Range(0, most=I32, special=OFF, what="a rank", fix="--chaos.delay_rank=1")] = -1
    """Slow this rank down by delay_ms on every step, in delay_phase (-1 = off)."""
    delay_phase: Literal["data", "compute"] = "data"
    """Where the delay goes: data (before the batch arrives) or compute (between forward and backward)."""
    delay_ms: Annotated[float, Range(0, most=3_600_000, what="milliseconds", fix="--chaos.delay_ms=30")] = 0.0
    """Milliseconds of delay per step on delay_rank (at most an hour)."""
    interrupt_step: Annotated[int, Range(0, most=I64, what="a step", fix="--chaos.interrupt_step=10")] = 0
    """Act as if preempted at the end of this step: save a checkpoint and exit 0 (0 = off)."""
    signal_rank: Annotated[int, Range(0, most=I32, special=OFF, what="a rank", fix="--chaos.signal_rank=0")] = -1
    """Send signal_name at the start of signal_step from this rank: rehearses preemption (or Ctrl-C) end to end (-1 = off)."""
    signal_step: Annotated[int, Range(0, most=I64, what="a step", fix="--chaos.signal_step=10")] = 0
    """The step at whose start signal_rank is signalled."""
    signal_name: Literal["SIGUSR1", "SIGTERM", "SIGINT"] = "SIGUSR1"
    """SIGUSR1 (as Slurm's --signal) or SIGTERM go to signal_rank's own process; SIGINT goes where a terminal's Ctrl-C goes, to the launcher's whole process group (this process's group without a launcher)."""

    def __post_init__(self) -> None:
        check_fields(self)

    def check_world(self, world: int) -> None:
        """Every rank named here exists in a job of ``world`` ranks: called where the world size is known (the
        launcher before it starts workers, each worker once it has joined)."""
        for name in CHAOS_RANKS:
            rank = getattr(self, f"{name}_rank")
            _check(rank < world, f"chaos.{name}_rank", rank,
                   f"a rank below the world size {world} (0 to {world - 1}), or -1 (off)",
                   f"--chaos.{name}_rank={world - 1}, or more workers (--nproc {rank + 1})")


RESTORABLE = ("weights", "optimizer", "rng", "data", "scheduler")


@dataclass(frozen=True)
class DebugConfig:
    trace: bool = False
    """Write per-step fingerprints (weights, optimizer, RNG, data, LR) to RUN_DIR/trace/ (a host sync and hashing every step; used by verify-resume)."""
    profile: Annotated[str, Text("optimizer steps FIRST-LAST or one STEP (from 1)", _step_window,
                                 "--debug.profile=10-12")] = ""
    """Run torch.profiler over these optimizer steps (FIRST-LAST, or one step) and write each rank's Chrome trace and its op table to RUN_DIR/profile/ (CPU and CUDA kernels, memory)."""
    skip_restore: Annotated[str, Text(f"a comma-separated subset of {', '.join(RESTORABLE)}", _restorable,
                                      "--debug.skip_restore=rng")] = ""
    """Parts of a checkpoint NOT to restore on resume, comma-separated (weights, optimizer, rng, data, scheduler): shows what each part is for."""

    def __post_init__(self) -> None:
        check_fields(self)

    def skipped(self) -> set[str]:
        return {p.strip() for p in self.skip_restore.split(",") if p.strip()}


DEGREE = ((-1, "the remaining ranks"), (0, "from parallel.strategy"))


@dataclass(frozen=True)
class ParallelConfig:
    strategy: Literal["ddp", "fsdp", "hsdp", "auto"] = "ddp"
    """Data parallelism: ddp (full replicas), fsdp (shard params/grads/optimizer over all ranks), hsdp (shard within a machine, replicate across machines), auto (ddp if it fits the device, else fsdp/hsdp)."""
    dp_replicate: Annotated[int, Range(1, most=I32, special=DEGREE, what="a degree",
                                       fix="--parallel.dp_replicate=-1")] = 0
    """Ranks holding replicas of each shard, the mesh's dp_replicate degree (0 = from strategy, -1 = the remaining ranks)."""
    dp_shard: Annotated[int, Range(1, most=I32, special=DEGREE, what="a degree", fix="--parallel.dp_shard=-1")] = 0
    """Ranks each replica is sharded over, the mesh's dp_shard degree (0 = from strategy, -1 = the remaining ranks)."""
    tp: Annotated[int, Range(1, most=I32, what="a degree", fix="--parallel.tp=1 (none), or a degree that divides the ranks")] = 1
    """Tensor parallelism: ranks each block's matrices are split over (attention heads and the MLP's hidden units, torch.distributed.tensor.parallel), with sequence parallelism for the norms; within a machine. 1 = none."""
    pp: Annotated[int, Range(1, most=I32, what="a degree", fix="--parallel.pp=1 (none), or a degree that divides the ranks")] = 1
    """Pipeline parallelism: stages the blocks are split into, one per rank of a pipeline group (torch.distributed.pipelining). 1 = none."""
    microbatches: Annotated[int, Range(0, most=I32, what="a count", fix="--parallel.microbatches=8")] = 0
    """pp > 1: micro-batches each rank's batch is split into to fill the pipeline (0 = 2 x pp); the bubble is (pp - 1) / microbatches of a step."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """pp > 1: the pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (one forward, one backward: at most pp micro-batches of activations in flight) or interleaved (1F1B over parallel.pp_virtual stages per rank: the bubble / pp_virtual)."""
    pp_virtual: Annotated[int, Range(1, most=I32, what="a count", fix="--parallel.pp_virtual=2")] = 2
    """pp_schedule=interleaved: stages per rank (the model is cut into pp x pp_virtual stages, rank r holding r, r + pp, ...)."""
    reshard_after_forward: bool = True
    """fsdp/hsdp: free gathered parameters after each block's forward and gather again in backward (less memory, more communication)."""
    bucket_mb: Annotated[float, Range(0.001, most=1_048_576, what="megabytes")] = 25.0
    """ddp: gradient bucket size in MB, from 0.001 (about a KB) to 1048576 (a TB); smaller buckets start communication earlier in backward."""
    overlap: bool = True
    """ddp: all-reduce each gradient bucket as soon as it is ready, during backward (false: all at the end, to see what overlap buys)."""
    loss_parallel: bool = True
    """tp > 1: keep a built-in model's logits split by vocabulary and compute the trainer's cross-entropy on the shards (torch's loss_parallel: 1/tp of the logits per rank; false: gathered whole on every rank). A loss function of one's own always sees whole logits."""
    find_unused: bool = False
    """Parameters that get no gradient in a step (a mixture of experts): ddp tolerates them (a graph traversal every step); fsdp/hsdp reduce-scatter zeros for them (on by itself when the first sample leaves some without one)."""
    fsdp_units: Annotated[str, Text("class names separated by commas, e.g. GPT2Block or Block,MoEBlock", _class_names,
                                    "--parallel.fsdp_units=MyBlock")] = ""
    """Class names of the model's repeated blocks, comma-separated: FSDP's units, what checkpointing and compile wrap ('' = found, docs/fsdp.md)."""

    def __post_init__(self) -> None:
        check_fields(self)
        _check(not (self.dp_replicate == -1 and self.dp_shard == -1), "parallel.dp_shard", -1,
               "at most one degree of -1 (the remaining ranks), since parallel.dp_replicate is -1 too",
               "give one as a number, e.g. --parallel.dp_replicate=2 --parallel.dp_shard=-1")


@dataclass(frozen=True)
class MemoryConfig:
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Per block: none, full (keep block inputs, recompute the rest in backward) or selective (keep attention and every other matmul output)."""
    cpu_offload: bool = False
    """fsdp/hsdp: keep sharded parameters, gradients and optimizer state in host memory; the optimizer step runs on the CPU."""

    def __post_init__(self) -> None:
        check_fields(self)


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

    def __post_init__(self) -> None:
        _check(self.model.residual != "bf16" or self.train.precision == "bf16-mixed", "model.residual",
               self.model.residual, "fp32 or auto unless train.precision is bf16-mixed (a bf16 residual needs bf16 compute)",
               "--train.precision=bf16-mixed, or --model.residual=fp32")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def for_device(self, device: str) -> Config:
        """This config with model.loss and model.residual's ``auto`` decided for a run on ``device`` ("cuda",
        "cpu", ...): the settings measured fastest on a GPU there (GPT-2 124M on an H100, benchmarks/RESULTS.md
        5d), off elsewhere (not measured faster on a CPU, and a CPU run computes what it always did)."""
        gpu, m = device == "cuda", self.model
        # the fused loss reads the whole output matrix, which TP splits; a pipeline's last stage returns logits
        split = self.parallel.tp > 1 or self.parallel.pp > 1
        loss = m.loss if m.loss != "auto" else "fused" if gpu and self.train.compile and not split else "split"
        residual = m.residual if m.residual != "auto" else (
            "bf16" if gpu and self.train.precision == "bf16-mixed" else "fp32")
        return dataclasses.replace(self, model=dataclasses.replace(m, loss=loss, residual=residual))

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


@cache
def _sections() -> dict[str, type]:
    hints = get_type_hints(Config)
    return {f.name: hints[f.name] for f in fields(Config)}


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in declaration order."""
    return dict(_sections())


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring written under each field of a dataclass (Python keeps none at run time)."""
    return _class_field_docs(cls.__module__).get(cls.__qualname__, {})


@cache
def _class_field_docs(module: str) -> dict[str, dict[str, str]]:
    """field_docs of every top-level class of a module (the config's sections all are), from one parse of its
    source: asking inspect for each class's source parses the whole module again per class (13 parses of this
    file: all_keys() took 0.12 s of every CLI command's start-up, 0.011 s now)."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module]))
    except (KeyError, OSError, TypeError):  # no module or no source (a class made at run time, a frozen app)
        return {}
    return {node.name: _docs_in(node.body) for node in tree.body if isinstance(node, ast.ClassDef)}


def _docs_in(body: list[ast.stmt]) -> dict[str, str]:
    docs: dict[str, str] = {}
    for stmt, nxt in itertools.pairwise(body):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = nxt.value.value.strip()
    return docs


@cache
def _fields_of(cls: type) -> tuple[tuple[str, Any, Range | Text | None, Any], ...]:
    """(name, type, the Range or Text declared on it, default) for each field of a section."""
    hints = get_type_hints(cls, include_extras=True)
    found = []
    for f in fields(cls):
        tp, spec = hints[f.name], None
        if get_origin(tp) is Annotated:
            tp, spec = get_args(tp)[:2]
        found.append((f.name, tp, spec, f.default if f.default is not MISSING else None))
    return tuple(found)


@cache
def _schema() -> dict[str, tuple[Any, Range | Text | None, Any]]:
    """'section.key' -> (type, declared Range or Text, default)."""
    return {f"{sec}.{name}": (tp, spec, default)
            for sec, cls in _sections().items() for name, tp, spec, default in _fields_of(cls)}


@cache
def _all_keys() -> dict[str, tuple[type, str]]:
    docs = {sec: field_docs(cls) for sec, cls in _sections().items()}
    return {key: (tp, docs[key.split(".")[0]].get(key.split(".", 1)[1], "")) for key, (tp, _, _) in _schema().items()}


def all_keys() -> dict[str, tuple[type, str]]:
    """'section.key' -> (its type, its help line), for every field of the tree."""
    return dict(_all_keys())


def spec(key: str) -> Range | Text | None:
    """The Range or Text declared on a field; None for a bool or a Literal, whose type is its choice set."""
    return _schema()[key][1]


def allowed(key: str) -> str:
    """What a field allows, in words: its declared range, choices or text."""
    tp, declared, _ = _schema()[key]
    if isinstance(declared, Range):
        return declared.describe(tp)
    if isinstance(declared, Text):
        return declared.what
    return describe_type(tp)


def _fix(key: str) -> str:
    tp, declared, default = _schema()[key]
    if declared is not None and declared.fix:
        return declared.fix
    shown = str(default).lower() if tp is bool else _num(default) if tp in (int, float) else default
    return f"--{key}={shown}"


def _in_range(tp: Any, declared: Range | Text | None, value: Any) -> bool:
    """``value`` has the field's type and lies in its declared range (a field declaring none allows nothing)."""
    if get_origin(tp) is Literal:
        return value in get_args(tp)
    if tp is bool or isinstance(value, bool):
        return tp is bool and isinstance(value, bool)
    if isinstance(declared, Range):
        return isinstance(value, int if tp is int else (int, float)) and declared.allows(value)
    return isinstance(declared, Text) and isinstance(value, str) and declared.allows(value)


def check_fields(section: Any) -> None:
    """Every field of a section against its type and declared range, in order: the one place ranges are
    checked, for sections that load() builds and sections built by hand alike. A section's __post_init__
    calls it first, then checks what its fields must satisfy together."""
    name = {cls: sec for sec, cls in _sections().items()}[type(section)]
    for field_name, tp, declared, _ in _fields_of(type(section)):
        key, value = f"{name}.{field_name}", getattr(section, field_name)
        if not _in_range(tp, declared, value):
            unprintable = isinstance(value, str) and not value.isprintable()
            expected = allowed(key) + (" (printable characters on one line)" if unprintable else "")
            raise ConfigError(key, _shown(value), expected, _fix(key))


class _Huge(int):
    """An integer too long for Python to print (str() refuses beyond 4300 digits), shown by its size."""

    def __repr__(self) -> str:
        return f"<an integer of about {int(self.bit_length() * math.log10(2)) + 1} digits>"

    __str__ = __repr__


def _shown(value: Any) -> Any:
    """``value`` as an error message can print it."""
    if isinstance(value, int) and not isinstance(value, (bool, _Huge)):
        try:
            repr(value)
        except ValueError:
            return _Huge(value)
    return value


def describe_type(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(tp))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def coerce(key: str, value: Any, tp: Any, origin: str, from_text: bool = False) -> Any:
    """Check a TOML/Python value against the field's type, or parse a command-line string (from_text), or
    raise ConfigError. A TOML string is not parsed: ``epochs = "3"`` is a type error in a file."""
    from_text = from_text and isinstance(value, str)
    value = _shown(value)
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
        raise ConfigError(key, value, allowed(key), _fix(key), origin)
    if tp is float:
        try:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if from_text:
                return float(value)
        except (ValueError, OverflowError):  # not a number; an integer beyond a float's range
            pass
        raise ConfigError(key, value, allowed(key), _fix(key), origin)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, value, "a string", f'{key} = "..." in TOML (quoted)', origin)
    raise AssertionError(f"config field {key} has an unsupported type {tp}")


def unknown_key(key: str, value: Any, origin: str) -> ConfigError:
    """A key no section has: the fix names the key of that name in another section first (`train.lr`, a bare
    `lr`: optim.lr; the commonest slip in a TOML file is a key under the wrong table), else the nearest
    spelling (a section's name only for an undotted key: `train.lr` is not `--train`)."""
    leaf = key.rpartition(".")[2]
    close = sorted(k for k in all_keys() if k.rpartition(".")[2] == leaf)[:2]
    if not close:
        known = list(all_keys()) + list(ALIASES) + ([] if "." in key else list(sections()))
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if origin not in (CLI, LIBRARY) and len(close) == 1 and "." in close[0]:  # a file: its table too
        table, _, name = close[0].partition(".")
        fix = f"did you mean --{close[0]}? ([{table}] {name} in the file)"
    else:
        fix = f"did you mean {' or '.join(f'--{k}' for k in close)}?" if close else \
            "run 'scaletrain train --help' for every key"
    return ConfigError(key, _shown(value), f"a key listed by 'scaletrain train --help' ({key} is not one)", fix,
                       origin)


def flatten(tree: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """{'optim': {'lr': 0.1}} -> {'optim.lr': 0.1}; dotted keys are accepted as they are."""
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, Mapping) and ALIASES.get(name, name) not in _schema():  # for a key: coerce refuses it
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
        if path.is_dir():
            raise ConfigError("config", source, "a TOML file or a built-in recipe", "give the TOML file in it "
                              f"(scaletrain train {path / 'my_run.toml'})", "a directory")
        if not path.is_file():
            fix = "check the path" if source.endswith(".toml") else f"use one of the recipes: {', '.join(names)}"
            raise ConfigError("config", source, f"a TOML file or a built-in recipe ({', '.join(names)})", fix,
                              "not found")
        if path.suffix == ".py":  # `scaletrain train my_script.py`: a script runs under launch, not as a config
            raise ConfigError("config", source, "a TOML file or a built-in recipe (a Python script is run, not read)",
                              f"scaletrain launch --nproc 2 {source} (its fit() or session takes the --section.key "
                              "options), or scaletrain.plan_fit() inside it to plan it", "a Python script")
        origin, name = str(path), path.stem
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise ConfigError("config", source, "a file this process can read", "check its permissions",
                              f"{type(err).__name__}: {err.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # TOML is UTF-8; Windows editors save UTF-16 with a byte-order mark
            seen = "UTF-16 (it starts with a byte-order mark)" if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else \
                "not text in UTF-8"
            raise ConfigError("config", source, "a TOML file in UTF-8", "save it as UTF-8 (in most editors: "
                              "Save As, encoding UTF-8)", seen) from None
        # UTF-8 with a byte-order mark (Notepad's "UTF-8 with BOM"): the same TOML without it, which tomllib
        # refuses at line 1, column 1
        text = text.removeprefix("\ufeff")
    try:
        tree = tomllib.loads(text)
    except ValueError as err:  # TOMLDecodeError, or an integer too long for Python to read
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


def dir_problem(path: Path) -> str:
    """Why ``path`` cannot be, or be created as, a directory this process can write ('' if it can). Nothing is
    left here: where the permissions say yes, a directory is made in the nearest existing one and removed (as
    root, or on /proc and /sys, they say yes to what mkdir refuses)."""
    try:
        existing = path.absolute()
        while not (existing.exists() or existing.is_symlink()) and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir():
            return f"{existing} is not a directory"
        if not os.access(existing, os.W_OK | os.X_OK):
            return f"{existing} is not writable"
    except OSError as err:  # a name too long, a loop of symbolic links
        return err.strerror or str(err)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".scaletrain-probe-", dir=existing))
    except OSError as err:
        return f"{existing} refuses a new directory ({err.strerror or err})"
    return ""


def again(resume: str, it: str = "") -> str:
    """How to resume a stopped run from the checkpoint it saved in its run directory: the same command, unless
    that command names a checkpoint (checkpoint.resume = PATH), which would start from PATH again. ``it``: words
    after "resume" (" from it")."""
    if resume in ("auto", "never"):
        return f"run the same command again to resume{it}"
    return (f"run the same command with --checkpoint.resume=auto to resume{it or ' from it'} (with PATH, it starts "
            "from PATH again)")


def check_run_dir(path: Path, origin: str = "") -> None:
    """``path`` is, or can be created as, a directory this process can write: checked before any worker starts,
    so that an unwritable run directory is one line naming it, not a crash on rank 0 after start-up."""
    if problem := dir_problem(path):
        raise ConfigError("run.dir", str(path), f"a directory this process can create and write ({problem})",
                          "--run.dir=PATH in a writable place", origin)
    saves = path / "checkpoints"  # where every save goes: a file there failed each save, then a traceback
    if saves.exists() and not saves.is_dir():
        raise ConfigError("run.dir", str(path), f"a run directory whose checkpoints is a directory ({saves} is a "
                          "file)", f"move {saves} away, or --run.dir=PATH elsewhere", origin)
