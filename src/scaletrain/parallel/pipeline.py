"""Pipeline parallelism for the built-in GPT and Llama (torch.distributed.pipelining): the blocks are split
into ``pp`` stages, one per rank of a pipeline group; each step's batch flows through them in micro-batches.

    split the model (pipeline_stage) -> PipelineRunner(stage, mesh, ...) -> runner.step(inputs, target)
    -> clip_grad_norm(stage, max_norm, pp group) -> optimizer.step() on the stage's parameters

scaletrain train and fit() run this (parallel/__init__.py cuts the stage and shards it, train/job.py steps
the runner): the stage may be sharded by FSDP over the data-parallel ranks holding it (PP x FSDP, as
torchtitan composes them), whose reduce-scatter torch's schedules run after the last micro-batch's backward;
a plain stage's gradients are averaged over its replicas by the runner.

Stage 0 holds the embeddings, the last stage the final norm and the head; the blocks are split as evenly as
possible, earlier stages taking the extra block: the last stage also runs the (B, T, vocab) head and the loss,
the largest matmul of the model, so it is the one to lighten. Every stage keeps the whole model's parameter
names (``blocks.3.attn.qkv.weight`` stays that in whichever stage holds block 3), so a checkpoint written
under pp = 2 loads under pp = 1 by name and back.

GPT's head shares the token embedding. With pp > 1 the two ends are on different ranks, so, as Megatron-LM
does, the last stage holds its own copy of the weight (``head.weight``, initialised equal to
``tok_emb.weight``), and after backward the two gradients are summed between the first and the last stage:
both copies then get the same gradient and the same update, and stay equal. A checkpoint sees what it sees of
one process's GPT, whose state_dict also lists the one tied tensor under both names: stage 0 writes
``tok_emb.weight``, the last stage ``head.weight``, equal values; loading either way fills both.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.layout import SCHEDULES as SCHEDULE_NAMES
from scaletrain.layout import resolve_microbatches
from scaletrain.models.gpt import GPT, embed
from scaletrain.models.llama import Llama, reset_rope
from scaletrain.sharded import dtensor_class, fsdp_class, is_dtensor, local_shard, plain, stage_parts

__all__ = ["PipelineRunner", "StepTimes", "bubble_fraction", "clip_grad_norm", "is_stage", "pipeline_stage",
           "rank_stages", "resolve_microbatches", "schedule_text", "split_stages", "stage_grad_norm", "stage_layers",
           "stage_parts"]

log = logging.getLogger(__name__)

DP_DIMS = ("dp_replicate", "dp_shard")


def stage_layers(n_layer: int, pp: int) -> list[range]:
    """The block indices of each of ``pp`` stages: as even as possible, the first ``n_layer % pp`` stages one
    block more."""
    if n_layer < pp:
        raise ValueError(f"parallel.pp={pp} stages need at least {pp} blocks but model.n_layer={n_layer}; "
                         f"set --parallel.pp to at most {n_layer}")
    base, extra = divmod(n_layer, pp)
    start = [i * base + min(i, extra) for i in range(pp + 1)]  # the first `extra` stages one block more
    return [range(start[i], start[i + 1]) for i in range(pp)]


class _Stage(nn.Module):
    """What every stage module says about itself. ``tied_param``: this stage's end of a weight tied across
    stages (its name here), whose gradient is summed with the other end's; ``tied_copy``: that parameter is
    the copy, left out when the norm of all the model's gradients is taken (the model counts it once).
    ``mesh``: the run's DeviceMesh, set by parallelize() once the stage is placed on it."""

    # parallel/units.py finds a stage's blocks by this class name (its blocks are a ModuleDict by index)
    _no_split_modules = ("Block",)

    def __init__(self, index: int, pp: int) -> None:
        super().__init__()
        self.index, self.pp = index, pp
        self.tied_param: str | None = None
        self.tied_copy = False
        self.ties_stages = False  # the model has a weight tied across stages (every stage knows)
        self.kept_name = "tok_emb.weight"  # the tied weight's name in one process's model (its first stage's)
        self.own_loss_shifts = False  # the model's own loss predicts labels[t + 1] at t (transformers' causal LMs)
        self.mesh: DeviceMesh | None = None

    @property
    def tied_aliases(self) -> dict[str, str]:
        """{this stage's copy: the name one process's model keeps} (GPT's head copy on the last stage: {
        "head.weight": "tok_emb.weight"}): a checkpoint stores the weight once, under the kept name, as one
        process's does, and the copy loads from it."""
        return {self.tied_param: self.kept_name} if self.tied_copy and self.tied_param else {}

    @property
    def held_as(self) -> dict[str, str]:
        """The inverse of tied_aliases: {the name a checkpoint stores the weight under: this stage's copy}."""
        return {kept: copy for copy, kept in self.tied_aliases.items()}

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.pp - 1


