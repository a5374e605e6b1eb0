"""Topology as degrees on named mesh axes: ``pp`` x ``dp_replicate`` x ``dp_shard`` x ``tp`` = world size.

The strategy names are presets for the degrees, decided here and nowhere else:

=========  ===================  =======================================================================
strategy   (replicate, shard)   what it means
=========  ===================  =======================================================================
ddp        (world, 1)           every rank holds a full replica; gradients are all-reduced
fsdp       (1, world)           parameters, gradients and optimizer state sharded over all ranks
hsdp       (nodes, world/nodes) sharded within a machine, replicated across machines (2-D mesh)
=========  ===================  =======================================================================

``--parallel.dp_replicate`` / ``--parallel.dp_shard`` override the preset (0 keeps it); -1 means "the
remaining ranks", the world size divided by the other degree.

``--parallel.tp`` and ``--parallel.pp`` take their share of the ranks first (tp within a machine); the data-
parallel degrees above resolve over what is left.

Pure arithmetic on the config, no torch: the CLI checks a layout (train, slurm, plan) before anything heavy
is imported or any worker starts, and parallel/mesh.py builds the DeviceMesh from the same degrees.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scaletrain.config import MemoryConfig, ModelConfig, ParallelConfig
from scaletrain.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


def _preset(strategy: str, world_size: int, nnodes: int) -> tuple[int, int]:
    if strategy == "ddp":
        return -1, 1
    if strategy == "fsdp":
        return 1, -1
    if strategy == "hsdp":
        return nnodes, -1
    raise ValueError(f"no degrees for strategy {strategy!r}: resolve 'auto' with choose_strategy first")


def _fill(key: str, degree: int, other_key: str, other: int, world_size: int) -> int:
    """-1 -> world_size / other, when other divides the world size."""
    if degree != -1:
        return degree
    if world_size % other:
        raise ConfigError(f"parallel.{key}", -1, f"-1 to take the remaining ranks, but world size "
                          f"{world_size} is not a multiple of parallel.{other_key} = {other}",
                          f"a parallel.{other_key} that divides {world_size}")
    return world_size // other


def resolve_degrees(strategy: str, dp_replicate: int, dp_shard: int, world_size: int,
                    nnodes: int = 1) -> tuple[int, int]:
    """(replicate, shard) with replicate x shard == world_size, or a one-line ConfigError with the arithmetic.

    ``dp_replicate`` / ``dp_shard``: 0 = the strategy's preset, -1 = the remaining ranks, else the degree.
    """
    for key, value in (("dp_replicate", dp_replicate), ("dp_shard", dp_shard)):
        if value < -1:
            raise ConfigError(f"parallel.{key}", value, "a degree >= 1, -1 (the remaining ranks) or 0 (from "
                              "parallel.strategy)", f"--parallel.{key}=-1")
    if strategy == "ddp" and dp_shard not in (0, 1):
        raise ConfigError("parallel.dp_shard", dp_shard, "1 (or 0) with parallel.strategy=ddp: DDP keeps "
                          "full replicas", "--parallel.strategy=fsdp (all ranks shard) or hsdp (shard and "
                          "replicate)")
    if strategy == "fsdp" and dp_replicate not in (0, 1):
        raise ConfigError("parallel.dp_replicate", dp_replicate, "1 (or 0) with parallel.strategy=fsdp: FSDP "
                          "shards over every rank", "--parallel.strategy=hsdp to replicate shard groups")
    if strategy == "hsdp" and nnodes > 1 and world_size % nnodes:
        raise ConfigError("parallel.strategy", "hsdp", f"the same number of ranks on each of the {nnodes} "
                          f"machines (world size {world_size} is not a multiple of {nnodes})",
                          "equal --nproc on every machine")
    preset = _preset(strategy, world_size, nnodes)
    replicate = dp_replicate or preset[0]
    shard = dp_shard or preset[1]
    if replicate == -1 and shard == -1:
        raise ConfigError("parallel.dp_shard", -1, "at most one degree of -1 (the remaining ranks), since "
                          "parallel.dp_replicate is -1 too", "give one of them as a number, e.g. "
                          "--parallel.dp_replicate=2 --parallel.dp_shard=-1")
    replicate = _fill("dp_replicate", replicate, "dp_shard", shard, world_size)
    shard = _fill("dp_shard", shard, "dp_replicate", replicate, world_size)
    if replicate * shard != world_size:
        raise ConfigError("parallel.dp_shard", shard, f"dp_replicate x dp_shard = world size, but "
                          f"{replicate} x {shard} = {replicate * shard} != {world_size}",
                          f"degrees whose product is {world_size}, or -1 for one (the remaining ranks)")
    if strategy == "hsdp" and shard == 1 and world_size > 1:
        least = next(d for d in range(2, world_size + 1) if world_size % d == 0)  # the smallest shard there is
        raise ConfigError("parallel.dp_shard", 1, "a degree > 1 with parallel.strategy=hsdp (replicas that "
                          "shard over 1 rank are DDP)", f"--parallel.dp_replicate={world_size // least} (shards of "
                          f"{least} ranks), or --parallel.strategy=ddp")
    return replicate, shard


@dataclass(frozen=True)
class Layout:
    """A run's parallel layout, resolved once per process (resolve_layout) and read by every part that needs
    it: parallelize() and its mesh, the loader's data-parallel rank and size, the checkpoint's metadata, the
    header. Immutable: nothing downstream recomputes a degree."""

    strategy: str  # ddp | fsdp | hsdp ("auto" resolved before)
    world_size: int
    nnodes: int
    dp_replicate: int  # ranks holding replicas of each shard
    dp_shard: int  # ranks each replica is sharded over
    tp: int = 1  # ranks each block's matrices are split over (innermost: neighbours on one machine)
    pp: int = 1  # pipeline stages (outermost)

    @property
    def sharded(self) -> bool:
        return self.strategy in ("fsdp", "hsdp")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own shard of every batch (the ranks of one tensor-parallel group
        read the same one, and so do the stages of one pipeline)."""
        return self.dp_replicate * self.dp_shard

    @property
    def mesh_shape(self) -> tuple[tuple[str, int], ...]:
        """The mesh's axes, outermost first, torchtitan's order: (pp, dp_replicate, dp_shard, tp); a global
        rank is its row-major index."""
        return tuple(zip(MESH_DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.tp)))

    def coordinates(self, rank: int) -> dict[str, int]:
        """Global rank ``rank``'s place on each axis of the mesh."""
        out = {}
        for name, size in reversed(self.mesh_shape):
            rank, out[name] = divmod(rank, size)
        return out

    def groups(self, *axes: str) -> list[list[int]]:
        """The ranks that differ only on ``axes`` (the same place on every other axis), one list per place:
        groups("tp") are the tensor-parallel groups, groups("dp_replicate", "dp_shard") each pipeline stage and
        tensor-parallel place's data-parallel replicas."""
        found: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            place = tuple(i for axis, i in self.coordinates(rank).items() if axis not in axes)
            found.setdefault(place, []).append(rank)
        return list(found.values())

    def describe(self) -> str:
        """The strategy with the model-parallel degrees: "ddp", "fsdp x tp 2", "tp 2"."""
        parts = [] if self.dp_size == 1 and self.tp * self.pp > 1 else [self.strategy]
        parts += [f"{name} {n}" for name, n in (("pp", self.pp), ("tp", self.tp)) if n > 1]
        return " x ".join(parts)

    def reads(self, rank: int) -> bool:
        """True for the one rank of each tensor-parallel group and pipeline that counts its batch (the others
        read the same samples): samples/s and eval totals are summed over these."""
        c = self.coordinates(rank)
        return c["tp"] == 0 and c["pp"] == 0

    def counts_eval(self, rank: int) -> bool:
        """True for the one rank of each tensor-parallel group and pipeline that counts an evaluation's totals:
        the group's first rank, on the pipeline's last stage (which computes the logits)."""
        c = self.coordinates(rank)
        return c["tp"] == 0 and c["pp"] == self.pp - 1

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global rank ``rank`` (its place among the dp_size readers of the data)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def as_dict(self) -> dict[str, int | str]:
        return dataclasses.asdict(self)


