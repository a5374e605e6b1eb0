"""Plan vs actual: what ``scaletrain plan`` predicts for a run's own configuration, beside what the run
measured, and the error (predicted / measured - 1).

At the end of a run (log.plan_vs_actual), of a built-in model or of one's own (fit() given its class: plan/own.py's
way), the plan for the run's own layout (its strategy, checkpointing mode, world size, per-rank batch and
precision). On CUDA the planner measures the model's activations on fake tensors as `scaletrain plan` does, for
this layout only (a fraction of a second); elsewhere the activations are not compared, so they are not planned,
and the model state is planned from the run's own parameter counts (the same counts the planner takes from the
model the config builds). Compared:

- model state per rank (parameters, gradients, optimizer state): the planner's arithmetic against rank 0's
  tensors counted after the first step (observe.memory.model_state_bytes), on every device;
- peak memory per rank and the activations (the peak beyond model state): CUDA only, the allocator's peak
  (a CPU's resident set holds the interpreter and the data too, so it is not compared);
- time per step: on a GPU of the planner's catalog, the plan's step at the run's own steady-state MFU
  (as if measured without recompute: a run with full checkpointing counts its HFU) against the steady-state
  step. At the measured MFU the plan's compute time is the measured step by construction; what the error shows
  is the communication model (a communication-bound plan) and nothing else.

``scaletrain plan --calibrate RUN...`` reads these records back (calibrate()) to correct a new plan: the MFU
the runs reached, and the ratio of measured to planned activations.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletrain.errors import UserError

if TYPE_CHECKING:  # calibrate() (plan --calibrate) reads JSON before anything imports torch
    import torch
    from torch import nn

    from scaletrain.config import Config
    from scaletrain.layout import Layout


def _error(predicted: float, actual: float) -> float | None:
    return predicted / actual - 1 if actual > 0 else None


def plan_vs_actual(cfg: Config, task: str, info: dict[str, Any], sample: Any, target: Any,
                   module: nn.Module, *, device: torch.device, parallel: Layout, batch_size: int, accum_steps: int,
                   flops: float, state: dict[str, Any], peak_bytes: int, step_s: float | None,
                   mfu: float | None) -> dict[str, Any]:
    """The record summary.json keeps under ``plan_vs_actual`` (module docstring). ``parallel``: the run's
    Layout; ``state``: metrics.jsonl's ``mem`` of the last log step (rank 0's model state by part);
    ``peak_bytes``: the largest rank's peak; ``step_s``: the steady-state time per optimizer step; ``mfu``: the
    run's, without recompute."""
    from scaletrain.config import ModelConfig
    from scaletrain.observe.throughput import device_peak
    from scaletrain.plan.catalog import ACCELERATORS
    from scaletrain.plan.estimate import (
        OWN,
        ModelFacts,
        activation_key,
        compile_ratio,
        layout,
        layout_memory,
        measure_model,
        model_counts,
    )
    from scaletrain.plan.fake_build import LossNotFakeable, NotFakeable, on_fake_tensors

    checkpointing, strategy, shard = cfg.memory.activation_checkpointing, parallel.strategy, parallel.dp_shard
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, batch_size=batch_size))
    notes = []
    if task == OWN:  # a model of one's own: no built-in model's key applies
        cfg = dataclasses.replace(cfg, model=ModelConfig())
    buildable = task != OWN or "build" in info
    if device.type == "cuda" and not buildable:
        notes.append("a model given built (not its class) cannot be built again on fake tensors: its activations "
                     "and peak are not planned (fit(MyModel, ...) plans them)")
    facts = None
    if device.type == "cuda" and buildable:
        try:  # a model of one's own fake tensors cannot run is a note: the run is done
            with on_fake_tensors() if task == OWN else contextlib.nullcontext():
                facts = measure_model(cfg, task, info, sample, target=target, modes=(checkpointing,),
                                      sharded=(parallel.sharded,), flops=flops)  # FSDP on one rank too (layout_memory)
        except NotFakeable as err:
            what = "loss_fn on the model's output" if isinstance(err, LossNotFakeable) else "model"
            notes.append(f"activations and peak not planned: the plan runs the {what} on fake tensors, and {err}")
            buildable = False
    if facts is None:  # the run's own counts, which the model the config builds has too; activations not planned
        facts = ModelFacts(*model_counts(module, cfg.parallel.fsdp_units), flops_per_sample=flops,
                           tokens_per_sample=0, activations={checkpointing: 0, f"sharded-{checkpointing}": 0})
    parts = layout_memory(facts, strategy, checkpointing, shard=shard, precision=cfg.train.precision,
                          optimizer=cfg.optim.name)
    if parallel.tp > 1 or parallel.pp > 1:  # rank 0: stage 0's blocks and embeddings (plan/parallel.py), each
        from scaletrain.plan.parallel import stage_params, structure  # matrix 1/tp, every vector whole

        share = stage_params(structure(module, 0), parallel.tp, parallel.pp, 0) / facts.params
        parts = (*(round(p * share) for p in parts[:3]), *parts[3:])
    predicted: dict[str, Any] = dict(zip(("params_bytes", "grads_bytes", "optim_bytes", "activations_bytes",
                                          "fsdp_buffers_bytes"), parts))
    predicted.update(model_state_bytes=sum(parts[:3]), total_bytes=sum(parts),
                     compile_ratio=compile_ratio(cfg, facts.params, activation_key(strategy, checkpointing)))
    if device.type != "cuda" or not buildable:  # not planned where not compared
        del predicted["activations_bytes"], predicted["total_bytes"], predicted["compile_ratio"]
    counted = sum(int(state.get(k, 0)) for k in ("params_bytes", "grads_bytes", "optim_bytes"))
    actual: dict[str, Any] = {"model_state_bytes": counted}
    error: dict[str, Any] = {"model_state": _error(predicted["model_state_bytes"], counted)}
    if device.type == "cuda" and buildable and parallel.pp > 1:  # plan/parallel.py plans a stage's micro-batches
        del predicted["activations_bytes"], predicted["total_bytes"], predicted["compile_ratio"]
        notes.append("pipeline stages: peak memory and activations not compared (model state only)")
    elif device.type == "cuda" and buildable:
        actual.update(peak_bytes=peak_bytes, activations_bytes=int(state.get("activations_bytes", 0)))
        error["peak"] = _error(predicted["total_bytes"], peak_bytes)
    elif device.type != "cuda":
        notes.append(f"peak memory and activations not compared on {device.type} (its resident set holds the "
                     "interpreter and the data too): model state only")
    if cfg.memory.cpu_offload and shard > 1:
        notes.append("memory.cpu_offload keeps the model state in host memory: the plan does not model it")
        error = {k: None for k in error}
    name, _ = device_peak(device, cfg.train.precision, tf32=cfg.train.tf32)
    acc = next((a for a in ACCELERATORS.values() if device.type == "cuda" and a.name in name), None)
    if step_s:
        actual["step_s"] = step_s
    if acc is not None and mfu and step_s:
        lay = layout(facts, strategy, checkpointing, acc=acc, gpus_per_node=parallel.world_size // parallel.nnodes,
                     nodes=parallel.nnodes, precision=cfg.train.precision, tf32=cfg.train.tf32, batch_size=batch_size,
                     accum_steps=accum_steps, optimizer=cfg.optim.name, mfu=mfu, net_bytes_per_s=400e9 / 8)
        predicted.update(step_s=lay.step_s, compute_s=lay.compute_s, comm_s=lay.comm_s, mfu_assumed=mfu)
        error["step_time"] = _error(lay.step_s, step_s)
    else:
        notes.append("step time not compared: the planner knows no peak FLOP/s for this device")
    return {"model": "own" if task == OWN else cfg.model.name,
            "layout": {"strategy": strategy, "checkpointing": checkpointing, "world_size": parallel.world_size,
                       "tp": parallel.tp, "pp": parallel.pp, "batch_size": batch_size, "accum_steps": accum_steps,
                       "precision": cfg.train.precision},
            "accelerator": acc.key if acc else None, "predicted": predicted, "actual": actual, "error": error,
            "notes": notes}


