"""Checkpointing a training job: what goes in, writing it without stalling the loop, and finding where to resume.

Layout of ``RUN_DIR/checkpoints/step-NNNNNNNN/`` (the consolidated format, for DDP and single-process runs;
everything is safetensors or JSON, so loading never unpickles anything):

    model.safetensors          the bare model's weights by name (tied weights once; aliases in its metadata)
    optimizer.safetensors      the optimizer state by parameter name (checkpoint/tree.py)
    trainer.json               step, loader position (global sample cursor), LR schedule, grad scaler
    rank-NNNNN.safetensors     per rank: every RNG, the log interval's running loss, the non-finite counters
    manifest.json              written last: every file's size and SHA-256, and the run's metadata

Model and optimizer are written once (rank 0; DDP keeps replicas identical); per-rank state comes from every
rank through one gather. The commit protocol is checkpoint/commit.py's.

The sharded format (FSDP runs) has ``dcp/`` (every rank's shards of model and optimizer state, and
``rank_buffers.R.*``: rank R's own copy of each buffer that differs between ranks, as BatchNorm statistics
do under FSDP, which does not synchronize buffers) and ``optimizer-groups.safetensors`` in place of the
first two.

Saving blocks the loop only while the state is copied into reusable host buffers; a background thread then
writes, fsyncs, hashes and commits (``checkpoint.async_save``). A new save first waits for the previous one.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from scaletrain import __version__
from scaletrain.checkpoint import commit, tree
from scaletrain.config import CheckpointConfig
from scaletrain.errors import CheckpointError, ConfigError, TrainingFailed
from scaletrain.observe.memory import local_shard
from scaletrain.runtime import Runtime, rank0_decides
from scaletrain.train.state import dedupe, differing, plain_digests

FORMAT_FULL, FORMAT_DCP = "full", "dcp"
MODEL, OPTIMIZER, TRAINER = "model.safetensors", "optimizer.safetensors", "trainer.json"
OPTIMIZER_GROUPS = "optimizer-groups.safetensors"  # dcp format: the param groups (the shards hold tensors only)
RANK_BUFFERS = "rank_buffers"  # dcp format: each rank's own buffers (their names in the manifest's meta)


class NonFiniteState(TrainingFailed):
    """The state to be saved holds a NaN or an infinity: the save is refused and training stops."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


@dataclass
class Resume:
    """A verified checkpoint that every rank agreed to load."""

    path: Path
    manifest: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def read(self, name: str) -> bytes:
        return commit.read_verified(self.path, name, self.manifest)


@dataclass
class SaveResult:
    step: int
    path: Path
    bytes: int
    blocked_s: float  # the loop's stall
    save_s: float  # from the stall's start until committed
    background: bool


@dataclass
class _ShardedRest:
    """What rank 0 writes beside the DCP shards of one save, and commits."""

    step: int
    stage: Path
    groups: Any
    trainer: dict[str, Any]
    ranks: list[Any]
    meta: dict[str, Any]
    started: float


@dataclass
class Snapshot:
    """Host copies of everything rank 0 writes, taken at a step boundary."""

    step: int
    model: dict[str, torch.Tensor]
    model_meta: dict[str, str]
    optim: dict[str, torch.Tensor]
    optim_meta: dict[str, str]
    trainer: dict[str, Any]
    ranks: list[Any]
    meta: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)