def _check_offload(memory: MemoryConfig, strategy: str) -> None:
    if memory.cpu_offload and strategy == "ddp":
        raise ConfigError("memory.cpu_offload", True, "false with parallel.strategy=ddp (offloading keeps "
                          "FSDP's sharded state in host memory)",
                          "--parallel.strategy=fsdp, or drop --memory.cpu_offload")


def resolve_layout(cfg: ParallelConfig, memory: MemoryConfig, world_size: int, nnodes: int = 1, *,
                   strategy: str = "") -> Layout:
    """The Layout of ``strategy`` (default cfg.strategy, which must not be auto: resolve_strategy decides that
    from memory first) at this world size, or a one-line ConfigError."""
    strategy = strategy or cfg.strategy
    if strategy == "auto":
        raise ValueError("resolve_layout: resolve parallel.strategy=auto first (parallel.resolve_strategy)")
    _check_offload(memory, strategy)
    dp_world = _model_parallel_share(cfg, world_size, nnodes)
    replicate, shard = resolve_degrees(strategy, cfg.dp_replicate, cfg.dp_shard, dp_world, nnodes)
    if strategy == "ddp" and cfg.tp > 1 and replicate > 1:
        raise ConfigError("parallel.strategy", "ddp", f"fsdp or hsdp with parallel.tp = {cfg.tp} and "
                          f"{replicate} data-parallel ranks (FSDP2 composes with tensor-parallel DTensors; DDP "
                          "does not)", "--parallel.strategy=fsdp")
    return Layout(strategy, world_size, nnodes, replicate, shard, cfg.tp, cfg.pp)


