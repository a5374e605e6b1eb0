"""Continuing a run from a checkpoint: the checkpoint that fits the model built, the metrics cut back to its
step, DCP and consolidated state into sharded or whole models, and what changed."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.optim import Optimizer

from scaletrain.checkpoint import commit, tree
from scaletrain.config import CheckpointConfig, Config, tomllib
from scaletrain.errors import CheckpointError, DiskFull, is_disk_full
from scaletrain.runtime import rank0_decides
from scaletrain.train.checkpointing import (
    FORMAT_DCP,
    FORMAT_FULL,
    MODEL,
    OPTIMIZER,
    OPTIMIZER_GROUPS,
    RANK_BUFFERS,
    Resume,
    aliases_of,
    check_contents,
    fallback_allowed,
    read_tree,
    resuming_from,
    same_everywhere,
    set_aside,
)
from scaletrain.train.job import Job
from scaletrain.train.state import (
    keep_implementation,
    sorted_by_name,
    stored_once,
    with_aliases,
)

Shape = tuple[int, ...]


def fitting(job: Job, resume: Resume, cfg: CheckpointConfig, warn: Callable[[str], None],
            skip: set[str] = frozenset()) -> Resume:
    """The checkpoint to load into the built ``job``: ``resume`` if its tensors fit the model and optimizer
    (names and shapes, read from headers and the DCP index: nothing is loaded, nothing changes). One that does
    not fit while an older one does is damaged: it is moved aside with a warning and the older one is used.
    When none fits, the model changed: that is the error, and nothing is moved. Rank 0 decides; every rank
    returns the same checkpoint (collective)."""
    chosen: Resume = rank0_decides(job.rt, lambda: _fitting(job, resume, cfg, warn, skip))
    if chosen.path != resume.path:
        same_everywhere(chosen, job.rt, resume.path.parent)
    return chosen


def _fitting(job: Job, resume: Resume, cfg: CheckpointConfig, warn: Callable[[str], None],
             skip: set[str]) -> Resume:
    problem = misfit(job, resume, skip)
    if problem is None:
        return resume
    if not fallback_allowed(cfg):
        raise problem
    bad: list[tuple[Path, CheckpointError]] = [(resume.path, problem)]
    for step, path in reversed(commit.committed(resume.path.parent)):
        if step >= resume.step:
            continue
        try:
            candidate = Resume(path, commit.verify(path))
            check_contents(candidate)
        except CheckpointError as err:
            bad.append((path, err))
            continue
        if (err := misfit(job, candidate, skip)) is not None:
            bad.append((path, err))
            continue
        for line in [set_aside(p, e) for p, e in bad]:  # moved only now: an older one fits this model
            warn(f"{line}; {resuming_from(candidate)}")
        return candidate
    raise problem  # none fits: the model changed, not the checkpoint


def misfit(job: Job, resume: Resume, skip: set[str] = frozenset()) -> CheckpointError | None:
    """Why the checkpoint's tensors do not fit ``job``'s model and optimizer (names and shapes), or None."""
    dcp_format = resume.meta.get("format", FORMAT_FULL) == FORMAT_DCP
    where = resume.path / (f"{_dcp().DCP_DIR}/.metadata" if dcp_format else MODEL)
    try:
        model, state, groups = _saved_dcp(resume) if dcp_format else _saved_full(resume)
    except (TypeError, ValueError, AttributeError, KeyError) as err:  # a tree of an unexpected structure
        return CheckpointError(where, f"an unexpected structure ({type(err).__name__}: {err})",
                               "the file is damaged")
    except CheckpointError as err:
        return err
    problem = None
    if "weights" not in skip:
        want = {k: tuple(v.shape) for k, v in job.module.state_dict().items() if isinstance(v, torch.Tensor)}
        problem = model_misfit(want, model)
    if problem is None and "optimizer" not in skip:
        where = where if dcp_format else resume.path / OPTIMIZER
        problem = _other_optimizer(job, resume) or _optimizer_misfit(job, state, groups)
    if problem is None:
        return None
    return CheckpointError(where, problem, "resume with the model and optimizer configuration the checkpoint "
                           "was made with")


def _saved_full(resume: Resume) -> tuple[dict[str, Shape], dict[tuple[str, str], Shape], list[list[str]]]:
    """(model tensor shapes, aliases included; optimizer state shapes by (parameter, field); the parameter
    names of each param group) of a consolidated checkpoint, from the headers."""
    model = saved_model_shapes(resume)
    optim = tree.outline(resume.path / OPTIMIZER)
    state = {(name, field): tuple(v) for name, fields in optim["state"].items() for field, v in fields.items()
             if isinstance(v, torch.Size)}
    return model, state, [list(g["params"]) for g in optim["param_groups"]]


def _saved_dcp(resume: Resume) -> tuple[dict[str, Shape], dict[tuple[str, str], Shape], list[list[str]]]:
    """The same of a DCP checkpoint, from its index (read by the safe unpickler) and its param groups."""
    tensors = _dcp_shapes(resume)
    model = saved_model_shapes(resume, tensors)
    state = {tuple(k.removeprefix("optim.").rsplit(".", 1)): v for k, v in tensors.items()
             if k.startswith("optim.") and "." in k.removeprefix("optim.")}  # optim.<parameter>.<field>
    groups = [list(g["params"]) for g in read_tree(resume, OPTIMIZER_GROUPS)]
    return model, state, groups  # type: ignore[return-value]


def saved_model_shapes(resume: Resume, dcp_shapes: dict[str, Shape] | None = None) -> dict[str, Shape]:
    """The model tensors' shapes by name (aliases included) of either format, from the safetensors header or
    the DCP index: nothing is loaded."""
    if resume.meta.get("format", FORMAT_FULL) == FORMAT_DCP:
        tensors = dcp_shapes if dcp_shapes is not None else _dcp_shapes(resume)
        model = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
        aliases = dict(resume.meta.get("aliases", {}))
    else:
        model, meta = tree.header_shapes(resume.path / MODEL)
        aliases = aliases_of(meta, resume.path / MODEL)
    return {**model, **{a: model[b] for a, b in aliases.items() if b in model}}


def _dcp() -> Any:
    """scaletrain.checkpoint.dcp, imported where a checkpoint is DCP's: DCP imports DTensor (sharded.py)."""
    from scaletrain.checkpoint import dcp

    return dcp