def _finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first floating-point tensor holding a NaN or infinity, or None. A tensor's sum is non-finite if any
    element is, and a sum is one cheap reduction where ``isfinite(t).all()`` writes a mask as large as t: the
    sums are taken together (one host sync), and only a tensor whose sum overflowed is checked element-wise."""
    floats = [(name, t) for name, t in tensors.items() if t.is_floating_point() and t.numel()]
    if not floats:
        return None
    sums = torch.stack([t.sum().float() for _, t in floats])
    for (name, t), ok in zip(floats, torch.isfinite(sums).tolist()):
        if not ok and not bool(torch.isfinite(t).all()):
            return name
    return None


def _rank_buffers(model: dict[str, torch.Tensor], ranks: list[Any],
                  rank: int) -> tuple[list[str], dict[str, Any]]:
    """(the names of the buffers that differ between ranks, what this rank saves of them). Every rank's
    digests came in ``ranks`` (and are taken out of what goes to the rank files). DCP writes rank 0's copy of
    a buffer under ``model.``; every other rank writes its own under ``rank_buffers.R.``, so that a rank gets
    back exactly what it saved (train/resume.py)."""
    own = differing([state.pop(RANK_BUFFERS) for state in ranks])
    if not own or rank == 0:
        return own, {}
    return own, {RANK_BUFFERS: {str(rank): {name: model[name] for name in own}}}


class Checkpointer:
    def __init__(self, cfg: CheckpointConfig, run_dir: Path, rt: Runtime) -> None:
        self.cfg, self.rt = cfg, rt
        self.root = run_dir / "checkpoints"
        # rank 0 writes a consolidated checkpoint; every rank writes its shards of a sharded one
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scaletrain-ckpt") \
            if cfg.async_save else None
        self._pending: Future[SaveResult | None] | None = None
        self._dcp_group: Any = None
        self._buffers: dict[str, torch.Tensor] = {}
        self.finished: list[SaveResult] = []  # committed saves the loop has not logged yet
        self.warnings: list[str] = []
        self.last_step = -1  # the last step saved or being saved

    def due(self, step: int, total: int) -> bool:
        every = self.cfg.every
        return every > 0 and step != self.last_step and (step % every == 0 or step == total)

    # -- saving -------------------------------------------------------------------------------------------

    def save(self, step: int, model: tuple[dict[str, torch.Tensor], dict[str, str]], optim: dict[str, Any],
             trainer: dict[str, Any], rank_state: dict[str, Any], meta: dict[str, Any], *,
             background: bool = True) -> float:
        """Save the state of ``step`` (every rank calls this). Returns the seconds the loop was blocked."""
        started = time.perf_counter()
        ranks: list[Any] = [None] * self.rt.world_size
        if self.rt.distributed:
            dist.gather_object(rank_state, ranks if self.rt.is_main else None, dst=0)
        else:
            ranks = [rank_state]
        self.last_step = step
        if not self.rt.is_main:
            return time.perf_counter() - started
        self.wait()  # the buffers are reused: the previous write must be done with them
        tensors, aliases = model
        optim_tensors, optim_meta = tree.split(optim)
        snap = Snapshot(step, self._stage("model/", tensors), {"aliases": json.dumps(aliases)},
                        self._stage("optim/", optim_tensors), optim_meta, trainer, ranks, meta, started)
        if self.rt.device.type == "cuda":
            torch.cuda.current_stream(self.rt.device).synchronize()  # the copies above were non-blocking
        blocked = time.perf_counter() - started
        if self._pool is not None and background:
            self._pending = self._pool.submit(self._write, snap, blocked, True)
        else:
            self.finished.append(self._write(snap, blocked, False))
        return blocked

    def save_sharded(self, step: int, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     trainer: dict[str, Any], rank_state: dict[str, Any], meta: dict[str, Any], *,
                     background: bool = True) -> float:
        """Save a sharded (FSDP) job through DCP: every rank writes its shards into the staging directory,
        which must be on storage all ranks share; rank 0 then writes the rest and commits. With
        ``checkpoint.async_save`` (and ``background``) the loop is blocked only while every rank copies its
        shards into host buffers kept between saves; DCP then writes them on each rank's checkpoint thread,
        its collectives on a Gloo group of their own, and rank 0's thread commits. Returns the seconds the
        loop was blocked."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from scaletrain.checkpoint import dcp

        started = time.perf_counter()
        self.wait()
        where: list[Any] = [str(commit.new_stage(self.root, step)) if self.rt.is_main else None]
        if self.rt.distributed:
            dist.broadcast_object_list(where, src=0)
        stage = Path(where[0])
        model, aliases = dedupe(get_model_state_dict(module))
        optim = get_optimizer_state_dict(module, optimizer)
        local = {**{f"model.{k}": local_shard(v) for k, v in model.items()},
                 **{f"optim.{k}": local_shard(v) for k, v in tree.split(optim["state"])[0].items()}}
        mine = {**rank_state, "nonfinite": _finite(local) or "", RANK_BUFFERS: plain_digests(model)}
        ranks: list[Any] = [mine]
        if self.rt.distributed:  # every rank learns of a non-finite shard anywhere, and then none writes
            ranks = [None] * self.rt.world_size
            dist.all_gather_object(ranks, mine)
        self.last_step = step
        bad = next((f"rank {r}: {state['nonfinite']}" for r, state in enumerate(ranks) if state["nonfinite"]), "")
        if bad:
            if self.rt.is_main:
                shutil.rmtree(stage, ignore_errors=True)
            raise NonFiniteState(f"refusing to checkpoint step {step}: {bad} is not finite; fix: "
                                 "--train.nonfinite=skip, a lower --optim.lr, or --optim.grad_clip=1.0")
        own, mine_only = _rank_buffers(model, ranks, self.rt.rank)
        rest = _ShardedRest(step, stage, optim["param_groups"], trainer, ranks,
                            {**meta, "aliases": aliases, RANK_BUFFERS: own}, started)
        state = {"model": model, "optim": optim["state"], **mine_only}
        if self._pool is not None and background:
            staged = self._stage("dcp/", state)
            if self.rt.device.type == "cuda":
                torch.cuda.current_stream(self.rt.device).synchronize()  # the copies were non-blocking
            group = self._cpu_group()
            blocked = time.perf_counter() - started
            self._pending = self._pool.submit(self._write_sharded, staged, rest, group, blocked)
            return blocked
        dcp.save(state, stage / dcp.DCP_DIR)
        if self.rt.is_main:
            self.finished.append(self._commit_sharded(rest, None))
        return time.perf_counter() - started

    def _cpu_group(self) -> Any:
        """A Gloo group for the collectives of DCP saves on the checkpoint thread, apart from the loop's
        (made once, by every rank, on the main thread)."""
        if self.rt.distributed and self._dcp_group is None:
            self._dcp_group = dist.new_group(backend="gloo")
        return self._dcp_group

    def _write_sharded(self, staged: dict[str, Any], rest: _ShardedRest, group: Any,
                       blocked: float) -> SaveResult | None:
        from scaletrain.checkpoint import dcp

        try:
            dcp.save(staged, rest.stage / dcp.DCP_DIR, process_group=group)  # returns once every rank wrote
        except BaseException:
            if self.rt.is_main:
                shutil.rmtree(rest.stage, ignore_errors=True)
            raise
        return self._commit_sharded(rest, blocked) if self.rt.is_main else None

    def _commit_sharded(self, rest: _ShardedRest, blocked: float | None) -> SaveResult:
        """Rank 0, once every rank's shards are written: the param groups, then the common files and the
        manifest. ``blocked`` is None for a synchronous save (the loop waited for all of it)."""
        final, size = self._finish(rest.stage, rest.step, lambda stage: {
            OPTIMIZER_GROUPS: commit.write_bytes(stage / OPTIMIZER_GROUPS, tree.encode(rest.groups))},
            rest.trainer, rest.ranks, rest.meta)
        took = time.perf_counter() - rest.started
        return SaveResult(rest.step, final, size, took if blocked is None else blocked, took, blocked is not None)

    def _finish(self, stage: Path, step: int, write: Callable[[Path], dict[str, commit.FileRecord]],
                trainer: dict[str, Any], ranks: list[Any], meta: dict[str, Any]) -> tuple[Path, int]:
        """What both formats end with: ``write(stage)`` (the format's own files, their records), the trainer
        state and every rank's file, the manifest and the rename, then pruning. A failure removes the stage.
        Returns (the checkpoint, its bytes as the manifest counts them, other ranks' shards included)."""
        try:
            records = write(stage)
            records[TRAINER] = commit.write_bytes(stage / TRAINER, json.dumps(trainer, indent=1).encode())
            for rank, state in enumerate(ranks):
                records[rank_file(rank)] = commit.write_bytes(stage / rank_file(rank), tree.encode(state))
            final = commit.commit(stage, step, records, meta)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        commit.prune(self.root, self.cfg.keep, protect=final)
        return final, sum(r["bytes"] for r in commit.read_manifest(final)["files"].values())

    def _stage(self, prefix: str, obj: Any) -> Any:
        """``obj`` (nested dicts of tensors and DTensors) with every tensor copied into a host buffer kept
        between saves; a DTensor stays a DTensor (same mesh and placements) around its copied local shard."""
        if isinstance(obj, dict):
            return {k: self._stage(f"{prefix}{k}/", v) for k, v in obj.items()}
        if isinstance(obj, DTensor):
            return DTensor.from_local(self._copy_one(prefix, obj.to_local()), obj.device_mesh, obj.placements,
                                      run_check=False, shape=obj.shape, stride=obj.stride())
        if isinstance(obj, torch.Tensor):
            return self._copy_one(prefix, obj)
        return obj

    def _copy_one(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """Copy into a host buffer kept between saves (pinned for a GPU), so a save allocates nothing."""
        pin = self.rt.device.type == "cuda"
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        buf.copy_(t.detach(), non_blocking=pin)
        return buf

    def _write(self, snap: Snapshot, blocked: float, background: bool) -> SaveResult:
        bad = _finite(snap.model) or _finite(snap.optim)  # checked on the copies, off the loop's path
        if bad:
            raise NonFiniteState(f"refusing to checkpoint step {snap.step}: {bad} is not finite; fix: "
                                 "--train.nonfinite=skip, a lower --optim.lr, or --optim.grad_clip=1.0")
        final, size = self._finish(commit.new_stage(self.root, snap.step), snap.step, lambda stage: {
            MODEL: _save_file(stage / MODEL, snap.model, snap.model_meta),
            OPTIMIZER: _save_file(stage / OPTIMIZER, snap.optim, snap.optim_meta)},
            snap.trainer, snap.ranks, snap.meta)
        return SaveResult(snap.step, final, size, blocked, time.perf_counter() - snap.started, background)

    def poll(self) -> list[SaveResult]:
        """Saves committed since the last poll (a failed background save becomes a warning)."""
        if self._pending is not None and self._pending.done():
            self._collect(raise_errors=False)
        done, self.finished = self.finished, []
        return done

    def wait(self) -> None:
        """Block until the save in flight is committed; its failure is raised here."""
        if self._pending is not None:
            self._collect(raise_errors=True)

    def _collect(self, *, raise_errors: bool) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        try:
            result = pending.result()
            if result is not None:
                self.finished.append(result)
        except Exception as err:
            if raise_errors or isinstance(err, NonFiniteState):
                raise
            self.warnings.append(f"checkpoint save failed ({type(err).__name__}: {err}); training goes on and "
                                 "the previous checkpoint stays the latest")

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)