def _head_copy(head: nn.Linear, weight: torch.Tensor) -> nn.Linear:
    """The last stage's own head, a copy of the weight it is tied to on the first stage (pp > 1)."""
    copy = nn.Linear(head.in_features, head.out_features, bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        copy.weight.copy_(weight)
    return copy


class _GPTStage(_Stage):
    """Stage ``index`` of a GPT: token ids (B, T) on the first stage, the residual stream (B, T, C) elsewhere;
    logits (B, T, vocab) out of the last."""

    fsdp_policy_casts = True  # GPT's own pieces (precision.policy_casts)

    def __init__(self, model: GPT, index: int, pp: int, layers: range) -> None:
        super().__init__(index, pp)
        first, last = index == 0, index == pp - 1
        self.bf16_residual = model.bf16_residual
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first else None
        self.drop = model.drop if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.ln_f = model.ln_f if last else None
        self.head = model.head if last else None
        tied = model.head.weight is model.tok_emb.weight
        self.ties_stages = tied and pp > 1
        if tied and first != last:  # the two ends of the tied weight on different ranks
            self.tied_param = "tok_emb.weight" if first else "head.weight"
            if last:
                self.head, self.tied_copy = _head_copy(model.head, model.tok_emb.weight), True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            x = embed(self, x)  # (B, T, C)
        for block in self.blocks.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))  # (B, T, vocab)
        return x


class _LlamaStage(_Stage):
    """Stage ``index`` of a Llama; each stage keeps the RoPE tables (not in the state dict) its blocks use."""

    fsdp_policy_casts = True  # Llama's own pieces (precision.policy_casts)

    def __init__(self, model: Llama, index: int, pp: int, layers: range) -> None:
        super().__init__(index, pp)
        self.tok_embeddings = model.tok_embeddings if index == 0 else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if index == pp - 1 else None
        self.output = model.output if index == pp - 1 else None
        self.rope = model.rope
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.seq_shards = 1  # tensor parallelism's sequence-parallel residual: each rank holds T / tp positions

    def reset_buffers(self, device: torch.device | None = None) -> None:
        """The RoPE tables, computed (a stage of a model built on the meta device, models/init.py)."""
        reset_rope(self, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1] if self.tok_embeddings is not None else x.shape[1] * self.seq_shards
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)  # (B, T, C), or (B, T / tp, C) under tensor parallelism
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if self.output is not None:
            x = self.output(self.norm(x))  # (B, T, vocab)
        return x


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module, nn.Module] | None:
    """(token embedding, decoder layers, final norm, rotary embedding, head) of a Hugging Face decoder-only
    causal LM laid out as Llama's (``model.embed_tokens``, ``model.layers``, ``model.norm``,
    ``model.rotary_emb``, ``lm_head``: Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo and others), else None."""
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    parts = [getattr(base, name, None) for name in ("embed_tokens", "layers", "norm", "rotary_emb")]
    if not isinstance(head, nn.Linear) or any(not isinstance(p, nn.Module) for p in parts) \
            or not isinstance(parts[1], nn.ModuleList):
        return None
    embed, layers, norm, rotary = parts
    return embed, layers, norm, rotary, head  # type: ignore[return-value]


