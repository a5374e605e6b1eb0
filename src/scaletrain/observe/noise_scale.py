"""The gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training", appendix A), from gradient norms a data-parallel run already has.

Each rank's gradient before the all-reduce is an estimate of the true gradient G at the small batch B_small (the
rank's samples); the averaged gradient after it is one at the big batch B_big = B_small x ranks. For a gradient
estimated from B samples, E|G_B|^2 = |G|^2 + tr(Sigma) / B, so two batch sizes give unbiased estimates of both:

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

(|G_small|^2 the mean of the ranks' squared norms). Each is noisy step to step; their ratio is biased when
taken per step, so the paper smooths numerator and denominator separately (an exponential moving average)
and divides the averages: NoiseScale does that. B_simple is the batch size at which the gradient's noise and
its signal are equal: well below it, doubling the batch nearly halves the steps to a given loss; well above
it, more data-parallel ranks buy little (the critical batch size, to which B_simple is a first estimate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def unbiased(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) estimated from the mean squared norm ``small_sq`` of gradients over ``b_small`` samples
    and the squared norm ``big_sq`` of their mean over ``b_big`` samples (the module docstring)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
    g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return g2, trace


@dataclass
class NoiseScale:
    """B_simple smoothed over steps: exponential moving averages of |G|^2 and tr(Sigma), divided (the paper's
    estimator). ``decay``: the weight of the past per update (0.9: about the last 10 updates)."""

    decay: float = 0.9
    g2: float = math.nan
    trace: float = math.nan
    updates: int = 0

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> None:
        g2, trace = unbiased(small_sq, big_sq, b_small, b_big)
        if self.updates == 0:
            self.g2, self.trace = g2, trace
        else:
            self.g2 = self.decay * self.g2 + (1 - self.decay) * g2
            self.trace = self.decay * self.trace + (1 - self.decay) * trace
        self.updates += 1

    @property
    def b_simple(self) -> float:
        """tr(Sigma) / |G|^2 from the averages; NaN before any update or while the averaged |G|^2 is not positive
        (the gradient's signal lost in its noise: too few updates averaged yet)."""
        if self.updates == 0 or not self.g2 > 0:
            return math.nan
        return self.trace / self.g2


# The probe's sums among a session's logged sums (train/session.py): gathered at the log step's one all_gather,
# saved and restored with them; never averaged into the logged metrics.
SMALL, SMALL_N, BIG, BIG_N = "gns#small", "gns#small_n", "gns#big", "gns#big_n"
PREFIX = "gns#"


class GradProbe:
    """The squared gradient norms B_simple is estimated from, summed on the device between log steps (no sync):
    ``small`` over the gradients of one rank's share of a step, before they are averaged (each rank's whole
    gradient as DDP's buckets or FSDP's reduce-scatter inputs hold it, or each micro-batch's on one process
    accumulating), ``big`` over the step's averaged gradient (the optimizer's pre-clip norm, which the step
    computes anyway). ``sums`` is the session's dict of logged sums; ``micro_scale`` undoes the 1/accum the
    loss of a micro-batch is divided by, where each micro-batch is a small gradient of its own."""

    def __init__(self, sums: dict[str, Any], device: Any, *, per_micro_batch: bool) -> None:
        import torch

        self.sums, self.per_micro_batch = sums, per_micro_batch
        self.micro_scale = 1.0
        for name in (SMALL, SMALL_N, BIG, BIG_N):
            sums.setdefault(name, torch.zeros((), device=device))

    def set_accum(self, accum: int) -> None:
        """Micro-batches per step, each loss divided by it (train_step's): a micro-batch's gradient is then 1/accum
        of its own mean gradient, which ``small`` counts."""
        self.micro_scale = float(accum) ** 2 if self.per_micro_batch else 1.0

    def add_small(self, squared: Any) -> None:
        self.sums[SMALL] += squared.float() * self.micro_scale

    def small_done(self) -> None:
        """One small gradient complete (a rank's step, or a micro-batch)."""
        self.sums[SMALL_N] += 1

    def add_big(self, norm: Any) -> None:
        self.sums[BIG] += norm.detach().float().square()
        self.sums[BIG_N] += 1

    def hook_parameters(self, params: list[Any]) -> None:
        """One process accumulating: each parameter's gradient of each backward (a micro-batch's, before it is
        added to .grad) into ``small``."""
        for p in params:
            p.register_hook(self._param_grad)

    def _param_grad(self, grad: Any) -> None:
        self.add_small(squared_norm(grad))

    def reduce_scatter(self) -> Any:
        """FSDP2's reduce-scatter (FSDPModule.set_custom_reduce_scatter) reading each unit's input first: this
        rank's unsharded gradient of the unit, flattened and padded with zeros (fp32/bf16 gradients are not
        divided before the reduction, so its norm is the gradient's)."""
        return _ProbedReduceScatter(self)

    def interval(self, rows: list[dict[str, float]], *, samples: float, steps: int) -> tuple[float, float, float,
                                                                                             float] | None:
        """(mean |G_small|^2, |G_big|^2, B_small, B_big) of a log interval from every rank's sums (``rows``:
        each rank's logged sums) and the samples the data-parallel ranks drew in its ``steps`` steps; None where
        the interval holds no step with two or more small gradients."""
        n_small = sum(r.get(SMALL_N, 0.0) for r in rows)
        n_big = rows[0].get(BIG_N, 0.0)
        if n_small == 0 or n_big == 0 or steps == 0 or samples == 0:
            return None
        b_big = samples / steps
        b_small = b_big * n_big / n_small  # the small gradients per step share the step's samples
        if not b_small < b_big:
            return None
        small = sum(r.get(SMALL, 0.0) for r in rows) / n_small
        return small, rows[0][BIG] / n_big, b_small, b_big


def squared_norm(grad: Any) -> Any:
    """|grad|^2 in fp32; a sparse gradient's (an nn.Embedding(sparse=True)'s, or DDP's bucket of one) from its
    coalesced values, as the dense gradient's."""
    import torch

    if grad.is_sparse:
        grad = grad.coalesce().values()
    return torch.linalg.vector_norm(grad.float()).square()


class _ProbedReduceScatter:
    """What FSDP2 calls for a unit's gradients (its ReduceScatter protocol): the norm of the input into the
    probe, then the reduction FSDP2 would make by default."""

    def __init__(self, probe: GradProbe) -> None:
        self.probe = probe

    def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
        import torch

        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False) -> Any:
        import torch
        import torch.distributed as dist

        self.probe.add_small(torch.linalg.vector_norm(input_tensor.float()).square())
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def check_measurable(*, tp: int, pp: int, precision: str) -> None:
    """The layouts and precisions the noise scale cannot be measured under, as one UserError naming why: from
    the config alone, so `scaletrain train` says it before starting workers (cli/train.py preflight), and
    attach_probe again for a session's own loop."""
    from scaletrain.errors import UserError

    def refuse(why: str, fix: str) -> UserError:
        return UserError(f"log.grad_noise_scale: {why}; fix: {fix}")

    if tp > 1 or pp > 1:
        raise refuse(f"under tensor or pipeline parallelism (tp = {tp}, pp = {pp}) no rank holds the whole gradient "
                     "of its own samples", "measure it with data parallelism alone (--parallel.tp=1 --parallel.pp=1) "
                     "on a smaller model or world: the noise scale belongs to the model and data, not the layout")
    if precision == "fp16-mixed":
        raise refuse("under fp16-mixed the gradients are scaled by a loss scale that changes between steps",
                     "--train.precision=bf16-mixed (or fp32)")