def _save_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> commit.FileRecord:
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)  # streams to disk, GIL released
    commit.fsync_file(path)
    return commit.hash_file(path)


# -- finding and reading ----------------------------------------------------------------------------------

def _choose(cfg: CheckpointConfig, root: Path, warn: Any) -> Resume | None:
    """Rank 0's choice of checkpoint for checkpoint.resume (auto | never | PATH)."""
    if cfg.resume == "never":
        if commit.committed(root):
            latest = commit.committed(root)[-1][1]
            raise ConfigError("checkpoint.resume", "never", f"a run directory without checkpoints ({root} holds "
                              f"{latest.name})", "--checkpoint.resume=auto to continue that run, or a new --run.dir")
        return None
    commit.clean_stale(root)
    if cfg.resume == "auto":
        found = commit.latest_valid(root, warn)
        return Resume(*found) if found else None
    path = Path(cfg.resume)
    if not path.is_dir():
        raise CheckpointError(path, "not a directory", "point --checkpoint.resume at a step-NNNNNNNN directory, "
                              "or use auto")
    if (path / commit.MANIFEST).is_file():
        return Resume(path, commit.verify(path))
    inner = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = commit.latest_valid(inner, warn)
    if found is None:
        raise CheckpointError(path, "holds no complete checkpoint", "point at a step-NNNNNNNN directory")
    return Resume(*found)