class _CausalLMStage(_Stage):
    """Stage ``index`` of a Hugging Face decoder-only causal LM (causal_lm_parts): token ids (B, T) in on the
    first stage, the hidden states (B, T, C) between, logits (B, T, vocab) out of the last. Its modules keep
    the model's own names (``model.layers.5.mlp...``, ``lm_head.weight``). Each stage computes the rotary
    embedding for its layers; attention is causal over whole sequences (no padding mask: PyTorch's SDPA with
    no mask is causal, which parallel/__init__.py checks against the model's own forward before training).
    A head tied to the token embedding is copied onto the last stage, as for GPT."""

    def __init__(self, model: nn.Module, parts: tuple[nn.Module, ...], index: int, pp: int, layers: range) -> None:
        super().__init__(index, pp)
        embed, blocks, norm, rotary, head = parts  # causal_lm_parts(model)
        first, last = index == 0, index == pp - 1
        self._no_split_modules = tuple(getattr(model, "_no_split_modules", None) or ())
        self.model = nn.Module()  # the model's "model." prefix, so that the names are the whole model's
        self.model.embed_tokens = embed if first else None
        self.model.layers = nn.ModuleDict({str(i): blocks[i] for i in layers})
        self.model.norm = norm if last else None
        self.model.rotary_emb = rotary
        self.lm_head = head if last else None
        tied = head.weight is embed.weight
        self.ties_stages, self.kept_name = tied and pp > 1, "model.embed_tokens.weight"
        self.own_loss_shifts = True
        if tied and first != last:
            self.tied_param = self.kept_name if first else "lm_head.weight"
            if last:
                self.lm_head, self.tied_copy = _head_copy(head, embed.weight), True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        if m.embed_tokens is not None:
            x = m.embed_tokens(x)  # (B, T, C)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        rotary = m.rotary_emb(x, positions)
        for layer in m.layers.values():
            out = layer(x, attention_mask=None, position_ids=positions, position_embeddings=rotary)
            x = out[0] if isinstance(out, tuple) else out  # transformers 4 returns a tuple, 5 the tensor
        if self.lm_head is not None:
            x = self.lm_head(m.norm(x))  # (B, T, vocab)
        return x


def pipeline_stage(model: nn.Module, pp: int, index: int) -> nn.Module:
    """Stage ``index`` of ``pp`` of a built-in GPT or Llama. It shares the model's modules (no copy, but for
    GPT's tied head on the last stage when pp > 1); the caller keeps only its own stage."""
    if not 0 <= index < pp:
        raise ValueError(f"stage index {index} is outside parallel.pp={pp} stages (0 to {pp - 1})")
    stage = _cut(model, pp, index)
    # its parameters keep the model's names, so the model's initial-weight rules fill them (models/init.py)
    stage.init_rules, stage.init_seed = getattr(model, "init_rules", None), getattr(model, "init_seed", 0)
    return stage


def _cut(model: nn.Module, pp: int, index: int) -> _Stage:
    if isinstance(model, GPT):
        if model.fused_loss and index == 0:  # once, where rank 0 (stage 0) logs it
            log.warning("model.loss=fused is ignored with parallel.pp > 1: the last stage returns the logits "
                        "and the pipeline's loss function takes the cross-entropy")
        return _GPTStage(model, index, pp, stage_layers(len(model.blocks), pp)[index])
    if isinstance(model, Llama):
        return _LlamaStage(model, index, pp, stage_layers(len(model.layers), pp)[index])
    if (parts := causal_lm_parts(model)) is not None:
        return _CausalLMStage(model, parts, index, pp, stage_layers(len(parts[1]), pp)[index])
    raise ValueError(f"parallel.pp={pp} splits the built-in models (model.name=gpt or llama) and Hugging Face "
                     f"causal LMs laid out as Llama's, not {type(model).__name__}; set --parallel.pp=1")


