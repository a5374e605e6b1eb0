"""FSDP through the trainer: the same training step as one process, half the model state per rank, and the
guard, accumulation and evaluation working on shards."""

from __future__ import annotations

import torch
from spawn_ranks import run_ranks, trained_digits_job

from scaletrain import runtime
from scaletrain.config import load
from scaletrain.data import digits
from scaletrain.train.evaluate import evaluate
from scaletrain.train.state import full_model_state

STEPS = 5
BASE = {"model.name": "cnn", "model.dropout": 0.0, "optim.name": "adamw", "optim.lr": 1e-3,
        "optim.weight_decay": 0.1, "optim.grad_clip": 0.5, "dist.device": "cpu", "run.seed": 7}


def _train(rank: int, world: int, overrides: dict) -> dict:
    job = trained_digits_job({**BASE, **overrides}, STEPS)
    metrics = evaluate(job)
    params = {k: v.detach().clone() for k, v in full_model_state(job.module, sharded=job.sharded).items()}
    return {"params": params, "state": job.st._state_bytes.as_dict(), "sharded": job.sharded, "eval": metrics,
            "skipped": float(job.st.guard.skipped)}


def _worst(got: dict, want: dict) -> float:
    return max(((got[k] - v).norm() / v.norm()).item() for k, v in want.items())


def test_fsdp_through_the_trainer_matches_one_process_and_halves_the_state():
    # (DDP against one process is tests/dist/test_ddp_equivalence.py's; a DDP rank holds what one process does.)
    single = _train(0, 1, {"data.batch_size": 32})
    fsdp = run_ranks(_train, 2, {"data.batch_size": 16, "parallel.strategy": "fsdp"})
    accum = run_ranks(_train, 2, {"data.batch_size": 8, "train.accum_steps": 2, "parallel.strategy": "fsdp"})
    assert fsdp[0]["sharded"] and not single["sharded"]
    # rank 0 gathers the full weights; 5 AdamW steps with clipping agree to float summation order
    assert _worst(fsdp[0]["params"], single["params"]) < 1e-5
    assert _worst(accum[0]["params"], single["params"]) < 1e-5
    # model state per rank, counted from the live tensors: FSDP holds half of a replica's (to within padding)
    for key in ("params_bytes", "grads_bytes", "optim_bytes"):
        full, shard = single["state"][key], fsdp[0]["state"][key]
        assert abs(shard - full / 2) <= 0.01 * full, (key, shard, full)
    # evaluation under FSDP: every held-out sample once, the same metrics on every rank
    assert fsdp[0]["eval"]["count"] == fsdp[1]["eval"]["count"] == 360
    assert fsdp[0]["eval"] == fsdp[1]["eval"]
    assert fsdp[0]["eval"]["accuracy"] == single["eval"]["accuracy"] or \
        abs(fsdp[0]["eval"]["loss"] - single["eval"]["loss"]) < 1e-4
    assert fsdp[0]["skipped"] == 0.0


def test_a_nan_on_one_rank_is_skipped_on_every_shard():
    ranks = run_ranks(_train, 2, {"data.batch_size": 16, "parallel.strategy": "fsdp", "train.nonfinite": "skip",
                                  "chaos.nan_rank": 1, "chaos.nan_step": 3})
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == 1.0  # the same decision on both ranks
    assert all(torch.isfinite(v).all() for v in ranks[0]["params"].values())