def describe(record: dict[str, Any]) -> str:
    """One line for the summary table: each compared quantity, planned against measured, and the error."""
    from scaletrain.observe.memory import fmt_bytes

    pred, act, err = record["predicted"], record["actual"], record["error"]

    def part(label: str, key: str, p: float, a: float, fmt: Any) -> str:
        e = err.get(key)
        return f"{label} {fmt(p)} planned, {fmt(a)} measured" + ("" if e is None else f" ({100 * e:+.1f}%)")

    parts = [part("model state", "model_state", pred["model_state_bytes"], act["model_state_bytes"], fmt_bytes)]
    if "peak_bytes" in act:
        parts.append(part("peak", "peak", pred["total_bytes"], act["peak_bytes"], fmt_bytes))
    if "step_time" in err:
        parts.append(part("step", "step_time", pred["step_s"], act["step_s"], lambda s: f"{1000 * s:.1f} ms"))
    return "; ".join(parts)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What ``plan --calibrate`` takes from runs: the MFU they reached and measured / eagerly planned
    activations."""

    runs: int
    mfu: float | None
    activations: float | None  # measured / planned eagerly: what the eager plan is multiplied by (compile's
    # ratio replaced by the runs' own, so a run planned with older ratios calibrates the same)

    def describe(self) -> str:
        parts = [f"MFU {self.mfu:.3g} (the runs' steady state)" if self.mfu else "",
                 f"activations x{self.activations:.3g} (measured / planned eagerly)" if self.activations else ""]
        return f"calibrated from {self.runs} run(s): " + ", ".join(p for p in parts if p)


def calibrate(run_dirs: list[str], accelerator: str) -> Calibration:
    """A Calibration from each run directory's summary.json (its plan_vs_actual): the median over the runs made
    on ``accelerator`` (the GPU the plan is for) of the MFU reached without recompute, and of the activations
    measured over planned. A run that cannot say either is one clear error."""
    mfus, ratios = [], []
    for run in run_dirs:
        path = Path(run) / "summary.json"
        fix = "give the run directory of a finished run (scaletrain train ... --run.dir=DIR)"
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise UserError(f"--calibrate {run}: no {path}; fix: {fix}") from None
        except (OSError, ValueError) as err:
            raise UserError(f"--calibrate {run}: {path} cannot be read ({err}); fix: {fix}") from None
        record = summary.get("plan_vs_actual") if isinstance(summary, dict) else None
        if not isinstance(record, dict) or "predicted" not in record:
            raise UserError(f"--calibrate {run}: {path} has no plan_vs_actual (an older run, or "
                            "--log.plan_vs_actual=false); fix: calibrate with runs of a built-in model made by "
                            "this version")
        if record.get("model") == "own":
            raise UserError(f"--calibrate {run}: a run of a model of one's own: its MFU and activations are its "
                            "model's, not a recipe's; fix: calibrate with runs of a built-in model")
        made_on = record.get("accelerator")
        if made_on != accelerator:
            where = made_on or summary.get("device", "a device the planner does not know")
            other = f" (or plan for --gpu {made_on})" if made_on else ""
            raise UserError(f"--calibrate {run}: the run was made on {where}, the plan is for {accelerator}; fix: "
                            f"calibrate with runs on {accelerator}{other}")
        try:
            mfu = summary.get("hfu", summary.get("mfu"))  # with full checkpointing: as if without recompute
            # a pipeline's MFU counts its bubble's idle time; the planner adds the bubble of each layout to a
            # bubble-free rate, so the run's is taken without it (its share of the step: pipeline.bubble_formula)
            idle = float((summary.get("pipeline") or {}).get("bubble_formula") or 0.0)
            if mfu is not None and 0 < float(mfu) <= 1 and 0 <= idle < 1:
                mfus.append(min(1.0, float(mfu) / (1 - idle)))
            planned = float(record["predicted"].get("activations_bytes") or 0) \
                / float(record["predicted"].get("compile_ratio") or 1.0)  # eagerly
            measured = float(record["actual"].get("activations_bytes") or 0)
        except (AttributeError, TypeError, ValueError) as err:
            raise UserError(f"--calibrate {run}: {path} is not a summary this version wrote ({err}); fix: {fix}") \
                from None
        if planned > 0 and measured > 0:
            ratios.append(measured / planned)
    return Calibration(len(run_dirs), statistics.median(mfus) if mfus else None,
                       statistics.median(ratios) if ratios else None)