def _model_parallel_share(cfg: ParallelConfig, world_size: int, nnodes: int) -> int:
    """The ranks left for data parallelism once tp x pp take theirs, or a one-line ConfigError."""
    tp = cfg.tp
    dp = dp_world_size(cfg, world_size)
    per_node = world_size // max(nnodes, 1)
    if tp > 1 and per_node % tp:
        raise ConfigError("parallel.tp", tp, f"a divisor of the {per_node} ranks on each machine (tensor "
                          "parallelism communicates every layer: it stays within a machine)",
                          f"--parallel.tp={math.gcd(per_node, tp)}")
    return dp


def dp_world_size(cfg: ParallelConfig, world_size: int) -> int:
    """The data-parallel ranks among ``world_size``: the ranks of a tensor-parallel group, and the stages of a
    pipeline, read one batch together. A one-line ConfigError when tp x pp does not divide the world (a run
    started without the CLI's checks, by torchrun or on one process, gets it here first)."""
    tp, pp = cfg.tp, cfg.pp
    if world_size % (tp * pp):
        key, value = ("parallel.tp", tp) if world_size % tp else ("parallel.pp", pp)
        raise ConfigError(key, value, f"degrees whose product divides the world size {world_size} "
                          f"(dp x pp x tp = world; here pp {pp} x tp {tp} = {pp * tp})",
                          f"--nproc a multiple of {pp * tp}, or smaller degrees")
    return world_size // (tp * pp)


