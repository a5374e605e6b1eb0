"""Checkpointing a training job: what goes in, writing it without stalling the loop, and finding where to resume.

Layout of ``RUN_DIR/checkpoints/step-NNNNNNNN/`` (the consolidated format, for DDP and single-process runs;
everything is safetensors or JSON, so loading never unpickles anything):

    model.safetensors          the bare model's weights by name (tied weights once; aliases in its metadata)
    optimizer.safetensors      the optimizer state by parameter name (checkpoint/tree.py)
    trainer.json               step, loader position (global sample cursor), LR schedule, grad scaler
    tracked.safetensors        a session's tracked objects (st.track), where their states hold tensors (an EMA)
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

A full disk: before each save rank 0 compares the bytes it will write with the bytes free; if they do not fit,
retention deletes first the old checkpoints it would delete after the save (never the newest valid one), and
if even that is not enough a warning says so ahead. A periodic save that fails (a full disk or anything else)
leaves no stage behind, becomes a warning that names what stays the latest checkpoint, and training goes on;
``failed`` keeps why, so that the end of the run can say that its last checkpoint was not saved. A final
save (a stop) that fails raises: DiskFull, one line, for a full disk.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist

from scaletrain import __version__
from scaletrain.checkpoint import commit, tree
from scaletrain.config import CheckpointConfig
from scaletrain.errors import CheckpointError, ConfigError, DiskFull, TrainingFailed, is_disk_full
from scaletrain.runtime import Runtime, rank0_decides
from scaletrain.sharded import is_dtensor, local_shard
from scaletrain.train.state import differing, plain_digests, stored_once, tied

FORMAT_FULL, FORMAT_DCP = "full", "dcp"
MODEL, OPTIMIZER, TRAINER = "model.safetensors", "optimizer.safetensors", "trainer.json"
TRACKED = "tracked.safetensors"  # the trainer's "tracked" states, as a tree: they may hold tensors (an EMA's)
OPTIMIZER_GROUPS = "optimizer-groups.safetensors"  # dcp format: the param groups (the shards hold tensors only)
RANK_BUFFERS = "rank_buffers"  # dcp format: each rank's own buffers (their names in the manifest's meta)
# dcp format: {alias: name} of tied weights, which DCP's shards hold once per name (a gathered state dict
# cannot tell them apart): checkpoint export stores each once, as the consolidated format does
TIED = "tied"


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
    needed: int  # bytes, every rank's shards (estimated)


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
    needed: int = 0  # bytes the save will write


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


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


GROUPS, ALIASES = "param_group_names", "aliases"  # gathered with the rank states, not saved in them


def _merged_groups(groups: list[dict[str, Any]], names: list[list[list[str]]]) -> list[dict[str, Any]]:
    """This rank's optimizer param groups with every rank's parameter names (``names``: per rank, per group):
    under FSDP every rank names them all; a pipeline stage names its own, and the checkpoint holds them all,
    in stage order, so that any layout finds its parameters (train/session.py restricts them on load)."""
    return [{**g, "params": list(dict.fromkeys(n for per_rank in names if i < len(per_rank) for n in per_rank[i]))}
            for i, g in enumerate(groups)]


def _rank_buffers(model: dict[str, torch.Tensor], ranks: list[Any],
                  rank: int) -> tuple[list[str], dict[str, Any]]:
    """(the names of the buffers that differ between ranks, what this rank saves of them). Every rank's
    digests came in ``ranks`` (and are taken out of what goes to the rank files). DCP writes rank 0's copy of
    a buffer under ``model.``; every other rank writes its own under ``rank_buffers.R.``, so that a rank gets
    back exactly what it saved (train/resume.py)."""
    own = differing([state.pop(RANK_BUFFERS) for state in ranks])
    if not own or rank == 0:
        return own, {}
    return own, {RANK_BUFFERS: {str(rank): {name: model[name] for name in own if name in model}}}


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
        self.failed: Exception | None = None  # why the latest save did not commit; None once one does
        self.last_step = -1  # the last step saved or being saved
        # rank 0: the checkpoint keep_best() named and its record, until it is committed and best.json names it
        self._best: tuple[int, dict[str, float]] | None = None
        self._best_lock = threading.Lock()  # the loop's keep_best() and the checkpoint thread's commits

    def due(self, step: int, total: int) -> bool:
        every = self.cfg.every
        return every > 0 and step != self.last_step and (step % every == 0 or step == total)

    def latest(self) -> Path | None:
        """The newest checkpoint of this run directory; None before the first."""
        done = commit.committed(self.root)
        return done[-1][1] if done else None

    def unchanged(self) -> str:
        """What a write that failed leaves to resume from, in words."""
        latest = self.latest()
        return f"{latest} stays the latest checkpoint" if latest else "no checkpoint saved yet"

    def keep_best(self, step: int, record: dict[str, float]) -> None:
        """Name the checkpoint of ``step`` (saved, or being saved) the best: best.json names it once it is
        committed, and from then on pruning spares it (and no longer the best before it)."""
        if self.rt.is_main:
            with self._best_lock:
                self._best = (step, record)
            if self._name_best():
                commit.prune(self.root, self.cfg.keep)  # the best before it, unless it is among the newest

    def _name_best(self) -> bool:
        """best.json, when the checkpoint keep_best() named is committed (else it is written at its commit, whose
        pruning follows); True when written."""
        with self._best_lock:
            if self._best is None or not (self.root / commit.step_name(self._best[0]) / commit.MANIFEST).is_file():
                return False
            (step, record), self._best = self._best, None
            try:
                commit.write_best(self.root, step, record)
            except OSError as err:
                self.warnings.append(f"{self.root / commit.BEST} not written ({err.strerror or err}): the "
                                     f"checkpoint of step {step} is not kept as the best")
                return False
        return True

    # -- saving -------------------------------------------------------------------------------------------

    def save(self, step: int, model: tuple[dict[str, torch.Tensor], dict[str, str]], optim: dict[str, Any],
             trainer: dict[str, Any], rank_state: dict[str, Any], meta: dict[str, Any], *,
             background: bool = True) -> float:
        """Save the state of ``step`` (every rank calls this). Returns the seconds the loop was blocked.
        ``background``: a periodic save, whose failure is a warning (written on the checkpoint thread with
        ``checkpoint.async_save``); otherwise it is the final one, written now, and its failure is raised."""
        started = time.perf_counter()
        ranks: list[Any] = [None] * self.rt.world_size
        if self.rt.distributed:
            dist.gather_object(rank_state, ranks if self.rt.is_main else None, dst=0)
        else:
            ranks = [rank_state]
        self.last_step = step
        if not self.rt.is_main:
            return time.perf_counter() - started
        self._settle()  # the buffers are reused: the previous write must be done with them
        tensors, aliases = model
        optim_tensors, optim_meta = tree.split(optim)
        needed = self._make_room(step, _nbytes(tensors) + _nbytes(optim_tensors))
        snap = Snapshot(step, self._stage("model/", tensors), {"aliases": json.dumps(aliases)},
                        self._stage("optim/", optim_tensors), optim_meta, trainer, ranks, meta, started, needed)
        if self.rt.device.type == "cuda":
            torch.cuda.current_stream(self.rt.device).synchronize()  # the copies above were non-blocking
        blocked = time.perf_counter() - started
        if self._pool is not None and background:
            self._pending = self._pool.submit(self._write, snap, blocked, True)
        else:
            self._now(lambda: self._write(snap, blocked, False), periodic=background)
        return blocked

    def save_sharded(self, step: int, module: torch.nn.Module,
                     optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
                     trainer: dict[str, Any], rank_state: dict[str, Any], meta: dict[str, Any], *,
                     background: bool = True) -> float:
        """Save a sharded (FSDP) job through DCP: every rank writes its shards into the staging directory,
        which must be on storage all ranks share; rank 0 then writes the rest and commits. With
        ``checkpoint.async_save`` (and ``background``) the loop is blocked only while every rank copies its
        shards into host buffers kept between saves; DCP then writes them on each rank's checkpoint thread,
        its collectives on a Gloo group of their own, and rank 0's thread commits. Returns the seconds the
        loop was blocked. ``optimizer`` may be several (a session's models in one container module): their
        state is keyed by the container's parameter names and their param groups are saved in order."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from scaletrain.checkpoint import dcp

        started = time.perf_counter()
        self._settle()
        model, aliases = stored_once(module, get_model_state_dict(module), sharded=True)  # a tied DTensor: once
        optim = get_optimizer_state_dict(module, optimizer)
        copies = getattr(module, "tied_aliases", {})  # a pipeline stage's copy of a weight: stored once, by its owner
        for name, kept in copies.items():
            model.pop(name, None)
            optim["state"].pop(name, None)
            aliases[name] = kept
        optim["param_groups"] = [{**g, "params": [n for n in g["params"] if n not in copies]}
                                 for g in optim["param_groups"]]
        local = {**{f"model.{k}": local_shard(v) for k, v in model.items()},
                 **{f"optim.{k}": local_shard(v) for k, v in tree.split(optim["state"])[0].items()}}
        needed = _nbytes(local) * self.rt.world_size  # every rank's shards, about
        if self.rt.is_main:
            needed = self._make_room(step, needed)
            with self._cleaning(None, step, needed):
                where: list[Any] = [str(commit.new_stage(self.root, step))]
        else:
            where = [None]
        if self.rt.distributed:
            dist.broadcast_object_list(where, src=0)
        stage = Path(where[0])
        params = {name for name, _ in module.named_parameters()}  # buffers are what may differ between ranks
        mine = {**rank_state, "nonfinite": _finite(local) or "",
                RANK_BUFFERS: plain_digests({k: v for k, v in model.items() if k not in params}),
                GROUPS: [g["params"] for g in optim["param_groups"]], ALIASES: aliases}
        ranks: list[Any] = [mine]
        if self.rt.distributed:  # every rank learns of a non-finite shard anywhere, and then none writes
            ranks = [None] * self.rt.world_size
            dist.all_gather_object(ranks, mine)
        groups = _merged_groups(optim["param_groups"], [state.pop(GROUPS) for state in ranks])
        aliases = {k: v for state in ranks for k, v in state.pop(ALIASES).items()}  # every stage's
        self.last_step = step
        bad = next((f"rank {r}: {state['nonfinite']}" for r, state in enumerate(ranks) if state["nonfinite"]), "")
        if bad:
            if self.rt.is_main:
                shutil.rmtree(stage, ignore_errors=True)
            raise NonFiniteState(f"refusing to checkpoint step {step}: {bad} is not finite; fix: "
                                 "--train.nonfinite=skip, a lower --optim.lr, or --optim.grad_clip=1.0")
        own, mine_only = _rank_buffers(model, ranks, self.rt.rank)
        rest = _ShardedRest(step, stage, groups, trainer, ranks,
                            {**meta, "aliases": aliases, RANK_BUFFERS: own, TIED: tied(module)}, started, needed)
        state = {"model": dcp.addressable(model), "optim": dcp.addressable(optim["state"]), **mine_only}
        if self._pool is not None and background:
            staged = self._stage("dcp/", state)
            if self.rt.device.type == "cuda":
                torch.cuda.current_stream(self.rt.device).synchronize()  # the copies were non-blocking
            group = self._cpu_group()
            blocked = time.perf_counter() - started
            self._pending = self._pool.submit(self._write_sharded, staged, rest, group, blocked)
            return blocked

        def write_now() -> SaveResult | None:
            with self._cleaning(stage, step, needed):
                dcp.save(state, stage / dcp.DCP_DIR)
            return self._commit_sharded(rest, None) if self.rt.is_main else None

        self._now(write_now, periodic=background)
        return time.perf_counter() - started

    def _cpu_group(self) -> Any:
        """A Gloo group for the collectives of DCP saves on the checkpoint thread, apart from the loop's
        (made once, by every rank, on the main thread)."""
        if self.rt.distributed and self._dcp_group is None:
            self._dcp_group = dist.new_group(backend="gloo")
        return self._dcp_group

    def _make_room(self, step: int, tensor_bytes: int) -> int:
        """Rank 0, before saving ``step``: the bytes the save will write (its tensors', or the newest
        checkpoint's size if that is more: headers and per-rank files count too). When they do not fit,
        retention deletes now what it would delete after the save; when even that is not enough, a warning
        says so ahead. Returns those bytes."""
        latest = self.latest()
        needed = max(tensor_bytes, commit.size_of(latest) if latest else 0)
        deleted, free = commit.make_room(self.root, needed, self.cfg.keep)
        if deleted:
            self.warnings.append(f"{self.root} is short of space for step {step} ({needed:,} bytes): deleted "
                                 f"{', '.join(p.name for p in deleted)} before the save rather than after it "
                                 f"(checkpoint.keep = {self.cfg.keep})")
        if free < needed:
            self.warnings.append(f"disk nearly full: {self.root.parent} has {free:,} bytes free and the checkpoint "
                                 f"of step {step} needs {needed:,}; the save will likely fail and {self.unchanged()}; "
                                 "fix: free space on that disk, a lower --checkpoint.keep, or a --run.dir on a "
                                 "larger one")
        return needed

    @contextmanager
    def _cleaning(self, stage: Path | None, step: int, needed: int) -> Iterator[None]:
        """A save that fails leaves no stage behind (rank 0 removes it), and a full disk is said as DiskFull:
        the checkpoint, the bytes it needed, the bytes free, what stays the latest."""
        try:
            yield
        except BaseException as err:
            if stage is not None and self.rt.is_main:
                shutil.rmtree(stage, ignore_errors=True)
            # not only Exceptions: DCP's CheckpointException, which wraps each rank's error, is a BaseException
            if not isinstance(err, (DiskFull, KeyboardInterrupt, SystemExit)) and is_disk_full(err):
                raise DiskFull.at(self.root / commit.step_name(step), needed, self.unchanged(), err) from None
            if not isinstance(err, (Exception, KeyboardInterrupt, SystemExit, GeneratorExit)):
                from scaletrain.checkpoint import dcp  # DCP's CheckpointException: an error like any other

                raise TrainingFailed(f"DCP could not save {self.root / commit.step_name(step)} "
                                     f"({dcp.said(dcp.first_failure(err))})") from None
            raise

    def _write_sharded(self, staged: dict[str, Any], rest: _ShardedRest, group: Any,
                       blocked: float) -> SaveResult | None:
        from scaletrain.checkpoint import dcp

        with self._cleaning(rest.stage, rest.step, rest.needed):
            dcp.save(staged, rest.stage / dcp.DCP_DIR, process_group=group)  # returns once every rank wrote
        return self._commit_sharded(rest, blocked) if self.rt.is_main else None

    def _commit_sharded(self, rest: _ShardedRest, blocked: float | None) -> SaveResult:
        """Rank 0, once every rank's shards are written: the param groups, then the common files and the
        manifest. ``blocked`` is None for a synchronous save (the loop waited for all of it)."""
        final, size = self._finish(rest.stage, rest.step, rest.needed, lambda stage: {
            OPTIMIZER_GROUPS: commit.write_bytes(stage / OPTIMIZER_GROUPS, tree.encode(rest.groups))},
            rest.trainer, rest.ranks, rest.meta)
        took = time.perf_counter() - rest.started
        return SaveResult(rest.step, final, size, took if blocked is None else blocked, took, blocked is not None)

    def _finish(self, stage: Path, step: int, needed: int, write: Callable[[Path], dict[str, commit.FileRecord]],
                trainer: dict[str, Any], ranks: list[Any], meta: dict[str, Any]) -> tuple[Path, int]:
        """What both formats end with: ``write(stage)`` (the format's own files, their records), the trainer
        state and every rank's file, the manifest and the rename, then pruning. A failure removes the stage.
        Returns (the checkpoint, its bytes as the manifest counts them, other ranks' shards included)."""
        with self._cleaning(stage, step, needed):
            records = write(stage)
            tracked = trainer.get("tracked")
            if tracked and tree.split(tracked)[0]:  # st.track()'s states holding tensors (an EMA's weights): not
                trainer = {k: v for k, v in trainer.items() if k != "tracked"}  # JSON; the rest stays in trainer.json
                records[TRACKED] = commit.write_bytes(stage / TRACKED, tree.encode(tracked))
            records[TRAINER] = commit.write_bytes(stage / TRAINER, json.dumps(trainer, indent=1).encode())
            for rank, state in enumerate(ranks):
                records[rank_file(rank)] = commit.write_bytes(stage / rank_file(rank), tree.encode(state))
            final = commit.commit(stage, step, records, meta)
        self._name_best()
        commit.prune(self.root, self.cfg.keep, protect=final)
        return final, sum(r["bytes"] for r in commit.read_manifest(final)["files"].values())

    def _stage(self, prefix: str, obj: Any) -> Any:
        """``obj`` (nested dicts of tensors and DTensors) with every tensor copied into a host buffer kept
        between saves; a DTensor stays a DTensor (same mesh and placements) around its copied local shard."""
        if isinstance(obj, dict):
            return {k: self._stage(f"{prefix}{k}/", v) for k, v in obj.items()}
        if is_dtensor(obj):
            return type(obj).from_local(self._copy_one(prefix, obj.to_local()), obj.device_mesh, obj.placements,
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
        with self._cleaning(None, snap.step, snap.needed):
            stage = commit.new_stage(self.root, snap.step)
        final, size = self._finish(stage, snap.step, snap.needed, lambda stage: {
            MODEL: _save_file(stage / MODEL, snap.model, snap.model_meta),
            OPTIMIZER: _save_file(stage / OPTIMIZER, snap.optim, snap.optim_meta)},
            snap.trainer, snap.ranks, snap.meta)
        return SaveResult(snap.step, final, size, blocked, time.perf_counter() - snap.started, background)

    def _now(self, write: Callable[[], SaveResult | None], *, periodic: bool) -> None:
        """A save written on the calling thread. A periodic one that fails is a warning, as a background
        save's failure is; the final one's failure is raised."""
        try:
            result = write()
        except Exception as err:
            if not periodic or isinstance(err, NonFiniteState):
                raise
            self._lost(err)
            return
        self._committed(result)

    def poll(self) -> list[SaveResult]:
        """Saves committed since the last poll (a failed background save becomes a warning)."""
        if self._pending is not None and self._pending.done():
            self._settle()
        done, self.finished = self.finished, []
        return done

    def report(self, writer: Any, say: Callable[[str], None]) -> list[SaveResult]:
        """The saves finished since the last call (poll), each a ``checkpoint`` record in metrics.jsonl, and
        the warnings gathered since, each said as a line. Returns the saves."""
        done = self.poll()
        for result in done:
            writer.write({"kind": "checkpoint", "step": result.step, "path": str(result.path), "bytes": result.bytes,
                          "blocked_s": result.blocked_s, "save_s": result.save_s, "async": result.background})
        for warning in self.warnings:
            say(f"warning: {warning}")
        self.warnings.clear()
        return done

    def wait(self) -> None:
        """Block until the save in flight is committed; its failure is raised here."""
        if self._pending is not None:
            self._collect(raise_errors=True)

    def _settle(self) -> None:
        """Block until the save in flight is done; its failure becomes a warning (a NaN refusal is raised)."""
        if self._pending is not None:
            self._collect(raise_errors=False)

    def _collect(self, *, raise_errors: bool) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        try:
            result = pending.result()
        except Exception as err:
            if raise_errors or isinstance(err, NonFiniteState):
                self.failed = err
                raise
            self._lost(err)
            return
        self._committed(result)

    def _committed(self, result: SaveResult | None) -> None:
        if result is not None:  # None: another rank's part of a sharded save, which rank 0 commits
            self.finished.append(result)
            self.failed = None

    def _lost(self, err: Exception) -> None:
        """A periodic save that failed: said as a warning, with the checkpoint that stays the latest."""
        self.failed = err
        if isinstance(err, DiskFull):
            self.warnings.append(f"checkpoint not saved: {err}")
        else:
            self.warnings.append(f"checkpoint save failed ({type(err).__name__}: {err}); {self.unchanged()}")

    def close(self) -> None:
        """Wait for the save in flight (its failure becomes a warning and ``failed``, as in ``poll``), then
        stop the checkpoint thread."""
        try:
            self._settle()
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
        return latest_usable(root, warn)
    path = Path(cfg.resume)
    if not path.is_dir():
        raise CheckpointError(path, "not a directory", "point --checkpoint.resume at a step-NNNNNNNN directory, "
                              "or use auto")
    if (path / commit.MANIFEST).is_file():
        resume = Resume(path, commit.verify(path))
        check_contents(resume)
        return resume
    inner = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found = latest_usable(inner, warn, fresh=False)
    if found is None:
        raise CheckpointError(path, "holds no complete checkpoint", "point at a step-NNNNNNNN directory")
    return found


def fallback_allowed(cfg: CheckpointConfig) -> bool:
    """Whether a damaged checkpoint may be replaced by an older one: not when checkpoint.resume names it."""
    return cfg.resume == "auto" or not (Path(cfg.resume) / commit.MANIFEST).is_file()


def set_aside(path: Path, err: CheckpointError) -> str:
    """Move a damaged checkpoint out of the step-* namespace; returns what the warning says about it."""
    aside = commit.set_aside(path)
    return f"{err.args[0].split('; fix:')[0]}; moved aside to {aside.name}"


def resuming_from(found: Resume | None, fresh: bool = True) -> str:
    if found is not None:
        return f"resuming from {found.path.name}"
    return "no usable checkpoint is left" + (": training starts at step 0" if fresh else "")


def latest_usable(root: Path, warn: Callable[[str], None], *, fresh: bool = True) -> Resume | None:
    """The newest checkpoint whose files match the manifest and whose contents read (check_contents). Newer
    ones that fail are moved aside, each with one warning naming the file, the reason and what is used
    instead (``fresh``: a start from step 0 when none is left)."""
    had = bool(commit.committed(root))
    said: list[str] = []
    found: Resume | None = None
    while found is None and (valid := commit.latest_valid(root, warn)) is not None:
        candidate = Resume(*valid)
        try:
            check_contents(candidate)
            found = candidate
        except CheckpointError as err:
            said.append(set_aside(candidate.path, err))
    for line in said:
        warn(f"{line}; {resuming_from(found, fresh)}")
    if found is None and had and not said and fresh:  # every one failed its hashes (latest_valid said which)
        warn(f"{root}: {resuming_from(None)}")
    return found


def find_resume(cfg: CheckpointConfig, run_dir: Path, rt: Runtime, warn: Any) -> Resume | None:
    """The checkpoint this run continues from, chosen and verified once on rank 0; every rank then checks that
    it sees the same checkpoint (a rank that would load another step is an error, not a drift)."""
    root = run_dir / "checkpoints"
    resume: Resume | None = rank0_decides(rt, lambda: _choose(cfg, root, warn))
    same_everywhere(resume, rt, root)
    return resume


def same_everywhere(resume: Resume | None, rt: Runtime, root: Path) -> None:
    """Every rank reads the manifest of the checkpoint rank 0 chose and finds the same step (collective)."""
    if not rt.distributed:
        return
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
        raise CheckpointError(resume.path if resume else root, f"rank {odd[0]} sees {seen[odd[0]]!r} where "
                              f"rank 0 loads step {want}", "put the run directory on storage every machine "
                              "shares")


def read_model(resume: Resume) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    tensors, meta = tree.load_tensors(resume.read(MODEL), str(resume.path / MODEL))
    return tensors, aliases_of(meta, resume.path / MODEL)


def aliases_of(meta: dict[str, str], where: Path) -> dict[str, str]:
    try:
        aliases = json.loads(meta.get("aliases", "{}"))
    except json.JSONDecodeError:
        aliases = None
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise CheckpointError(where, "its alias table is not a JSON object of names", "the file is damaged")
    return aliases


def read_tree(resume: Resume, name: str) -> Any:
    return tree.decode(resume.read(name), str(resume.path / name))[0]


def read_trainer(resume: Resume) -> dict[str, Any]:
    """trainer.json, with a session's tracked states (tracked.safetensors) under "tracked"."""
    try:
        trainer = json.loads(resume.read(TRAINER))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(resume.path / TRAINER, f"not JSON ({err})", "the file is damaged") from None
    if isinstance(trainer, dict) and TRACKED in resume.manifest["files"]:
        trainer["tracked"] = read_tree(resume, TRACKED)
    return trainer


def _require(where: Path, obj: Any, keys: dict[str, type]) -> None:
    """``obj`` is a dict holding each key with a value of its type: what loading indexes without a check."""
    if not isinstance(obj, dict):
        raise CheckpointError(where, f"holds a {type(obj).__name__} where a JSON object belongs",
                              "the file is damaged")
    for key, kind in keys.items():
        if not isinstance(obj.get(key), kind) or isinstance(obj.get(key), bool):
            raise CheckpointError(where, f"{key!r} is {obj.get(key)!r}, not a {kind.__name__}",
                                  "the file is damaged")


def check_contents(resume: Resume) -> None:
    """Read every file of a checkpoint (verified against its manifest already) as loading will, without
    loading a tensor: the DCP index (through the safe unpickler), the safetensors headers, the small trees and
    the trainer state. Files can match a manifest and still not load (an index planted with its manifest
    rewritten to match, a file damaged before the save hashed it); the CheckpointError names the file."""
    from scaletrain.checkpoint import dcp

    meta = resume.manifest.get("meta")
    session = isinstance(meta, dict) and bool(meta.get("session"))
    _require(resume.path / commit.MANIFEST, meta, {} if session else
             {"world_size": int, "global_batch": int, "step": int, "loader": dict})
    sharded = resume.meta.get("format", FORMAT_FULL) == FORMAT_DCP
    for name in [f"{dcp.DCP_DIR}/.metadata"] if sharded else [MODEL, OPTIMIZER]:  # read below unhashed
        if name not in resume.manifest["files"]:
            raise CheckpointError(resume.path / name, "not listed in the manifest", "the checkpoint is incomplete "
                                  "or altered")
    if sharded:
        dcp.read_index(resume.path / dcp.DCP_DIR)
        read_tree(resume, OPTIMIZER_GROUPS)
    else:
        _, model_meta = tree.header_shapes(resume.path / MODEL)
        aliases_of(model_meta, resume.path / MODEL)
        tree.outline(resume.path / OPTIMIZER)
    _require(resume.path / TRAINER, read_trainer(resume), {"step": int} if session else
             {"step": int, "loader": dict, "scheduler": dict})
    for name in resume.manifest["files"]:
        if name.startswith("rank-") and name.endswith(".safetensors"):
            read_tree(resume, name)


def describe_versions() -> dict[str, str]:
    return {"torch": torch.__version__, "scaletrain": __version__}
