"""What --parallel.overlap changes, counted rather than timed: when each bucket's all-reduce starts.

With overlap (DDP's way) a bucket's all-reduce starts as soon as backward has filled it, while backward goes on
computing the gradients of the layers below; with ``--parallel.overlap=false`` every all-reduce is held until
the last bucket is ready, as if DDP did not overlap. The order of "bucket ready" and "all-reduce started" is
exact and the same on every machine, so it is asserted here; what the overlap saves in time depends on the
machine and is measured by ``benchmarks/ddp_bucket.py --overlap both`` (RESULTS.md section 7), never asserted.
Both modes are the same arithmetic: the parameters after the steps are bitwise equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from scratch import scratch_dir
from spawn_ranks import run_ranks

STEPS = 3  # DDP's first step runs with one 1 MB first bucket; it rebuilds buckets of bucket_mb after it


def _events(rank: int, world: int, overlap: bool) -> dict:
    from scaletrain import runtime
    from scaletrain.config import load
    from scaletrain.data import digits
    from scaletrain.train.run import open_stepper, step

    cfg = load(None, {"model.name": "cnn", "model.dropout": 0.0, "optim.name": "sgd", "optim.lr": 0.1,
                      "dist.device": "cpu", "run.seed": 7, "data.batch_size": 16,
                      "parallel.bucket_mb": 0.01, "parallel.overlap": overlap,
                      "run.dir": scratch_dir()})
    job, batches = open_stepper(cfg, runtime.init(cfg.dist), digits(0.2))
    events: list[str] = []
    timer = job.st.timer
    ready = timer.bucket_ready  # the comm hook calls it as each bucket is filled, before anything else
    timer.bucket_ready = lambda: (events.append("ready"), ready())[1]
    real = dist.all_reduce  # DDP's allreduce_hook looks it up on torch.distributed at each call
    dist.all_reduce = lambda *a, **k: (events.append("start"), real(*a, **k))[1]
    try:
        for _ in range(STEPS):
            events.append("step")
            step(job, batches)
    finally:
        dist.all_reduce = real
    return {"events": events, "params": {k: v.detach().clone() for k, v in job.module.state_dict().items()}}


def _steps(events: list[str]) -> list[list[str]]:
    """The events of each step, the collectives of the step's bookkeeping left out (they follow the buckets)."""
    out: list[list[str]] = []
    for e in events:
        if e == "step":
            out.append([])
        else:
            out[-1].append(e)
    return out


def test_overlap_starts_each_all_reduce_during_backward_and_false_holds_them_to_the_end():
    with_overlap = run_ranks(_events, 2, True)
    held = run_ranks(_events, 2, False)
    for rank in range(2):
        on, off = _steps(with_overlap[rank]["events"]), _steps(held[rank]["events"])
        assert len(on) == len(off) == STEPS
        assert on[0] == off[0] == ["ready", "start"]  # the first step: the whole CNN in DDP's first bucket
        for a, b in zip(on[1:], off[1:]):
            n = a.count("ready")
            assert n == b.count("ready") == 3, (a, b)  # 0.01 MB buckets (a larger tensor gets one of its own)
            # overlap: bucket k's all-reduce starts before bucket k+1 is ready, for every k
            assert a[:2 * n] == ["ready", "start"] * n, a
            # held: not one all-reduce starts before the last bucket is ready, then all of them do
            assert b[:2 * n] == ["ready"] * n + ["start"] * n, b
        assert with_overlap[rank]["params"].keys() == held[rank]["params"].keys()
        for name, value in with_overlap[rank]["params"].items():
            assert torch.equal(value, held[rank]["params"][name]), name  # the same sums, bit for bit


def _callbacks(rank: int, world: int, overlap: bool) -> list[tuple[int, bool]]:
    """(native thread id, whether that thread's Python state was there from an earlier callback) per bucket."""
    import threading

    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from scaletrain import runtime
    from scaletrain.config import DistConfig
    from scaletrain.observe import timing

    rt = runtime.init(DistConfig(device="cpu"))
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]), bucket_cap_mb=0.01)
    assert timing.attach_comm_hook(model, timing.StepTimer(torch.device("cpu")), overlap=overlap)
    seen = threading.local()  # per Python thread state: gone when a thread's state was dropped and made again
    calls: list[tuple[int, bool]] = []
    handed = timing._handed

    def recorded(value):
        calls.append((threading.get_native_id(), getattr(seen, "yes", False)))
        seen.yes = True
        return handed(value)

    timing._handed = recorded
    try:
        for _ in range(10):
            model(torch.randn(8, 64)).sum().backward()
    finally:
        timing._handed = handed
        runtime.close(rt)
    main = threading.get_native_id()
    return [(tid, kept) for tid, kept in calls if tid != main]


def test_gloo_threads_keep_the_python_state_a_buckets_callback_was_given():
    """A bucket's all-reduce ends in a callback on one of Gloo's threads. Each used to get a Python thread state
    made for it and dropped after it, every bucket of every step; a fork() while one was being made (a DataLoader
    starting its workers after a step) left a child hung inside os.fork for good (8 of 18,000 such forks with
    torch's own allreduce_hook, 0 of 18,000 with ours: benchmarks/fork_after_step.py, RESULTS.md section 18).
    The state is now made once per thread and kept: every callback after a thread's first finds the thread-local
    value the first one set (without the fix, none of them does)."""
    for overlap in (True, False):
        for rank, calls in enumerate(run_ranks(_callbacks, 2, overlap)):
            later = [kept for i, (tid, kept) in enumerate(calls) if any(t == tid for t, _ in calls[:i])]
            assert len(later) >= 10, (overlap, rank, calls)  # 8 buckets x 10 steps, mostly on Gloo's threads
            assert all(later), (overlap, rank, calls)
