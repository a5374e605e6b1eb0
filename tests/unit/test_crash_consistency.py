"""Crash consistency: a process SIGKILLed at any moment of a save leaves the latest checkpoint loadable.

A child process saves checkpoints of a ~24 MB state back to back through the real Checkpointer (background
writer thread, keep=2, so deletes of old checkpoints are interrupted too). The parent kills it at 20 moments
spread over one and a half saves. After every kill the newest checkpoint must verify against its manifest
and hold exactly the state of its step, with no warning (no half-written checkpoint is ever visible).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import torch

from scaletrain.checkpoint import commit
from scaletrain.config import CheckpointConfig
from scaletrain.runtime import Runtime
from scaletrain.train.checkpointing import (
    MODEL,
    OPTIMIZER,
    TRAINER,
    Checkpointer,
    Resume,
    read_model,
    read_trainer,
    read_tree,
)

ROUNDS = 20


def _state(step: int) -> tuple[dict, dict]:
    model = {f"layer{i}.weight": torch.full((1024, 1024), float(step)) for i in range(3)}
    optim = {"state": {f"layer{i}.weight": {"exp_avg": torch.full((1024, 1024), step + 0.5)} for i in range(3)},
             "param_groups": [{"params": [f"layer{i}.weight" for i in range(3)], "lr": 0.1}]}
    return model, optim


def _child(run_dir: str, ready: mp.Queue) -> None:
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "none")
    ck = Checkpointer(CheckpointConfig(every=1, keep=2, async_save=True), Path(run_dir), rt)
    done = commit.committed(ck.root)
    step = done[-1][0] + 1 if done else 1
    started = time.perf_counter()
    while True:
        model, optim = _state(step)
        ck.save(step, (model, {}), optim, {"step": step}, {"x": step}, {"format": "full"})
        if step == (done[-1][0] + 1 if done else 1):
            ck.wait()  # the first save of this life is committed: from here on, a kill must leave one
            ready.put(time.perf_counter() - started)
        step += 1


def _check_latest(root: Path) -> int:
    warnings: list[str] = []
    found = commit.latest_valid(root, warnings.append)
    assert not warnings, warnings
    assert found is not None, "no loadable checkpoint"
    path, manifest = found
    resume = Resume(path, manifest)
    step = resume.step
    tensors, _ = read_model(resume)
    assert all(torch.equal(t, torch.full((1024, 1024), float(step))) for t in tensors.values())
    optim = read_tree(resume, OPTIMIZER)
    assert all(torch.equal(s["exp_avg"], torch.full((1024, 1024), step + 0.5)) for s in optim["state"].values())
    assert read_trainer(resume)["step"] == step
    assert {MODEL, OPTIMIZER, TRAINER} <= set(manifest["files"])
    return step


def test_sigkill_at_any_moment_of_a_save_leaves_the_latest_checkpoint_loadable(tmp_path):
    ctx = mp.get_context("spawn")  # not fork: a forked child of a process with OpenMP threads can deadlock
    save_s = None
    steps_seen = []
    for i in range(ROUNDS):
        ready: mp.Queue = ctx.Queue()
        child = ctx.Process(target=_child, args=(str(tmp_path), ready), daemon=True)
        child.start()
        try:
            first = ready.get(timeout=120)
            save_s = save_s or first
            time.sleep(1.5 * save_s * i / ROUNDS)  # moments spread over one and a half saves
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join(timeout=30)
        assert child.exitcode == -signal.SIGKILL
        steps_seen.append(_check_latest(tmp_path / "checkpoints"))
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] >= ROUNDS  # progress survived every kill
    commit.clean_stale(tmp_path / "checkpoints")
    assert len(commit.committed(tmp_path / "checkpoints")) <= 3  # keep=2, plus one committed just before a kill
