"""Run a function on N spawned ranks that form a Gloo process group on loopback.

The per-rank body is a module-level function ``fn(rank, world, *args)``; its return value comes back to the
test (through torch.save in a temporary directory). A rank that raises fails the test with its traceback;
ranks still running at the deadline are killed, so no process outlives the test.

As under torchrun, the rendezvous store lives in the parent (the "agent") and every rank is a client
(TORCHELASTIC_USE_AGENT_STORE). With rank 0 hosting it instead, rank 0's exit could tear the store's server
thread down while others still talked to it ("terminate called without an active exception", SIGABRT).
"""

from __future__ import annotations

import gc
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scratch import scratch_dir

# What every rank imports anyway (DDP's constructor imports torch._dynamo and DTensor itself).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
            "torch.nn.parallel", "torch.distributed.fsdp", "scaletrain.train.run", "scaletrain.parallel",
            __name__]
mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def script_env() -> dict[str, str]:
    """The environment a test's subprocess (a script, `scaletrain launch`) runs in: this one's, without a
    launcher's rank variables, on loopback, one thread per process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _entry(rank: int, fn: Callable[..., Any], world: int, port: int, out: str, args: tuple,
           environ: dict[str, str]) -> None:
    os.environ.clear()  # the test's environment now, as spawn gives it (a forkserver's is from its own start)
    os.environ.update(environ, **loopback_env(rank, world, port))
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
    finally:
        if dist.is_initialized():  # free DDP wrappers first: see scaletrain.runtime.close
            from scaletrain.observe import flight

            flight.stop_all()  # a session the test left open: its watcher holds it (and its DDP wrapper)
            gc.collect()
            dist.destroy_process_group()
            gc.collect()
    torch.save(result, Path(out) / f"rank{rank}.pt")


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 180,
              start_method: str = "forkserver", store: dist.TCPStore | None = None) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; returns [result of rank 0, rank 1, ...]. start_method
    "spawn" gives each rank a fresh interpreter, for a test of what a process does from its start (its peak
    RSS, the malloc settings it read from its environment). ``store``: the agent's store, given to outlive the
    ranks (a job's rounds of workers, as torchrun's agent keeps its store across restarts); a new one by
    default."""
    store = store or dist.TCPStore("127.0.0.1", 0, world_size=world, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(fn, world, store.port, out, args, dict(os.environ)), nprocs=world,
                                 join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks still running after {timeout_s} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def trained_digits_job(settings: dict[str, Any], steps: int) -> Any:
    """Inside a rank: the Job that ``settings`` build on digits (this rank's process group, if any, from the
    launcher's variables), on its session (run dir: a new temporary directory unless given), after ``steps``
    training steps taken as scaletrain train takes them."""
    from scaletrain import runtime
    from scaletrain.config import load
    from scaletrain.data import digits
    from scaletrain.train.run import open_stepper, step

    cfg = load(None, {"run.dir": scratch_dir(), **settings})
    job, batches = open_stepper(cfg, runtime.init(cfg.dist), digits(0.2))
    for _ in range(steps):
        step(job, batches)
    return job