def _dcp_shapes(resume: Resume) -> dict[str, Shape]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    dcp = _dcp()
    index = dcp.read_index(resume.path / dcp.DCP_DIR).state_dict_metadata  # the safe unpickler's
    return {k: tuple(md.size) for k, md in index.items() if isinstance(md, TensorStorageMetadata)}


def model_misfit(want: dict[str, Shape], have: dict[str, Shape]) -> str | None:
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
        return f"weights do not fit this model (missing {missing[:3]}, unexpected {extra[:3]})"
    wrong = next((name for name in want if want[name] != have[name]), None)
    if wrong is not None:
        return f"{wrong} has shape {have[wrong]} in the checkpoint, {want[wrong]} in this model"
    return None


def _optimizer_misfit(job: Job, state: dict[tuple[str, str], Shape], groups: list[list[str]]) -> str | None:
    params = dict(job.module.named_parameters())
    names = {id(p): name for name, p in params.items()}
    live = [sorted(names[id(p)] for p in g["params"]) for g in job.optimizer.param_groups]
    if [sorted(g) for g in groups] != live:
        sizes = (f"{len(groups)} parameter group{'s' * (len(groups) != 1)} in the checkpoint, {len(live)} here"
                 if len(groups) != len(live) else "the same groups hold other parameters")
        return f"optimizer state does not fit this model's parameter groups ({sizes})"
    for (name, field), shape in state.items():
        if name not in params:
            return f"optimizer state for {name!r}, which this model does not have"
        if shape not in ((), tuple(params[name].shape)):
            return f"optimizer {field} of {name} has shape {shape}, the parameter {tuple(params[name].shape)}"
    return None


