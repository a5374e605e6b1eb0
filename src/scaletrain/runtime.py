"""The distributed environment: who am I, on what device, talking over which backend.

A single process with no launcher around it is world size 1 and starts no process group. Under torchrun
(or anything that sets RANK/WORLD_SIZE/LOCAL_RANK and MASTER_ADDR/MASTER_PORT) the process joins the group.
"""

from __future__ import annotations

import gc
import os
import random
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from scaletrain.config import DistConfig
from scaletrain.errors import ConfigError


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str  # the collective backend; "none" when world size is 1 and no group was started
    owns_group: bool = False  # this runtime started the process group, so it also ends it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def under_launcher() -> bool:
    """True when a launcher (torchrun, or a compatible one) has set this process's rank and world."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def pick_device(cfg: DistConfig, local_rank: int) -> torch.device:
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("dist.device", cfg.device, "cpu or auto on a machine without CUDA",
                              "--device=auto (or cpu)")
        index = int(want[5:]) if ":" in want else local_rank % torch.cuda.device_count()
        return torch.device("cuda", index)
    return torch.device("cpu")


def pick_backend(cfg: DistConfig, device: torch.device) -> str:
    if cfg.backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if cfg.backend == "nccl" and device.type != "cuda":
        raise ConfigError("dist.backend", "nccl", "gloo (or auto) on a CPU device", "--dist.backend=auto")
    return cfg.backend


def init(cfg: DistConfig) -> Runtime:
    """Read the launcher's environment, pick device and backend, and join the process group if there is one."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    device = pick_device(cfg, local_rank)
    backend = pick_backend(cfg, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns = False
    if under_launcher() and not dist.is_initialized():
        timeout = timedelta(seconds=cfg.timeout_s)
        store = _attempt_store(world, timeout)
        extra = {"store": store, "rank": rank, "world_size": world} if store is not None else {}
        dist.init_process_group(backend=backend, timeout=timeout,
                                device_id=device if device.type == "cuda" else None, **extra)
        owns = True
    elif not under_launcher():
        backend = "none"
    rt = Runtime(rank, local_rank, world, local_world, device, backend, owns)
    _announce(rt)
    return rt


def _attempt_store(world: int, timeout: timedelta) -> dist.Store | None:
    """Under torchrun's agent store, the process group's keys in a namespace of their own per restart.

    The agent keeps one store for the whole job; the keys through which Gloo ranks exchange their addresses
    would otherwise be the same in every attempt, and a rank of a restarted group could read the address of a
    worker that was killed (seen here: "Gloo connectFullMesh failed ... Connection refused" after a restart).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                         timeout=timeout)
    return dist.PrefixStore(f"scaletrain/attempt-{_attempt()}", base)


def _store() -> dist.Store | None:
    """The process group's key-value store (torchrun's agent store), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _attempt() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _announce(rt: Runtime) -> None:
    """Record this rank's host in the store once, so that a failure can name where a missing rank runs."""
    store = _store() if rt.distributed else None
    if store is not None:
        store.set(f"scaletrain/{_attempt()}/host/{rt.rank}", socket.gethostname())


def missing_peers(rt: Runtime, step: int, wait_s: float = 2.0) -> list[tuple[int, str]]:
    """After a collective failed: the ranks that did not also report the failure within wait_s, as
    (rank, host). Every surviving rank calls this at its failure, so the ranks that never answer are the
    hung or dead ones. Costs nothing until a failure."""
    store = _store() if rt.distributed else None
    if store is None:
        return []
    prefix = f"scaletrain/{_attempt()}"
    try:
        store.set(f"{prefix}/failed/{rt.rank}", str(step))
        deadline = time.monotonic() + wait_s
        missing = list(range(rt.world_size))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{prefix}/failed/{r}"])]
            time.sleep(0.1)
        hosts = []
        for r in missing:
            key = f"{prefix}/host/{r}"
            hosts.append((r, store.get(key).decode() if store.check([key]) else "?"))
        return hosts
    except (RuntimeError, dist.DistError):  # the store itself is gone (the agent died): nothing to name
        return []


def close(rt: Runtime) -> None:
    """End the process group if this runtime started it (a user's own group is left alone).

    destroy_process_group() only drops the registry's reference. Anything else holding the group (a DDP
    wrapper, often in a reference cycle) keeps Gloo's worker threads alive until interpreter shutdown, where
    a thread releasing a finished collective's tensors needs the GIL and aborts the process ("terminate
    called without an active exception", SIGABRT, at random ~1 run in 12 here). Callers drop their
    wrappers first; collecting cycles here lets the group's destructor join its threads now.
    """
    if rt.owns_group and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def set_deterministic(on: bool) -> None:
    """Deterministic kernels for bitwise-repeatable runs (cuBLAS needs its workspace fixed before its first
    use; an op without a deterministic kernel warns instead of failing)."""
    if not on:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (all devices) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