class _Stages(_Stage):
    """The stages one rank holds under the interleaved schedule (rank r of p: stages r, r + p, r + 2p, ...), as
    one module whose parameters carry the model's own names for all of them (``blocks.5`` wherever block 5
    is): what the optimizer, clipping and checkpoints read. Each stage still runs as its own module
    (``parts``, not registered: their parameters are these), one PipelineStage each."""

    def __init__(self, parts: list[_Stage]) -> None:
        super().__init__(parts[0].index, parts[0].pp)
        self.__dict__["parts"] = parts  # plain list: the parts' modules are registered below, once, by name
        for part in parts:
            _merge_children(self, part)
        self.init_rules, self.init_seed = parts[0].init_rules, parts[0].init_seed
        tied = [part for part in parts if part.tied_param is not None]
        self.tied_param = tied[0].tied_param if tied else None
        self.tied_copy = any(part.tied_copy for part in parts)
        self.ties_stages = any(part.ties_stages for part in parts)
        self.kept_name, self.own_loss_shifts = parts[0].kept_name, parts[0].own_loss_shifts

    @property
    def is_first(self) -> bool:
        return any(part.is_first for part in self.parts)

    @property
    def is_last(self) -> bool:
        return any(part.is_last for part in self.parts)

    def reset_buffers(self, device: torch.device | None = None) -> None:
        for part in self.parts:  # the parts' own buffers (the RoPE tables) are not registered here
            if callable(reset := getattr(part, "reset_buffers", None)):
                reset(device)

    @property
    def seq_shards(self) -> int:
        return getattr(self.parts[0], "seq_shards", 1)

    @seq_shards.setter
    def seq_shards(self, n: int) -> None:  # tensor parallelism sets it on the stages that run
        for part in self.parts:
            part.seq_shards = n


def _merge_children(into: nn.Module, part: nn.Module) -> None:
    """Register ``part``'s children on ``into`` by name: blocks (a ModuleDict by index) added to those there,
    a plain holder (a transformers model's ``model.``: type nn.Module itself) merged the same way, one level
    down, any other module set (a module every part shares, or the one part that has it)."""
    for name, child in part.named_children():
        if isinstance(child, nn.ModuleDict):  # the blocks, by index
            if getattr(into, name, None) is None:
                setattr(into, name, nn.ModuleDict())
            getattr(into, name).update(child)
        elif type(child) is nn.Module:
            if getattr(into, name, None) is None:
                setattr(into, name, nn.Module())
            _merge_children(getattr(into, name), child)
        else:
            setattr(into, name, child)


def rank_stages(model: nn.Module, pp: int, rank: int, virtual: int = 1) -> nn.Module:
    """What rank ``rank`` of a pipeline of ``pp`` holds: its stage, or with ``virtual`` > 1 (the interleaved
    schedule) its ``virtual`` stages of pp x virtual, r, r + pp, ... in one _Stages."""
    if virtual == 1:
        return pipeline_stage(model, pp, rank)
    return _Stages([pipeline_stage(model, pp * virtual, rank + i * pp) for i in range(virtual)])


def is_stage(module: nn.Module) -> bool:
    """A pipeline stage made by pipeline_stage (FSDP-sharded or not)."""
    return isinstance(module, _Stage)


def split_stages(model: nn.Module, pp: int) -> list[nn.Module]:
    """All ``pp`` stages of a built-in GPT or Llama (one process holding them all: for tests and tools)."""
    return [pipeline_stage(model, pp, i) for i in range(pp)]


def bubble_fraction(pp: int, microbatches: int, virtual: int = 1) -> float:
    """The idle share of a pipeline step's wall time, (p - 1) / (v m + p - 1), for GPipe and 1F1B (v = 1)
    and interleaved 1F1B (v stages per rank).

    Each of the p - 1 fill and p - 1 drain slots leaves a stage idle for one micro-batch's forward (resp.
    backward) of one stage, while the step lasts v m + p - 1 such slots (equal stages, free communication).
    The same bubble as a share of the ideal, bubble-free time is (p - 1) / (v m) (Narayanan et al. 2021,
    the issue's formula); this one, x / (1 + x) of it, is what a measurement of busy time over wall time
    gives (StepTimes.bubble), so the two can be put side by side.
    """
    if pp < 1 or microbatches < 1 or virtual < 1:
        raise ValueError(f"bubble_fraction needs pp, microbatches and virtual >= 1, "
                         f"got {pp}, {microbatches}, {virtual}")
    return (pp - 1) / (virtual * microbatches + pp - 1)


def schedule_text(schedule: str, virtual: int) -> str:
    """How a run's header and summary name a schedule: "1f1b", "interleaved x 2 stages per rank"."""
    return schedule + (f" x {virtual} stages per rank" if virtual > 1 else "")


