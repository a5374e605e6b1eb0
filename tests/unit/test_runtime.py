"""Device and backend choice from the environment, and world size 1 without a launcher."""

from __future__ import annotations

import sys

import pytest
import torch

from scaletrain import runtime
from scaletrain.config import DistConfig
from scaletrain.errors import ConfigError


def test_single_process_is_world_size_one_without_a_group(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    rt = runtime.init(DistConfig(device="cpu"))
    assert (rt.rank, rt.world_size, rt.local_rank, rt.backend, rt.distributed) == (0, 1, 0, "none", False)
    assert rt.device == torch.device("cpu") and rt.is_main
    runtime.close(rt)


def test_auto_picks_cuda_local_rank_and_nccl_where_cuda_is_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    device = runtime.pick_device(DistConfig(), local_rank=3)
    assert device == torch.device("cuda", 3)
    assert runtime.pick_backend(DistConfig(), device) == "nccl"
    assert runtime.pick_device(DistConfig(device="cuda:5"), local_rank=3) == torch.device("cuda", 5)
    assert runtime.pick_device(DistConfig(device="cpu"), local_rank=3) == torch.device("cpu")
    assert runtime.pick_backend(DistConfig(backend="gloo"), device) == "gloo"


def test_auto_picks_cpu_and_gloo_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device = runtime.pick_device(DistConfig(), local_rank=1)
    assert device == torch.device("cpu") and runtime.pick_backend(DistConfig(), device) == "gloo"
    with pytest.raises(ConfigError, match="dist.device = 'cuda:1'.*without CUDA"):
        runtime.pick_device(DistConfig(device="cuda:1"), local_rank=0)
    with pytest.raises(ConfigError, match="dist.backend = 'nccl'.*gloo"):
        runtime.pick_backend(DistConfig(backend="nccl"), device)


def test_warnings_are_said_once_by_rank_0(capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank runs the same code: scaletrain's warnings print on rank 0 only, as `scaletrain: warning:`,
    and the other ranks silence Python's warnings (torch's included) unless the user set a filter."""
    import logging
    import warnings

    from scaletrain.runtime import speak_once

    logger = logging.getLogger("scaletrain.parallel")
    monkeypatch.setattr(sys, "warnoptions", [])
    with warnings.catch_warnings():
        speak_once(1)
        logger.warning("hsdp with dp_replicate = 1 is fsdp")
        warnings.warn("a torch warning", UserWarning, stacklevel=1)
        assert capsys.readouterr().err == ""
        speak_once(0)
        logger.warning("hsdp with dp_replicate = 1 is fsdp")
        assert capsys.readouterr().err == "scaletrain: warning: hsdp with dp_replicate = 1 is fsdp\n"


def test_the_worker_named_first_is_the_one_killed_not_the_survivor_reporting_it():
    """torchrun records failures in whole seconds. A worker killed by a signal from outside (SIGKILL, the OOM
    killer) in the same second as a survivor exiting on the collective it left is the root; the agent's own
    SIGKILL follows its SIGTERM by the shutdown timeout (>= 30 s) and is never the root."""
    from types import SimpleNamespace as Failure

    from scaletrain.cluster.torchrun import root_failure

    assert root_failure({0: Failure(exitcode=1, timestamp=100), 1: Failure(exitcode=-9, timestamp=100)}) == (1, -9)
    assert root_failure({0: Failure(exitcode=1, timestamp=100), 1: Failure(exitcode=-9, timestamp=131)}) == (0, 1)
    assert root_failure({0: Failure(exitcode=-15, timestamp=100), 1: Failure(exitcode=1, timestamp=101)}) == (1, 1)
    assert root_failure({0: Failure(exitcode=1, timestamp=100), 1: Failure(exitcode=1, timestamp=100)}) == (0, 1)
