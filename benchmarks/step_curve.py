"""A step's peak beyond the model state at the planned batch: the step measured there on fake tensors, against
the planner's StepCurve (measured at batch 1 and 2, or 2 and 3) and against the line through the peaks at batch
1 and 2 it used before. Nothing is allocated: every model is built and run on fake tensors.

    python benchmarks/step_curve.py [--batches 1 2 4 8 16] [--timm convnext_tiny vit_tiny_patch16_224 ...]

Models: scaletrain's built-in GPT and Llama (recipes gpt-stdlib and llama-tiny at their own shapes), and the timm
models named (when timm is installed: `pip install timm`; built from their code, nothing downloaded), each with
no and with full activation checkpointing, in fp32 and under bf16 autocast. Prints one row per case and batch.
"""

from __future__ import annotations

import argparse

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from scaletrain.batch import Batch
from scaletrain.bench.report import environment
from scaletrain.config import load
from scaletrain.data import build_splits
from scaletrain.models import build_model
from scaletrain.observe.memory import measure_step, step_points
from scaletrain.parallel.activation_checkpoint import apply_activation_checkpointing
from scaletrain.plan.fake_build import build_fake


def _builtin(recipe: str):
    cfg = load(recipe).for_device("cpu")
    splits = build_splits(cfg.data, cfg.model)
    sample, target = splits.train[0]
    return (lambda: build_model(cfg.model, splits.task, splits.info)), Batch((sample[None],), {}, target[None])


def _timm(name: str):
    import timm

    return (lambda: timm.create_model(name)), Batch((torch.randn(1, 3, 224, 224),), {}, torch.tensor([3]))


def _peak(model: torch.nn.Module, sample: Batch, batch_size: int, precision: str) -> int:
    """The step's peak beyond the model state, run at ``batch_size``."""
    return measure_step(model, sample.repeat(batch_size), precision=precision, backward=True,
                        grads_allocated=True).peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--timm", nargs="*", default=[], help="timm model names (needs timm)")
    args = parser.parse_args()
    print(environment())
    models = {r: _builtin(r) for r in ("gpt-stdlib", "llama-tiny")} | {n: _timm(n) for n in args.timm}
    print(f"{'model':<24} {'checkpointing':<13} {'precision':<10} {'batch':>5} {'step MB':>10} "
          f"{'curve MB':>10} {'line MB':>10}")
    for name, (build, one) in models.items():
        for ac in ("none", "full"):
            for precision in ("fp32", "bf16-mixed"):
                with FakeTensorMode() as mode:
                    model = build_fake(build)
                    model.train()
                    apply_activation_checkpointing(model, ac)
                    sample = one.map(mode.from_tensor)
                    curve = step_points(model, sample, precision=precision)

                    peak = {b: _peak(model, sample, b, precision) for b in sorted({1, 2, *args.batches})}
                    for b in args.batches:
                        line = max(peak[1] + (peak[2] - peak[1]) * (b - 1), 0)
                        print(f"{name:<24} {ac:<13} {precision:<10} {b:>5} {peak[b] / 1e6:>10.3f} "
                              f"{curve.at(b).peak_bytes / 1e6:>10.3f} {line / 1e6:>10.3f}")


if __name__ == "__main__":
    main()