def find_resume(cfg: CheckpointConfig, run_dir: Path, rt: Runtime, warn: Any) -> Resume | None:
    """The checkpoint this run continues from, chosen and verified once on rank 0; every rank then checks that
    it sees the same checkpoint (a rank that would load another step is an error, not a drift)."""
    root = run_dir / "checkpoints"
    resume: Resume | None = rank0_decides(rt, lambda: _choose(cfg, root, warn))
    if rt.distributed:
        mine: Any = None
        if resume is not None:
            try:
                mine = commit.read_manifest(resume.path)["step"]
            except CheckpointError as err:
                mine = str(err)
        seen: list[Any] = [None] * rt.world_size
        dist.all_gather_object(seen, mine)
        want = resume.step if resume is not None else None
        odd = [r for r, s in enumerate(seen) if s != want]
        if odd:
            raise CheckpointError(resume.path if resume else root, f"rank {odd[0]} sees {seen[odd[0]]!r} where rank 0 "
                                  f"loads step {want}", "put the run directory on storage every machine shares")
    return resume


def read_model(resume: Resume) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors, meta = tree.load_tensors(resume.read(MODEL), str(resume.path / MODEL))
    try:
        aliases = json.loads(meta.get("aliases", "{}"))
    except json.JSONDecodeError:
        raise CheckpointError(resume.path / MODEL, "its alias table is not JSON", "the file is damaged") from None
    return tensors, aliases


def read_tree(resume: Resume, name: str) -> Any:
    return tree.decode(resume.read(name), str(resume.path / name))[0]


def read_trainer(resume: Resume) -> dict[str, Any]:
    try:
        return json.loads(resume.read(TRAINER))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(resume.path / TRAINER, f"not JSON ({err})", "the file is damaged") from None


def describe_versions() -> dict[str, str]:
    return {"torch": torch.__version__, "scaletrain": __version__}
