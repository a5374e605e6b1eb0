"""Where records go besides metrics.jsonl: TensorBoard event files (``--log.tensorboard``).

A sink takes the same records as metrics.jsonl (one source of truth per metric) and writes the numbers it
understands: scalars under ``train/``, ``eval/``, ``phase/`` (median over ranks), ``mem/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scaletrain.errors import ConfigError


def check_tensorboard() -> None:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError("log.tensorboard", True, "the tensorboard package installed",
                          "pip install tensorboard (or scaletrain[tensorboard]), or --log.tensorboard=false") from None


class TensorBoardSink:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(directory))

    def write(self, record: dict[str, Any]) -> None:
        step, kind = record.get("step", 0), record.get("kind")
        scalars: dict[str, float] = {}
        if kind == "train":
            for key in ("loss", "lr", "samples_per_s", "tokens_per_s", "flops_per_s", "mfu", "step_time_s",
                        "skipped_steps"):
                if key in record:
                    scalars[f"train/{key}"] = record[key]
            for phase, stats in record.get("phase_stats", {}).items():
                scalars[f"phase/{phase}_s"] = stats["median"]
            for key in ("peak_bytes", "params_bytes", "grads_bytes", "optim_bytes", "activations_bytes"):
                if key in record.get("mem", {}):
                    scalars[f"mem/{key}"] = record["mem"][key]
        elif kind == "eval":
            scalars = {f"eval/{k[5:]}": v for k, v in record.items() if k.startswith("eval_")}
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
