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
from spawn_ranks import run_ranks

STEPS = 3  # DDP's first step runs with one 1 MB first bucket; it rebuilds buckets of bucket_mb after it


def _events(rank: int, world: int, overlap: bool) -> dict:
    import tempfile

    from scaletrain import runtime
    from scaletrain.config import load
    from scaletrain.data import digits
    from scaletrain.train.run import open_stepper, step

    cfg = load(None, {"model.name": "cnn", "model.dropout": 0.0, "optim.name": "sgd", "optim.lr": 0.1,
                      "dist.device": "cpu", "run.seed": 7, "data.batch_size": 16,
                      "parallel.bucket_mb": 0.01, "parallel.overlap": overlap,
                      "run.dir": tempfile.mkdtemp(prefix="scaletrain-test-")})
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
