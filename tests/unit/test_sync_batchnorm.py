"""SyncBatchNorm in a multi-process run on a CPU is one line (PyTorch syncs it on GPUs only: a traceback per rank
from DDP or the first forward); one process, where nothing is synced, and GPUs run it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.init import refuse_sync_batchnorm


def _net() -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(
        nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)))


def test_two_cpu_processes_are_told_in_one_line():
    with pytest.raises(UserError) as err:
        refuse_sync_batchnorm(_net(), torch.device("cpu"), 2)
    assert str(err.value).startswith("this Sequential has SyncBatchNorm layers (1, 3), which PyTorch syncs on GPUs "
                                     "only, and this run is 2 processes on the CPU; fix: keep nn.BatchNorm")


@pytest.mark.parametrize(("device", "world"), [("cpu", 1), ("cuda", 2), ("cuda", 1)])
def test_one_process_or_a_gpu_runs_it(device, world):
    refuse_sync_batchnorm(_net(), torch.device(device), world)  # nothing raised


def test_plain_batchnorm_on_two_cpu_processes_is_fine():
    refuse_sync_batchnorm(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4)), torch.device("cpu"), 2)
