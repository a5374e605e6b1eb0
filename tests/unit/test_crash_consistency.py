"""Crash consistency: a process SIGKILLed at any moment of a save leaves the latest checkpoint loadable.

A child process saves checkpoints of a ~24 MB state back to back through the real Checkpointer (background
writer thread, keep=2, so deletes of old checkpoints are interrupted too). The parent kills it at 20 moments
spread over one and a half saves. After every kill the newest checkpoint must verify against its manifest
and hold exactly the state of its step, with no warning (no half-written checkpoint is ever visible).

The children are forked from one "zygote" process that imported torch but never ran a parallel op (forking
the test process itself can deadlock in OpenMP): 20 children without 20 interpreter start-ups.
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


def _save_forever(run_dir: str, ready_w: int) -> None:
    """The forked child: continue the run's checkpoints; say when this life's first save is committed."""
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "none")
    ck = Checkpointer(CheckpointConfig(every=1, keep=2, async_save=True), Path(run_dir), rt)
    done = commit.committed(ck.root)
    step = first = done[-1][0] + 1 if done else 1
    started = time.perf_counter()
    while True:
        model, optim = _state(step)
        ck.save(step, (model, {}), optim, {"step": step}, {"x": step}, {"format": "full"})
        if step == first:
            ck.wait()  # from here on, a kill must leave a checkpoint
            os.write(ready_w, f"{time.perf_counter() - started}\n".encode())
        step += 1


def _zygote(run_dir: str, conn: mp.connection.Connection) -> None:
    """Fork one saving child per request; send back its pid and the seconds its first save took."""
    while conn.recv() == "fork":
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            os.close(ready_r)
            try:
                _save_forever(run_dir, ready_w)
            finally:
                os._exit(1)
        os.close(ready_w)
        with os.fdopen(ready_r) as ready:
            first = float(ready.readline() or "nan")
        conn.send((pid, first))
        conn.recv()  # the parent killed it: reap it, then say so (the checks must see a dead writer)
        os.waitpid(pid, 0)
        conn.send("reaped")


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
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    zygote = ctx.Process(target=_zygote, args=(str(tmp_path), child_end), daemon=True)
    zygote.start()
    steps_seen = []
    save_s = None
    try:
        for i in range(ROUNDS):
            parent.send("fork")
            assert parent.poll(120), "no saving child came up"
            pid, first = parent.recv()
            save_s = save_s or first
            time.sleep(1.5 * save_s * i / ROUNDS)  # moments spread over one and a half saves
            os.kill(pid, signal.SIGKILL)
            parent.send("reap")
            assert parent.recv() == "reaped"
            steps_seen.append(_check_latest(tmp_path / "checkpoints"))
        parent.send("stop")
    finally:
        zygote.join(timeout=30)
        if zygote.is_alive():
            zygote.kill()
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] >= ROUNDS  # progress survived every kill
    commit.clean_stale(tmp_path / "checkpoints")
    assert len(commit.committed(tmp_path / "checkpoints")) <= 3  # keep=2, plus one committed just before a kill
