"""scaletrain: one PyTorch training job from a CPU to many GPUs and machines, measured."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from scaletrain.config import Config, load

if TYPE_CHECKING:
    from scaletrain.plan.own import plan_fit
    from scaletrain.train.run import fit, run
    from scaletrain.train.session import session

__all__ = ["Config", "__version__", "fit", "load", "plan_fit", "run", "session"]


def __getattr__(name: str) -> Any:
    """``fit``, ``run``, ``session`` and ``plan_fit`` are imported on first use: the trainer pulls in torch and its
    distributed stack (seconds), which the CLI's launcher, --help and the tools that never train should not pay for."""
    if name in ("fit", "run"):
        from scaletrain.train import run as trainer

        return getattr(trainer, name)
    if name == "session":
        from scaletrain.train.session import session

        return session
    if name == "plan_fit":  # what fit() would run, planned as `scaletrain plan` plans a recipe (plan/own.py)
        from scaletrain.plan.own import plan_fit

        return plan_fit
    raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")
