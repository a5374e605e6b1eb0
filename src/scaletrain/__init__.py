"""scaletrain: one PyTorch training job from a CPU to many GPUs and machines, measured."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from scaletrain.config import Config, load

if TYPE_CHECKING:
    from scaletrain.train.run import fit, run
    from scaletrain.train.session import session

__all__ = ["Config", "__version__", "fit", "load", "run", "session"]


def __getattr__(name: str) -> Any:
    """``fit``, ``run`` and ``session`` are imported on first use: the trainer pulls in torch and its distributed stack
    (seconds), which the CLI's launcher, --help and the tools that never train should not pay for."""
    if name in ("fit", "run"):
        from scaletrain.train import run as trainer

        return getattr(trainer, name)
    if name == "session":
        from scaletrain.train.session import session

        return session
    raise AttributeError(f"module 'scaletrain' has no attribute {name!r}")