@dataclass(frozen=True)
class StepTimes:
    """One stage's step: seconds computing (forward, backward and loss of its micro-batches) and seconds of
    wall time; the rest was bubble and communication. The first step's wall time also holds the schedule's
    set-up (a forward and backward of one micro-batch to learn the shapes sent between stages): measure from
    the second."""

    busy_s: float
    wall_s: float

    @property
    def bubble(self) -> float:
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


class _Reading:
    """Seconds accumulated over some spans: host seconds, plus CUDA event pairs read once they are done."""

    def __init__(self, host_s: float, events: list[tuple[Any, Any]]) -> None:
        self._host_s, self._events = host_s, events

    def ready(self) -> bool:
        """True when reading costs no wait (CPU; or the last CUDA event has completed: a query, no sync)."""
        return not self._events or bool(self._events[-1][1].query())

    def seconds(self) -> float:
        """The seconds; on CUDA this waits for the last event (a host-device sync) unless ready()."""
        if self._events:
            self._events[-1][1].synchronize()
        return self._host_s + sum(a.elapsed_time(b) for a, b in self._events) / 1e3  # ms -> s


class _Clock:
    """Accumulated seconds of timed spans: a host timer on CPU (ops run as they are called); on CUDA, event
    pairs on the stream, read only once they are done (waiting for them is a host-device sync)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host_s = 0.0
        self._events: list[tuple[Any, Any]] = []

    @contextlib.contextmanager
    def span(self) -> Iterator[None]:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._host_s += time.perf_counter() - t0

    def take(self) -> _Reading:
        """What was accumulated since the last take, as a reading; the clock starts again from zero."""
        reading = _Reading(self._host_s, self._events)
        self._host_s, self._events = 0.0, []
        return reading


@functools.cache
def _pipelining() -> tuple[type[Any], dict[str, type[Any]]]:
    """torch.distributed.pipelining's stage (timed on a clock: its forward and backward chunks are the stage's
    busy time) and its schedules by name, imported when a pipeline is first built: the module imports
    torch._dynamo, 0.4 s of every process's start-up on this project's machine, which a run without pipeline
    parallelism never needs."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    class TimedStage(PipelineStage):
        def __init__(self, *args: Any, clock: _Clock, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.clock = clock

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with self.clock.span():
                return super().forward_one_chunk(*args, **kwargs)

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            with self.clock.span():
                return super().backward_one_chunk(*args, **kwargs)

    return TimedStage, dict(zip(SCHEDULE_NAMES, (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)))


def _tied_group(mesh: DeviceMesh, pp_dim: str) -> dist.ProcessGroup | None:
    """The 2-rank group of this rank's pipeline's first and last stage (None on the stages between). Every
    rank must call this, as it creates one group per pipeline; with pp = 2 it is the pipeline group."""
    dim = mesh.mesh_dim_names.index(pp_dim)
    if mesh.size(dim) == 2:
        return mesh.get_group(pp_dim)
    pipelines = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.size(dim))  # a row per pipeline, in stage order
    group, _ = dist.new_subgroups_by_enumeration([[int(row[0]), int(row[-1])] for row in pipelines])
    return group


