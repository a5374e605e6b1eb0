"""scaletrain: one PyTorch training job from a CPU to many GPUs and machines, measured."""

from __future__ import annotations

__version__ = "0.1.0"

from scaletrain.config import Config, load
from scaletrain.train.run import fit, run

__all__ = ["Config", "__version__", "fit", "load", "run"]
