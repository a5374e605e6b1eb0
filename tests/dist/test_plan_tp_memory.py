"""The planner's activations per rank under tensor parallelism against the real tensor-parallel step.

The plan measures a t-way tensor-parallel step on fake tensors over torch's fake process group (one process
playing rank 0: plan/estimate.py with_tp_activations); here the same configs run the real step on 2 Gloo ranks
(parallelize() as the trainer calls it) and LiveBytes measures each rank's peak beyond the model state, at
batch 1 and 2, extrapolated to the batch as the plan does. Small Llama and GPT shapes (4 blocks, width 128,
64 tokens, batch 4), fp32 and bf16 autocast, CPU kernels on both sides.

Measured 2026-11-25, 6 runs: the real step is not one number. Gloo's collectives release their buffers when
their work completes, so which of them are alive at the peak depends on timing: a rank's peak varied by up to
10% between runs (Llama fp32 7.43-8.02 MB, GPT fp32 6.13-6.85 MB; bf16 within 5%). The plan (Llama 7.56 /
6.28 MB, GPT 6.46 / 4.98 MB fp32 / bf16) lay within 6% of every run's ranks, hence the 10% here.
Korthikanti et al.'s ratio (1/t with sequence parallelism), which the plan used before, is 8-20% below the
plan's measurement and below most real runs: torch's tensor parallelism keeps the all-gathered inputs of the
column-parallel matmuls whole for backward (Megatron gathers them again), and the GPT's norms are not
sequence-parallel.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spawn_ranks import run_ranks

from scaletrain import runtime
from scaletrain.config import DistConfig, load
from scaletrain.data import build_splits
from scaletrain.layout import resolve_layout
from scaletrain.models import build_model
from scaletrain.observe.memory import estimate_activation_bytes
from scaletrain.parallel import parallelize

SHAPE = {"data.seq_len": "64", "data.batch_size": "4", "model.n_layer": "4", "model.n_embd": "128",
         "model.n_head": "8"}
CASES = [("llama-tiny", {**SHAPE, "model.n_kv_head": "4", "model.ffn_hidden": "384"}, p)
         for p in ("fp32", "bf16-mixed")] + [("gpt-stdlib", SHAPE, p) for p in ("fp32", "bf16-mixed")]


def _config(recipe: str, overrides: dict, precision: str, tp: int):
    return load(recipe, cli_overrides={**overrides, "parallel.tp": str(tp), "dist.nproc": str(tp),
                                       "train.precision": precision}).for_device("cpu")


def _real(rank: int, world: int) -> list[int]:
    runtime.init(DistConfig(device="cpu"))
    out = []
    for recipe, overrides, precision in CASES:
        cfg = _config(recipe, overrides, precision, world)
        splits = build_splits(cfg.data, cfg.model)
        model = build_model(cfg.model, splits.task, splits.info)
        parallelize(model, torch.device("cpu"), world, cfg.parallel, compile=False,
                    layout=resolve_layout(cfg.parallel, cfg.memory, world))
        out.append(estimate_activation_bytes(model, splits.train[0][0], cfg.data.batch_size, precision=precision,
                                             whole_step=True))
    return out


def _planned(recipe: str, overrides: dict, precision: str, tp: int) -> tuple[int, int]:
    """(measured on the fake tensor-parallel step, Korthikanti's ratio) activations per rank of the plan."""
    from scaletrain.plan import parallel as par
    from scaletrain.plan.catalog import ACCELERATORS
    from scaletrain.plan.estimate import measure_model, usable_bytes, with_block_activations, with_tp_activations

    cfg = _config(recipe, overrides, precision, tp)
    splits = build_splits(cfg.data, cfg.model)
    sample, target = splits.train[0]
    ratio = with_block_activations(cfg, splits.task, splits.info, sample,
                                   measure_model(cfg, splits.task, splits.info, sample, target=target), target=target)
    measured = with_tp_activations(cfg, splits.task, splits.info, sample, ratio, [tp], target=target)
    assert set(measured.tp_activations) == {tp}
    with torch.device("meta"):
        shape = par.structure(build_model(cfg.model, splits.task, splits.info), measured.tokens_per_sample)
    h100, b = ACCELERATORS["h100"], cfg.data.batch_size
    st = par.Setting(measured, shape, h100, tp, precision, True, b, b, "1f1b", "adamw", 0.4, 50e9,
                     usable_bytes(h100))
    return tuple(par.parallel_layout(s, "ddp", "none", gpus=tp, tp=tp, pp=1).activations_bytes
                 for s in (st, dataclasses.replace(st, facts=ratio)))


def test_tp2_activations_per_rank_are_the_real_steps_within_10_percent():
    real = run_ranks(_real, 2)
    for i, case in enumerate(CASES):
        measured, ratio = _planned(*case, 2)
        for rank in (0, 1):
            assert measured == pytest.approx(real[rank][i], rel=0.10), (case, rank, measured, real[rank][i])
        assert ratio < 0.93 * measured, (case, ratio, measured)  # the ratio alone misses what torch keeps