def attach_probe(wrapped: Any, params: list[Any], sums: dict[str, Any], device: Any, *, world_size: int,
                 tp: int = 1, pp: int = 1, precision: str = "fp32") -> GradProbe:
    """A GradProbe on a model as parallelize() wrapped it: DDP through its comm hook (the caller passes the
    probe to observe/timing.py attach_comm_hook), FSDP2 through every unit's reduce-scatter, one process
    through each parameter's gradient of each micro-batch. What it cannot measure is one UserError naming why."""
    from scaletrain.parallel import is_fsdp

    check_measurable(tp=tp, pp=pp, precision=precision)
    if world_size == 1:
        probe = GradProbe(sums, device, per_micro_batch=True)
        probe.hook_parameters(params)
        return probe
    probe = GradProbe(sums, device, per_micro_batch=False)
    if is_fsdp(wrapped):
        from torch.distributed.fsdp import FSDPModule

        for module in wrapped.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_reduce_scatter(probe.reduce_scatter())
    return probe


def steps_ratio(b_noise: float, batch: float, factor: float = 2.0) -> float:
    """Steps to the same loss at ``factor`` x the batch over steps at ``batch``: McCandlish et al.'s
    S = S_min (1 + B_noise / B) (their equation 2.11, B_noise estimated by B_simple)."""
    return (1 + b_noise / (factor * batch)) / (1 + b_noise / batch)