def _sum_tied_grads(stage: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum the gradient of a weight tied across the first and last stage: both copies take the same step.
    Under FSDP both ends are sharded alike (same shape, same data-parallel ranks): their shards are summed."""
    if getattr(stage, "tied_param", None) is None:
        return
    assert group is not None, "a stage with a tied weight has a tied group"
    param = stage.get_parameter(stage.tied_param)
    grad = param.grad
    assert grad is not None, "step() ran backward through the tied weight"
    if is_dtensor(grad) and grad.placements != param.placements:
        # Under tensor parallelism the embedding's gradient comes back whole (Replicate) while the head copy's is
        # split by vocabulary rows like both weights: take this rank's rows (a local slice), so the two ends'
        # shards meet rank by rank
        param.grad = grad = grad.redistribute(param.device_mesh, param.placements)
    dist.all_reduce(local_shard(grad), group=group)


def _average_grads(params: list[nn.Parameter], groups: list[dist.ProcessGroup]) -> None:
    """Average gradients over the data-parallel ranks of a stage: one flat all-reduce per dp axis."""
    if not groups:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    for group in groups:
        dist.all_reduce(flat, group=group)
    flat /= math.prod(dist.get_world_size(g) for g in groups)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def stage_grad_norm(stage: nn.Module, pp_group: dist.ProcessGroup) -> torch.Tensor:
    """The norm of the whole model's gradients: the stages' squared norms summed over the pipeline group (a
    tied weight counted once, as one process counts it; FSDP shards' norms first completed over their ranks).
    Data-parallel replicas hold equal averaged gradients, so the pipeline group is enough. Collective."""
    skip = stage.tied_param if getattr(stage, "tied_copy", False) else None
    grads = [p.grad for name, p in stage.named_parameters() if p.grad is not None and name != skip]
    norm = torch.nn.utils.get_total_norm(grads)
    sq = plain(norm).float() ** 2  # this stage's share
    dist.all_reduce(sq, group=pp_group)
    return sq.sqrt()


@torch.no_grad()
def clip_with_norm(stage: nn.Module, max_norm: float, norm: torch.Tensor) -> None:
    """Scale the stage's gradients by max_norm / norm where that is below 1, as clip_grad_norm_ scales."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    grads = [local_shard(p.grad) for p in stage.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, coef.to(grads[0].device))


def clip_grad_norm(stage: nn.Module, max_norm: float, pp_group: dist.ProcessGroup) -> torch.Tensor:
    """Clip the stage's gradients by the norm of the whole model's gradients (stage_grad_norm); returns it."""
    norm = stage_grad_norm(stage, pp_group)
    clip_with_norm(stage, max_norm, norm)
    return norm


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 4


class PipelineRunner:
    """Runs one stage of a pipeline: ``step(inputs, target)`` is one training step's forward and backward over
    the micro-batches, leaving in the stage's parameters the gradient of the mean loss over the whole batch
    (summed with the tied weight's other end, averaged over the data-parallel ranks of the stage).

    ``mesh``: the run's DeviceMesh with a ``pp_dim`` axis; its ``dp_replicate`` / ``dp_shard`` axes, where
    present, are the ranks holding the same stage and seeing other rows: a plain stage's gradients are
    averaged over them by all-reduce after the pipeline's backward; an FSDP-sharded stage's are reduce-scattered
    by FSDP (torch's schedules run its reduction after the last micro-batch). ``loss_fn(logits, target)`` -> mean
    loss of a micro-batch. ``accum``: steps whose gradients add up before the optimizer steps (gradient
    accumulation): each micro-batch's loss is divided by micro-batches x accum (the schedule's own division
    by the micro-batches would divide what earlier steps accumulated too), so equal micro-batches give the
    gradient of the mean over everything accumulated.
    """

    def __init__(self, stage: nn.Module, mesh: DeviceMesh, *, device: torch.device, microbatches: int,
                 schedule: str, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 pp_dim: str = "pp", accum: int = 1) -> None:
        names = mesh.mesh_dim_names or ()
        if pp_dim not in names:
            raise ValueError(f"the device mesh has no {pp_dim!r} axis (axes: {', '.join(names)})")
        extra = [n for n in names if n not in (pp_dim, "tp", *DP_DIMS) and mesh.size(names.index(n)) > 1]
        if extra:
            raise ValueError(f"parallel.pp does not combine with the mesh axes {', '.join(extra)} yet; "
                             f"set their degrees to 1")
        parts = stage_parts(stage)
        sharded = any(isinstance(part, fsdp_class()) for part in parts)
        split = "tp" in names and mesh.size(names.index("tp")) > 1  # DTensor parameters, reduced by autograd
        if not sharded and not split and any(isinstance(p, dtensor_class()) for p in stage.parameters()):
            raise ValueError("PipelineRunner takes a plain stage, or one sharded by FSDP or split by tensor "
                             "parallelism on the mesh it is given")
        if not sharded and "dp_shard" in names and mesh.size(names.index("dp_shard")) > 1:
            log.warning("parallel.pp with a dp_shard axis and an unsharded stage: the stage is replicated over "
                        "the dp_shard ranks and its gradients averaged")
        self.stage_module, self.device, self.accum = stage, device, accum
        self.pp_group = mesh.get_group(pp_dim)
        self.pp, self.index = mesh.size(names.index(pp_dim)), mesh.get_local_rank(pp_dim)
        self.schedule, self.virtual = schedule, len(parts)
        if (schedule == "interleaved") != (len(parts) > 1):
            raise ValueError(f"parallel.pp_schedule={schedule} runs {'several stages' if len(parts) == 1 else 'one stage'}"
                             f" per rank; this rank holds {len(parts)} (pipeline.rank_stages)")
        self.microbatches = resolve_microbatches(self.pp, microbatches, schedule)
        # a plain stage's replicas average here (TP with several data-parallel ranks is under FSDP: layout.py)
        self._dp_groups = [] if sharded or split else \
            [mesh.get_group(n) for n in DP_DIMS if n in names and mesh.size(names.index(n)) > 1]
        self._tied_group = _tied_group(mesh, pp_dim) if getattr(stage, "ties_stages", False) else None
        self._busy, self._wall = _Clock(device), _Clock(device)
        timed, schedules = _pipelining()
        self.stages = [timed(part, part.index, part.pp, device, group=self.pp_group, clock=self._busy)
                       for part in parts]
        self.is_first, self.is_last = any(st.is_first for st in self.stages), any(st.is_last for st in self.stages)
        self._losses: list[torch.Tensor] = []  # this step's micro-batch losses, unscaled
        self._schedule = schedules[schedule](self.stages if len(parts) > 1 else self.stages[0], self.microbatches,
                                             loss_fn=self._scaled(loss_fn), scale_grads=False)
        self._last: tuple[_Reading, _Reading] | None = None  # the last step's (busy, wall)
        self._pending: list[tuple[_Reading, _Reading]] = []  # steps not yet added to the totals
        self._totals = [0.0, 0.0, 0]  # busy s, wall s, steps: every training step after the first
        self._steps = 0
        # The schedule keeps every micro-batch's output (the logits) to merge and return them unless told not
        # to (where this torch offers it): m logits-sized tensors held on the last stage through the step, which
        # nothing reads.
        self._no_outputs = {"return_outputs": False} \
            if "return_outputs" in inspect.signature(self._schedule.step).parameters else {}
        log.info("pipeline rank %d of %d: stages %s, %s, %d micro-batches, bubble (p - 1) / (v m + p - 1) = %.1f%%",
                 self.index, self.pp, [part.index for part in parts], schedule, self.microbatches,
                 100 * self.planned_bubble)

    @property
    def planned_bubble(self) -> float:
        """The schedule's bubble by the formula, (p - 1) / (v m + p - 1) of the step (bubble_fraction)."""
        return bubble_fraction(self.pp, self.microbatches, self.virtual)

    def _scaled(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        scale = self.microbatches * self.accum

        def scaled(*args: Any, **kwargs: Any) -> torch.Tensor:
            with self._busy.span():
                loss = loss_fn(*args, **kwargs)
            self._losses.append(loss.detach())
            return loss / scale
        return scaled

    def _run(self, run: Callable[..., Any], inputs: torch.Tensor | None, target: torch.Tensor | None,
             **extra: Any) -> torch.Tensor | None:
        for name, t in (("inputs", inputs), ("target", target)):
            if t is not None and t.shape[0] % self.microbatches:
                raise ValueError(f"the batch of {t.shape[0]} {name} rows does not split into "
                                 f"parallel.microbatches={self.microbatches} equal micro-batches; "
                                 f"make the per-rank batch size a multiple of {self.microbatches}")
        args = (inputs,) if self.is_first else ()
        self._busy.take()  # drop what an interrupted step left
        self._losses = []
        with self._wall.span():
            run(*args, target=target if self.is_last else None, losses=[] if self.is_last else None, **extra)
        self._last = (self._busy.take(), self._wall.take())
        losses = self._losses[-self.microbatches:]  # the schedule's first step may also run a shape probe
        return torch.stack(losses).mean() if self.is_last and losses else None

    @property
    def busy(self) -> _Reading:
        """The last step's busy time, as a reading (seconds() waits on CUDA unless ready(): read it late)."""
        assert self._last is not None, "step() ran"
        return self._last[0]

    @property
    def times(self) -> StepTimes | None:
        """The last step's (or eval pass's) busy and wall time. On CUDA reading it waits for that step's events
        (a host-device sync): read it at log steps, not every step."""
        if self._last is None:
            return None
        busy, wall = self._last
        return StepTimes(busy_s=busy.seconds(), wall_s=wall.seconds())

    def _fold(self, *, wait: bool = False) -> None:
        """Add the timed steps whose readings are done (all with ``wait``: a sync on CUDA) to the totals."""
        while self._pending and (wait or all(r.ready() for r in self._pending[0])):
            busy, wall = self._pending.pop(0)
            self._totals[0] += busy.seconds()
            self._totals[1] += wall.seconds()
            self._totals[2] += 1

    def bubble(self) -> StepTimes | None:
        """Busy and wall seconds summed over the training steps after the first (whose wall time holds the
        schedule's set-up), their ``bubble`` the measured idle share; None before the second step. Waits for
        the last step's CUDA events (a sync): read it at the end of a run."""
        self._fold(wait=True)
        busy, wall, steps = self._totals
        return StepTimes(busy_s=busy, wall_s=wall) if steps else None

    def step(self, inputs: torch.Tensor | None, target: torch.Tensor | None, *,
             sync: bool = True) -> torch.Tensor | None:
        """One training step's forward and backward. ``inputs`` (B, T) are read on the first stage, ``target``
        (B, T) on the last (others may pass None). Returns the mean loss over the micro-batches on the last
        stage (this data-parallel rank's rows), None elsewhere; the caller clips (clip_grad_norm) and steps
        its optimizer. ``sync``: False on accumulation steps but the last (the tied weight's gradients are
        summed, a plain stage's averaged over its replicas, once they are all accumulated)."""
        loss = self._run(self._schedule.step, inputs, target, **self._no_outputs)
        self._steps += 1
        if self._steps > 1:
            assert self._last is not None
            self._pending.append(self._last)
            self._fold()
        if sync:
            _sum_tied_grads(self.stage_module, self._tied_group)
            _average_grads(list(self.stage_module.parameters()), self._dp_groups)
        return loss

    def eval_step(self, inputs: torch.Tensor | None, target: torch.Tensor | None) -> torch.Tensor | None:
        """Forward only (call under torch.no_grad(), with the stage in eval mode): the mean loss over the
        micro-batches on the last stage, None elsewhere."""
        return self._run(self._schedule.eval, inputs, target)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """One whole batch through the stages, no micro-batches (evaluation: any batch size; call under
        torch.no_grad()): each stage but the first receives its input from the stage before (its shape and
        dtype first), runs, and sends its output on. The last stage's output (the logits) there, None
        elsewhere. Every stage of the pipeline calls it for every batch."""
        mine = {part.index: part for part in stage_parts(self.stage_module)}
        stages = next(iter(mine.values())).pp  # in all: pp x virtual, stage k on pipeline rank k % pp
        x = inputs
        for k in range(stages):
            if k not in mine:
                continue
            x = mine[k](inputs if k == 0 else self._recv((k - 1) % self.pp))
            if k < stages - 1:
                self._send(x, (k + 1) % self.pp)
        return x if stages - 1 in mine else None

    def _peer(self, index: int) -> int:
        return dist.get_global_rank(self.pp_group, index)

    def _send(self, x: torch.Tensor, index: int) -> None:
        if x.dim() > _MAX_DIMS or x.dtype not in _DTYPES:
            raise ValueError(f"a pipeline stage's output of shape {tuple(x.shape)} and {x.dtype} cannot be sent")
        header = [_DTYPES.index(x.dtype), x.dim(), *x.shape, *[0] * (_MAX_DIMS - x.dim())]
        dist.send(torch.tensor(header, dtype=torch.int64, device=self.device), self._peer(index), group=self.pp_group)
        dist.send(x.contiguous(), self._peer(index), group=self.pp_group)

    def _recv(self, index: int) -> torch.Tensor:
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
        dist.recv(header, self._peer(index), group=self.pp_group)
        code, ndim, *shape = header.tolist()
        x = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=self.device)
        dist.recv(x, self._peer(index), group=self.pp_group)
        return x
