"""The planner's activations per rank under tensor and pipeline parallelism against the real steps.

The plan measures a t-way tensor-parallel step on fake tensors over torch's fake process group (one process
playing rank 0: plan/estimate.py with_tp_activations); here the same configs run the real step on 2 Gloo ranks
(parallelize() as the trainer calls it) and LiveBytes measures each rank's peak beyond the model state, at
batch 1 and 2, extrapolated to the batch as the plan does. Small Llama and GPT shapes (4 blocks, width 128,
64 tokens, batch 4), fp32 and bf16 autocast, CPU kernels on both sides.

Measured 2026-11-25 (the trainer's cross-entropy on logits split by vocabulary, parallel.loss_parallel): the plan
6.90 / 5.82 MB (Llama fp32 / bf16) and 5.87 / 4.49 MB (GPT) against the real step's 6.90-7.00 / 5.92-6.02 and
5.87 / 4.49 MB over 8 runs: within 3.2% (a Gloo buffer of 93 KB alive at the Llama bf16 peak in some runs,
not in others; two of them in one run of make test, 4.8% off: the real step is measured twice and the smaller
peak kept), the GPT's to the byte. With the logits gathered whole instead, Gloo's
collectives release their buffers when their work completes, and a rank's peak varied by up to 10% between
runs. Korthikanti et al.'s ratio (1/t with sequence parallelism), which the plan used before, misses what
torch's tensor parallelism keeps (the all-gathered inputs of the column-parallel matmuls, whole for backward;
the GPT's norms, not sequence-parallel): 5.27 and 3.99 MB for the GPT.

Measured again 2026-12-07, once the peak at a batch was the step's highest moment at that batch rather than the
line through the peaks at batch 1 and 2 (observe.memory.StepCurve, exact to the byte at batch 3 and 4 against
the real step run there): the real step 7.10 / 6.02 MB (Llama; the line had said 6.90 / 5.92) and 5.87 / 4.56
MB (GPT; 4.49 before), the plan 6.90 / 5.85 and 5.87 / 4.56 MB: the Llama 2.8% low (the fake process group's
step against Gloo's, the same at batch 1 and 2), the GPT to the byte; Korthikanti's ratio 5.27 / 4.22 MB for
the GPT, 10% and 7% low.

Pipeline parallelism (PP=2, Llama fp32, 4 micro-batches of 2): each stage's peak through PipelineRunner.step
against the plan's stage (its blocks x the micro-batches in flight, the rest whole). Measured 2026-11-25:
1F1B stage 0 (the largest: 2 micro-batches in flight) 6.38 MB planned, 6.57-6.64 MB real; the last stage 3.48
planned, 3.62-3.88 real once the runner stopped torch's schedule from keeping every micro-batch's logits to
return them (return_outputs=False: 0.39 MB less). GPipe's last stage keeps every micro-batch's logits and loss
graph: 13.15 MB planned (12.17 before the plan held them per micro-batch in flight), 13.4-13.7 MB real.
Interleaved (2 stages per rank): rank 0 holds the warm-up's 4 chunks and the one computing, 2.5 stages' worth
of micro-batches against 1F1B's 2: 7.82 / 5.10 MB planned (6.38 / 3.48 as 1F1B before), 8.42-8.95 / 5.59-6.25
real: 7-18% low still (each chunk's received input and its gradient buffers are not planned).
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
from scaletrain.parallel.pipeline import PipelineRunner
from scaletrain.sharded import loss_context

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
                    layout=resolve_layout(cfg.parallel, cfg.memory, world), loss_parallel=True)
        with loss_context(model):  # as the trainer runs its cross-entropy: on logits split by vocabulary
            # The smaller of two measurements: a Gloo send buffer (93-97 KB) still alive at the peak is the
            # collective's thread running late, not an activation, and under a loaded machine two of them were
            # (6.12 MB against 5.92 alone, make test 2026-11-25).
            out.append(min(estimate_activation_bytes(model, splits.train[0][0], cfg.data.batch_size,
                                                     precision=precision, whole_step=True) for _ in range(2)))
    return out


def _planned(recipe: str, overrides: dict, precision: str, tp: int) -> tuple[int, int]:
    """(measured on the fake tensor-parallel step, Korthikanti's ratio) activations per rank of the plan."""
    from scaletrain.plan import parallel as par
    from scaletrain.plan.catalog import ACCELERATORS
    from scaletrain.plan.estimate import (
        measure_model,
        usable_bytes,
        with_block_activations,
        with_tp_activations,
    )

    cfg = _config(recipe, overrides, precision, tp)
    splits = build_splits(cfg.data, cfg.model)
    sample, target = splits.train[0]
    ratio = with_block_activations(cfg, splits.task, splits.info, sample,
                                   measure_model(cfg, splits.task, splits.info, sample, target=target, modes=("none",),
                                                 sharded=(False,)), target=target)  # what ddp x tp, none reads
    measured = with_tp_activations(cfg, splits.task, splits.info, sample, ratio, [tp], target=target)
    assert set(measured.tp_activations) == {tp}
    with torch.device("meta"):
        shape = par.structure(build_model(cfg.model, splits.task, splits.info), measured.tokens_per_sample)
    h100, b = ACCELERATORS["h100"], cfg.data.batch_size
    st = par.Setting(measured, shape, h100, tp, precision, True, b, b, "1f1b", "adamw", 0.4, 50e9,
                     usable_bytes(h100))
    return tuple(par.parallel_layout(s, "ddp", "none", gpus=tp, tp=tp, pp=1).activations_bytes
                 for s in (st, dataclasses.replace(st, facts=ratio)))


def test_tp2_activations_per_rank_are_the_real_steps_within_4_percent():
    real = run_ranks(_real, 2)
    for i, case in enumerate(CASES):
        measured, ratio = _planned(*case, 2)
        for rank in (0, 1):
            assert measured == pytest.approx(real[rank][i], rel=0.04), (case, rank, measured, real[rank][i])
        if case[0] == "gpt-stdlib":  # the ratio alone misses the norms' whole activations (7% and 10% here)
            assert ratio < 0.95 * measured, (case, ratio, measured)


PP_SHAPE = {**SHAPE, "data.batch_size": "2", "model.n_kv_head": "4", "model.ffn_hidden": "384"}
MICRO = 4
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2}  # pipeline stages per rank