def reading(b_noise: float, global_batch: int, world_size: int, tokens_per_sample: float = 0.0) -> str:
    """One sentence: the critical batch, the current one, and what doubling the data-parallel world buys
    (``tokens_per_sample``: where samples are sequences, the critical batch in tokens too)."""
    if not math.isfinite(b_noise) or b_noise <= 0:
        return (f"gradient noise scale not yet measurable (the gradient's signal is lost in its noise at global batch "
                f"{global_batch:,}); run longer or log it over more steps")
    ratio = steps_ratio(b_noise, global_batch)
    where = "below" if global_batch < b_noise else "above"
    tokens = f" = {b_noise * tokens_per_sample:,.0f} tokens" if tokens_per_sample > 0 else ""
    return (f"gradient noise scale B_simple ~ {b_noise:,.0f} samples{tokens} (the critical batch, to first order); the global "
            f"batch {global_batch:,} is {where} it: doubling the world size to {2 * world_size} (batch "
            f"{2 * global_batch:,}) needs x{ratio:.2f} the steps to the same loss, so x{ratio:.2f} the time at the "
            f"same step time and x{2 * ratio:.2f} the GPU-hours (and cost, at any price per GPU-hour)")


class NoiseScaleLog:
    """The run's gradient noise scale: a GradProbe's sums turned into B_simple at each log step (one estimate per
    interval, smoothed over intervals by NoiseScale), its state in the checkpoint, its sentence in the summary."""

    def __init__(self, probe: GradProbe, *, decay: float = 0.8) -> None:
        self.probe = probe
        self.smoothed = NoiseScale(decay=decay)
        self.last_b_big = 0.0  # the global batch of the last interval estimated

    def interval(self, rows: list[dict[str, float]], *, samples: float, steps: int) -> dict[str, float] | None:
        """metrics.jsonl's ``grad_noise_scale`` for a log interval, or None where it has nothing to estimate."""
        measured = self.probe.interval(rows, samples=samples, steps=steps)
        if measured is None:
            return None
        small, big, b_small, b_big = measured
        self.last_b_big = b_big
        g2, trace = unbiased(small, big, b_small, b_big)
        self.smoothed.update(small, big, b_small, b_big)
        return {"b_simple": self.smoothed.b_simple, "b_simple_interval": trace / g2 if g2 > 0 else math.nan,
                "g2": self.smoothed.g2, "trace": self.smoothed.trace, "b_small": b_small, "b_big": b_big}

    def state_dict(self) -> dict[str, float]:
        return {"g2": self.smoothed.g2, "trace": self.smoothed.trace, "updates": self.smoothed.updates}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.smoothed.g2, self.smoothed.trace = float(state["g2"]), float(state["trace"])
        self.smoothed.updates = int(state["updates"])

    def summary(self, world_size: int, tokens_per_sample: float = 0.0) -> dict[str, Any]:
        b, global_batch = self.smoothed.b_simple, round(self.last_b_big)
        out: dict[str, Any] = {"b_simple": b, "g2": self.smoothed.g2, "trace": self.smoothed.trace,
                               "updates": self.smoothed.updates, "global_batch": global_batch,
                               "reading": reading(b, global_batch, world_size, tokens_per_sample)}
        if math.isfinite(b) and b > 0:
            out["steps_ratio_2x"] = steps_ratio(b, global_batch)
        return out
