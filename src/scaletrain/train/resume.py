"""Continuing a run from a checkpoint: load every part into a freshly built job, and say what changed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from scaletrain.checkpoint import dcp
from scaletrain.config import Config, tomllib
from scaletrain.errors import CheckpointError
from scaletrain.train.checkpointing import (
    FORMAT_DCP,
    FORMAT_FULL,
    OPTIMIZER,
    OPTIMIZER_GROUPS,
    RANK_BUFFERS,
    Resume,
    rank_file,
    read_model,
    read_trainer,
    read_tree,
)
from scaletrain.train.job import Job
from scaletrain.train.state import (
    dedupe,
    keep_implementation,
    load_model_tensors,
    load_optimizer_tree,
    load_scheduler_tree,
    sorted_by_name,
    with_aliases,
)


def restore(job: Job, resume: Resume, skip: set[str] = frozenset()) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load model, optimizer, schedule, scaler, loader position and step into ``job``. Returns the trainer
    state and this rank's own saved state (RNG, running loss) for the loop to restore last; the latter is
    None when the checkpoint has no state for this rank (it was made with fewer ranks)."""
    fmt = resume.meta.get("format", FORMAT_FULL)
    if fmt == FORMAT_DCP:
        _load_dcp(job, resume, skip)
    elif job.sharded:
        _load_full_into_sharded(job, resume, skip)
    else:
        where = str(resume.path)
        if "weights" not in skip:
            tensors, aliases = read_model(resume)
            load_model_tensors(job.module, {k: v.to(job.rt.device) for k, v in tensors.items()}, aliases, where)
        if "optimizer" not in skip:
            load_optimizer_tree(job.module, job.optimizer, read_tree(resume, OPTIMIZER),
                                str(resume.path / OPTIMIZER))
    trainer = read_trainer(resume)
    job.step = int(trainer["step"])
    if "scheduler" not in skip:
        load_scheduler_tree(job.scheduler, job.optimizer, trainer["scheduler"])
    else:
        job.scheduler.last_epoch = job.step  # at least at the right step count, so the run ends where it should
    if trainer.get("scaler") and job.scaler.is_enabled():
        job.scaler.load_state_dict(trainer["scaler"])
    if "data" not in skip:
        job.loader.load_state_dict(trainer["loader"])
    name = rank_file(job.rt.rank)
    if name not in resume.manifest["files"]:
        return trainer, None
    state = read_tree(resume, name)
    if "rng" in skip:
        state.pop("rng", None)
    return trainer, state


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
    metrics.jsonl reads as if it had never stopped. Returns the number of records dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the crash
            dropped += 1
            continue
        if isinstance(record, dict) and int(record.get("step", 0)) > step:
            dropped += 1
            continue
        kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
    return dropped


def _load_dcp(job: Job, resume: Resume, skip: set[str]) -> None:
    """A DCP checkpoint (written by an FSDP run) into this job, sharded or not, at any world size: DCP
    reshards. Every rank reads the shards it needs (the files were verified by rank 0 already)."""
    module, optimizer = job.module, job.optimizer
    model, aliases = dedupe(get_model_state_dict(module))
    optim = get_optimizer_state_dict(module, optimizer)  # materializes the optimizer's state to load into
    state: dict[str, Any] = {}
    if "weights" not in skip:
        state["model"] = model
        state.update(_own_buffers(model, resume, job.rt.rank))  # moved out of model: each is read once
    if "optimizer" not in skip:
        state["optim"] = optim["state"]
    if not state:
        return
    try:
        dcp.load(state, resume.path / dcp.DCP_DIR)
    except (RuntimeError, KeyError, AssertionError) as err:
        raise CheckpointError(resume.path, f"its shards do not fit this model ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:200]})", "resume with the model configuration the "
                              "checkpoint was made with") from None
    if "model" in state:
        own = state.get(RANK_BUFFERS, {}).get(str(job.rt.rank), {})
        set_model_state_dict(module, with_aliases({**state["model"], **own}, aliases))
    if "optim" in state:
        groups = keep_implementation(read_tree(resume, OPTIMIZER_GROUPS), optimizer)
        set_optimizer_state_dict(module, optimizer, {"state": state["optim"], "param_groups": groups})


def _own_buffers(model: dict[str, Any], resume: Resume, rank: int) -> dict[str, Any]:
    """The part of a DCP load that gives rank R back its own copy of the buffers that differed between
    ranks (``rank_buffers.R.*``, taken out of ``model``); rank 0's are the model's own. A rank the checkpoint
    did not have (it was made with fewer ranks) gets rank 0's, as every rank of a new run starts with the
    same ones."""
    names = [name for name in resume.meta.get(RANK_BUFFERS, []) if name in model]
    if not names or not 0 < rank < int(resume.meta["world_size"]):
        return {}
    return {RANK_BUFFERS: {str(rank): {name: model.pop(name) for name in names}}}


def _load_full_into_sharded(job: Job, resume: Resume, skip: set[str]) -> None:
    """A consolidated checkpoint (from a DDP or single-process run) into an FSDP job: every rank reads the
    whole tensors and keeps its shard. torch distributes them one collective per tensor, in the order of the
    dict it is given, so every rank must give the same order: sorted by name (safetensors returns a file's
    tensors in an order that differs from process to process)."""
    options = StateDictOptions(full_state_dict=True)
    if "weights" not in skip:
        set_model_state_dict(job.module, sorted_by_name(with_aliases(*read_model(resume))), options=options)
    if "optimizer" not in skip:
        saved = read_tree(resume, OPTIMIZER)
        saved = {"state": sorted_by_name(saved["state"]),
                 "param_groups": keep_implementation(saved["param_groups"], job.optimizer)}
        set_optimizer_state_dict(job.module, job.optimizer, saved, options=options)