def _pp_real(rank: int, world: int) -> dict[str, int]:
    import torch.nn.functional as F

    from scaletrain.observe.memory import LiveBytes

    runtime.init(DistConfig(device="cpu"))
    out = {}
    for schedule in ("gpipe", "1f1b", "interleaved"):
        cfg = load("llama-tiny", cli_overrides={**PP_SHAPE, "parallel.pp": "2", "parallel.pp_schedule": schedule,
                                                "parallel.pp_virtual": str(VIRTUAL[schedule])})
        splits = build_splits(cfg.data, cfg.model)
        stage = parallelize(build_model(cfg.model, splits.task, splits.info), torch.device("cpu"), world,
                            cfg.parallel, compile=False, layout=resolve_layout(cfg.parallel, cfg.memory, world))
        runner = PipelineRunner(stage, stage.mesh, device=torch.device("cpu"), microbatches=MICRO, schedule=schedule,
                                loss_fn=lambda y, t: F.cross_entropy(y.reshape(-1, y.shape[-1]), t.reshape(-1)))
        rows = [splits.train[i] for i in range(cfg.data.batch_size * MICRO)]
        xs, ys = torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows])
        params = list(stage.parameters())
        for p in params:  # allocated before, as the trainer's gradients are after its first step
            p.grad = torch.zeros_like(p)
        peaks = []
        for _ in range(2):  # the first step also sets the schedule up
            tracker = LiveBytes([*params, *(p.grad for p in params), *stage.buffers(), xs, ys])
            with tracker:
                runner.step(xs, ys)
            peaks.append(tracker.peak)
        # and torch's receive buffers, allocated in the first step and kept (the second's tracker cannot see them)
        out[schedule] = peaks[-1] + _receive_buffers(runner)
    return out


def _receive_buffers(runner: PipelineRunner) -> int:
    """Bytes of the receive buffers torch's PipelineStages of this rank keep: per micro-batch, each stage's
    inputs (not the first stage's, which has none) and its output's gradients (not the last's)."""
    storages = {}
    for stage in runner.stages:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            for info in infos:
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor):
                    storages[buffer.untyped_storage()._cdata] = buffer.untyped_storage().nbytes()
    return sum(storages.values())


def _pp_planned(schedule: str) -> list[int]:
    from scaletrain.plan import parallel as par
    from scaletrain.plan.catalog import ACCELERATORS
    from scaletrain.plan.estimate import measure_model, usable_bytes, with_block_activations

    cfg = _config("llama-tiny", PP_SHAPE, "fp32", 1)
    splits = build_splits(cfg.data, cfg.model)
    sample, target = splits.train[0]
    facts = with_block_activations(cfg, splits.task, splits.info, sample,
                                   measure_model(cfg, splits.task, splits.info, sample, target=target, modes=("none",),
                                                 sharded=(False,)), target=target)  # what ddp x tp, none reads
    with torch.device("meta"):
        shape = par.structure(build_model(cfg.model, splits.task, splits.info), facts.tokens_per_sample)
    h100, b = ACCELERATORS["h100"], cfg.data.batch_size
    st = par.Setting(facts, shape, h100, 2, "fp32", True, b, b * MICRO, schedule, "adamw", 0.4, 50e9,
                     usable_bytes(h100), VIRTUAL[schedule])
    return [par._stage_memory(st, "ddp", "none", 1, 1, 2, MICRO, stage)[3] for stage in (0, 1)]


def test_pp2_activations_per_stage_against_the_real_pipeline_step():
    """Each schedule's planned activations per stage (the blocks' micro-batches in flight and the stages'
    edges: plan/parallel.py's stage_edges) against the real step's peak plus torch's receive buffers, within
    5% (measured 2026-11-25: -1.0 to +3.4%; interleaved was 7-18% low before the edges were counted)."""
    real = run_ranks(_pp_real, 2)
    for schedule in ("1f1b", "gpipe", "interleaved"):
        planned = _pp_planned(schedule)
        for stage in (0, 1):
            assert planned[stage] == pytest.approx(real[stage][schedule], rel=0.05), (schedule, stage, planned, real)
    assert real[0]["1f1b"] > real[1]["1f1b"] and _pp_planned("1f1b")[0] > _pp_planned("1f1b")[1]  # 2 in flight
    # the interleaved warm-up's chunks in flight: more than 1F1B's, as planned
    assert real[0]["interleaved"] > real[0]["1f1b"] and _pp_planned("interleaved")[0] > _pp_planned("1f1b")[0]