def check_layout(cfg: ParallelConfig, memory: MemoryConfig, world_size: int, nnodes: int = 1,
                 model: ModelConfig | None = None, batch_size: int = 0, seq_len: int = 0) -> None:
    """The layout checks that need no built model, as one-line ConfigErrors. Call it before starting workers,
    so a mistake is reported once rather than by every rank (each worker resolves its Layout once).
    ``model``: the built-in model's config, whose heads and layers the tensor and pipeline degrees split;
    ``batch_size``: the per-rank batch a pipeline splits into micro-batches (the trainer's checks: the planner
    plans layouts the trainer does not run yet); ``seq_len``: the sequence the Llama's sequence parallelism splits."""
    _check_offload(memory, cfg.strategy)
    if cfg.strategy != "auto":
        resolve_layout(cfg, memory, world_size, nnodes)
    else:
        _model_parallel_share(cfg, world_size, nnodes)
    if model is not None:
        check_split(cfg, model, seq_len)
    check_pipeline(cfg, batch_size)


def check_tp_split(tp: int, name: str, heads: tuple[tuple[str, int], ...], *, hidden: int | None = None,
                   loss: str = "split", seq_len: int = 0) -> None:
    """Tensor parallelism can split model ``name`` (model.name, or a module's class name) ``tp`` ways, or a
    one-line ConfigError: ``heads`` (config key, count), the MLP's ``hidden`` width (when known) and the
    ``seq_len`` positions a sequence-parallel residual stream splits (when given) divided whole; the GPT not
    with its fused loss. Read from the config before workers start (check_split) and from the built model by
    parallel/tensor.py."""
    if tp == 1:
        return
    if name not in ("gpt", "llama"):
        raise ConfigError("parallel.tp", tp, f"1 with model.name = {name}: tensor parallelism splits the built-in "
                          "GPT and Llama", "--parallel.tp=1, or --model.name=llama")
    if name == "gpt" and loss == "fused":
        raise ConfigError("model.loss", "fused", "split with parallel.tp > 1 (the fused loss reads the whole "
                          "output matrix, which tensor parallelism splits)", "--model.loss=split")
    check_whole_split(tp, heads, hidden=(f"the MLP's width {hidden}", hidden) if hidden is not None else None)
    if seq_len % tp:  # gloo aborted the worker on the uneven shards (NCCL would hang)
        raise ConfigError("data.seq_len", seq_len, f"a multiple of parallel.tp = {tp} (sequence parallelism gives "
                          f"each rank seq_len / tp positions of the residual stream)",
                          f"--data.seq_len={max(tp, seq_len // tp * tp)}, or --parallel.tp={_divisor_below(seq_len, tp)}")


def check_whole_split(tp: int, heads: tuple[tuple[str, int], ...], *, hidden: tuple[str, int] | None = None) -> None:
    """Each of ``heads`` (what, count) and the MLP's ``hidden`` (what, width) divided whole by ``tp``, or the
    ConfigError naming the first that is not and the largest degree below tp that divides it."""
    for key, n in heads:
        if n % tp:
            raise ConfigError("parallel.tp", tp, f"a divisor of {key} = {n} (each rank takes whole heads)",
                              f"--parallel.tp={_divisor_below(n, tp)}")
    if hidden is not None and hidden[1] % tp:
        raise ConfigError("parallel.tp", tp, f"a divisor of {hidden[0]}", f"--parallel.tp={_divisor_below(hidden[1], tp)}")


def _divisor_below(n: int, tp: int) -> int:
    """The largest degree below ``tp`` that divides ``n``: the fix to suggest."""
    return max(d for d in range(1, tp) if n % d == 0)


SCHEDULES = ("gpipe", "1f1b", "interleaved")