def _other_optimizer(job: Job, resume: Resume) -> str | None:
    """The optimizer differs from the checkpoint's (its state then lacks fields this one reads): by class where
    the checkpoint names it, else (older checkpoints) by optim.name."""
    saved = resume.meta.get("optimizers")
    if isinstance(saved, dict) and len(saved) == 1 and len(classes := next(iter(saved.values()))) == 1:
        was, now = classes[0], type(job.optimizer).__name__
        return f"the optimizer state is {was}'s, this run uses {now}" if was != now else None
    try:
        was = tomllib.loads(resume.meta.get("config", ""))["optim"]["name"]
    except (tomllib.TOMLDecodeError, TypeError, KeyError):  # no config, or not one this can read
        return None
    now = job.optim_kind
    return f"the optimizer state is {was}'s, this run uses {now}" if was and was != now else None


def config_changes(saved_toml: str, cfg: Config) -> list[str]:
    """The trajectory settings that differ between the checkpoint's config and this one, as 'key: a -> b'."""
    try:
        old = tomllib.loads(saved_toml)
    except tomllib.TOMLDecodeError:
        return ["(the checkpoint's config could not be read)"]
    now = cfg.trajectory()
    base = Config().trajectory()  # defaults, for keys an older checkpoint did not have
    changes = []
    for section, values in now.items():
        for key, value in values.items():
            was = old.get(section, {}).get(key, base.get(section, {}).get(key))
            if was != value:
                changes.append(f"{section}.{key}: {was!r} -> {value!r}")
    return changes


def truncate_metrics(path: Path, step: int) -> int:
    """Drop the records a crashed attempt wrote after the checkpoint's step, so that the resumed run's
    metrics.jsonl reads as if it had never stopped. Returns the number of records dropped.

    A resume must work on a full disk, so this writes nothing it need not: nothing when nothing is dropped,
    a truncation in place when only a tail is (the usual case). Otherwise the kept records go to a new file
    renamed into place, or, when the disk has no room for that, over the old ones (fewer bytes than were
    there: no new blocks)."""
    if not path.is_file():
        return 0
    lines = path.read_bytes().splitlines(keepends=True)
    kept = [line if line.endswith(b"\n") else line + b"\n" for line in lines if _kept(line, step)]
    if kept == lines[: len(kept)]:  # a prefix, unchanged
        if len(kept) < len(lines):
            os.truncate(path, sum(len(line) for line in kept))
        return len(lines) - len(kept)
    text = b"".join(kept)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(text)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if not is_disk_full(err):
            raise
        _overwrite(path, text)
    return len(lines) - len(kept)


def _kept(line: bytes, step: int) -> bool:
    """Whether a line of metrics.jsonl stays: a whole record of a step at or before ``step``."""
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):  # a line cut short by the crash
        return False
    return not (isinstance(record, dict) and int(record.get("step", 0)) > step)


def _overwrite(path: Path, text: bytes) -> None:
    """Write ``text`` over the start of ``path`` and cut the rest: in place, for a disk without room for a copy."""
    try:
        with open(path, "r+b") as f:
            f.write(text)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        if not is_disk_full(err):
            raise
        raise DiskFull.at(path, len(text), err=err) from None


