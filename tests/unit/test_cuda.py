"""The GPU path: the same code with another device. Skipped on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

from scaletrain.config import load
from scaletrain.train.run import run

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_digits_trains_on_one_gpu(precision, tmp_path):
    cfg = load("digits", {"run.dir": str(tmp_path / precision), "train.precision": precision,
                          "train.epochs": 10, "train.progress": False})
    summary = run(cfg)
    assert summary["device"].startswith("cuda") and summary["world_size"] == 1
    assert summary["eval"]["accuracy"] >= 0.95
    assert summary["peak_mem_bytes"] > 0