def resolve_microbatches(pp: int, microbatches: int, schedule: str) -> int:
    """parallel.microbatches, 0 meaning 2 x pp (ValueError where the schedule cannot run them): 1F1B needs at
    least one micro-batch per stage; interleaved 1F1B runs them in rounds of pp (torch's flexible schedule:
    max(1, m // pp) rounds that divide m)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    m = microbatches or 2 * pp
    if schedule == "1f1b" and m < pp:
        raise ValueError(f"parallel.microbatches={m} is fewer than parallel.pp={pp} stages, which 1f1b "
                         f"needs; set --parallel.microbatches={pp} or more")
    if schedule == "interleaved" and m % max(1, m // pp):
        raise ValueError(f"parallel.microbatches={m} does not split into {m // pp} rounds of parallel.pp={pp}, "
                         f"which interleaved needs; set --parallel.microbatches={m // pp * pp}")
    return m


def virtual_stages(cfg: ParallelConfig) -> int:
    """Pipeline stages per rank: parallel.pp_virtual under the interleaved schedule, else 1."""
    return cfg.pp_virtual if cfg.pp_schedule == "interleaved" else 1


def check_pipeline(cfg: ParallelConfig, batch_size: int = 0) -> int:
    """The micro-batches of a pipelined run (parallel.pp > 1; 1 otherwise), or a one-line ConfigError: enough
    for the schedule, each a whole number of rows of the per-rank ``batch_size`` (when given)."""
    if cfg.pp == 1:
        return 1
    if cfg.pp_schedule == "interleaved" and cfg.pp_virtual < 2:
        raise ConfigError("parallel.pp_virtual", cfg.pp_virtual, "2 or more stages per rank with "
                          "parallel.pp_schedule=interleaved (one stage per rank is 1f1b)",
                          "--parallel.pp_virtual=2, or --parallel.pp_schedule=1f1b")
    try:
        m = resolve_microbatches(cfg.pp, cfg.microbatches, cfg.pp_schedule)
    except ValueError:
        need = (f"at least parallel.pp = {cfg.pp} with parallel.pp_schedule=1f1b (one micro-batch per stage in "
                "flight)" if cfg.pp_schedule == "1f1b" else f"whole rounds of parallel.pp = {cfg.pp} with "
                f"parallel.pp_schedule=interleaved (m // pp rounds dividing m: fewer than {cfg.pp}, or "
                f"{cfg.pp}, {2 * cfg.pp}, {3 * cfg.pp}, ...)")
        raise ConfigError("parallel.microbatches", cfg.microbatches, need,
                          f"--parallel.microbatches={2 * cfg.pp}, or --parallel.pp_schedule=gpipe") from None
    if batch_size and batch_size % m:
        raise ConfigError("data.batch_size", batch_size, f"a multiple of the {m} micro-batches each step is split "
                          f"into with parallel.pp = {cfg.pp} (parallel.microbatches; 0 means 2 x pp)",
                          f"--data.batch_size={max(m, batch_size // m * m)}, or --parallel.microbatches="
                          f"{max(d for d in range(1, batch_size + 1) if batch_size % d == 0 and d <= m)}")
    return m


def check_split(cfg: ParallelConfig, model: ModelConfig, seq_len: int = 0) -> None:
    """The built-in model can be split tp ways by heads (and the Llama's ``seq_len`` positions: its sequence
    parallelism) and pp ways by blocks, or a one-line ConfigError."""
    tp, pp = cfg.tp, cfg.pp
    kv = (("model.n_kv_head", model.n_kv_head or model.n_head),) if model.name == "llama" else ()
    check_tp_split(tp, model.name, (("model.n_head", model.n_head), *kv), loss=model.loss,
                   seq_len=seq_len if model.name == "llama" else 0)
    if pp > 1 and model.name not in ("gpt", "llama"):
        raise ConfigError("parallel.pp", pp, f"1 with model.name = {model.name}: pipeline stages split the "
                          "built-in GPT and Llama", "--parallel.pp=1, or --model.name=llama")
    if pp > 1 and model.n_layer < pp:
        raise ConfigError("parallel.pp", pp, f"at most model.n_layer = {model.n_layer} (each stage holds at "
                          "least one block)", f"--parallel.pp={model.n_layer}")
    virtual = virtual_stages(cfg)
    if pp > 1 and model.n_layer < pp * virtual:
        raise ConfigError("parallel.pp_virtual", virtual, f"at most model.n_layer / parallel.pp = {model.n_layer} / "
                          f"{pp} stages per rank (each stage holds at least one block)",
                          f"--parallel.pp_virtual={max(1, model.n_layer // pp)}")
