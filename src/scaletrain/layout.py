"""Topology as degrees on two named mesh axes: ``dp_replicate`` x ``dp_shard`` = world size.

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

Pure arithmetic on the config, no torch: the CLI checks a layout (train, slurm, plan) before anything heavy
is imported or any worker starts, and parallel/mesh.py builds the DeviceMesh from the same degrees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from scaletrain.config import MemoryConfig, ParallelConfig
from scaletrain.errors import ConfigError

MESH_DIMS = ("dp_replicate", "dp_shard")


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
        raise ConfigError("parallel.dp_shard", 1, "a degree > 1 with parallel.strategy=hsdp (replicas that "
                          "shard over 1 rank are DDP)", "--parallel.strategy=ddp, or --parallel.dp_shard=-1")
    return replicate, shard


@dataclass(frozen=True)
class Layout:
    """A run's parallel layout, resolved once per process (resolve_layout) and read by every part that needs
    it: parallelize() and its mesh, the loader's data-parallel rank and size, the checkpoint's metadata, the
    header. Immutable: nothing downstream recomputes a degree. (Tensor and pipeline degrees will join the
    data-parallel ones here; until then every rank is a data-parallel rank.)"""

    strategy: str  # ddp | fsdp | hsdp ("auto" resolved before)
    world_size: int
    nnodes: int
    dp_replicate: int  # ranks holding replicas of each shard
    dp_shard: int  # ranks each replica is sharded over

    @property
    def sharded(self) -> bool:
        return self.strategy in ("fsdp", "hsdp")

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own shard of every batch."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global rank ``rank`` (its place among the dp_size readers of the data)."""
        return rank

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
    replicate, shard = resolve_degrees(strategy, cfg.dp_replicate, cfg.dp_shard, world_size, nnodes)
    return Layout(strategy, world_size, nnodes, replicate, shard)


def check_layout(cfg: ParallelConfig, memory: MemoryConfig, world_size: int, nnodes: int = 1) -> None:
    """The layout checks that need no model, as one-line ConfigErrors. Call it before starting workers, so a
    mistake is reported once rather than by every rank (each worker resolves its Layout once)."""
    _check_offload(memory, cfg.strategy)
    if cfg.strategy != "auto":
        resolve_layout(cfg, memory, world_size, nnodes)