def load_dcp(module: torch.nn.Module, optimizers: Optimizer | list[Optimizer], resume: Resume, rank: int,
             skip: set[str] = frozenset(), groups: list[dict[str, Any]] | None = None) -> None:
    """A DCP checkpoint (written by an FSDP run or a sharded session) into ``module`` and its optimizers,
    sharded or not, at any world size: DCP reshards, and reads only the keys the module has (a session loads
    one model of several). Every rank reads the shards it needs (the files were verified by rank 0 already).
    ``groups``: the saved param groups of these optimizers, in order (default: all the checkpoint's)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    dcp = _dcp()
    # a tied weight under tensor parallelism is one DTensor the state dict lists twice as separate objects:
    # read once, under the name it is stored by (a pipeline's checkpoint holds it under the embedding's only)
    model, aliases = stored_once(module, get_model_state_dict(module), sharded=True)
    optim = get_optimizer_state_dict(module, optimizers)  # materializes the optimizer's state to load into
    # A pipeline stage's copy of a weight (GPT's head on the last stage) is read from the name it is stored under
    copies = getattr(module, "tied_aliases", {})
    model = _renamed(model, copies)
    optim = {**optim, "state": _renamed(optim["state"], copies)}
    state: dict[str, Any] = {}
    if "weights" not in skip:
        state["model"] = model
        state.update(own_buffers(model, resume, rank))  # moved out of model: each is read once
        state["model"] = dcp.addressable(state["model"])
    if "optimizer" not in skip:
        state["optim"] = dcp.addressable(optim["state"])
    if not state:
        return
    try:
        dcp.load(state, resume.path / dcp.DCP_DIR)
    except (RuntimeError, KeyError, AssertionError, CheckpointException) as err:  # the last: every rank's
        raise dcp_failure(err, resume) from None
    back = getattr(module, "held_as", {})
    if "model" in state:
        own = state.get(RANK_BUFFERS, {}).get(str(rank), {})
        loaded = _renamed(dcp.placed_like(state["model"], model), back)
        set_model_state_dict(module, with_aliases({**loaded, **own}, aliases))
    if "optim" in state:
        saved = read_tree(resume, OPTIMIZER_GROUPS) if groups is None else groups
        loaded = _renamed(dcp.placed_like(state["optim"], optim["state"]), back)
        set_optimizer_state_dict(module, optimizers, {"state": loaded,
                                                      "param_groups": keep_implementation(saved, optimizers)})


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``state`` with the keys in ``names`` renamed (the order kept)."""
    return {names.get(k, k): v for k, v in state.items()} if names else state


def dcp_failure(err: BaseException, resume: Resume) -> CheckpointError:
    """One line for a failed DCP load (a CheckpointException holds every rank's failure and traceback)."""
    dcp = _dcp()
    for failure in dcp.rank_errors(err):
        if isinstance(failure, CheckpointError):
            return failure
    return CheckpointError(resume.path, f"its shards did not load ({dcp.said(dcp.first_failure(err))})",
                           "resume with the model configuration the checkpoint was made with, or from another "
                           "one")


def own_buffers(model: dict[str, Any], resume: Resume, rank: int) -> dict[str, Any]:
    """The part of a DCP load that gives rank R back its own copy of the buffers that differed between
    ranks (``rank_buffers.R.*``, taken out of ``model``); rank 0's are the model's own. A rank the checkpoint
    did not have (it was made with fewer ranks) gets rank 0's, as every rank of a new run starts with the
    same ones."""
    names = [name for name in resume.meta.get(RANK_BUFFERS, []) if name in model]
    if not names or not 0 < rank < int(resume.meta["world_size"]):
        return {}
    return {RANK_BUFFERS: {str(rank): {name: model.pop(name) for name in names}}}


def load_full_into_sharded(module: torch.nn.Module, optimizers: Optimizer | list[Optimizer],
                           tensors: dict[str, torch.Tensor] | None, tree: dict[str, Any] | None) -> None:
    """Whole tensors and an optimizer tree (from a consolidated checkpoint: a DDP or one-process run) into a
    sharded module: every rank reads the whole tensors and keeps its shard; None leaves that part as it is.
    torch distributes them one collective per tensor, in the order of the dict it is given, so every rank
    must give the same order: sorted by name (safetensors returns a file's tensors in an order that differs
    from process to process)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    if tensors is not None:
        set_model_state_dict(module, sorted_by_name(tensors), options=options)
    if tree is not None:
        saved = {"state": sorted_by_name(tree["state"]),
                 "param_groups": keep_implementation(tree["param_groups"], optimizers)}
        set_optimizer_state_dict(module, optimizers, saved, options=options)
