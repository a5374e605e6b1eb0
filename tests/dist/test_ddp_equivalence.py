"""Data parallelism is the same math as one process with the whole batch.

2 ranks x batch b against 1 process x batch 2b (and 2 ranks x accumulation 2 x b/2), same seed, plain SGD
with momentum, no dropout, real data (digits): after 5 steps the parameters agree to 1e-6 relative
(measured with fused SGD: worst tensor 1.35e-7, and 1.13e-7 with accumulation). The only difference allowed
is float summation order (gradient averaging across ranks vs within a batch).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from scratch import scratch_dir
from spawn_ranks import run_ranks, trained_digits_job

from scaletrain import runtime
from scaletrain.config import load
from scaletrain.data import digits
from scaletrain.observe.console import Console
from scaletrain.train.run import _train as train_to_the_end
from scaletrain.train.run import open_stepper

STEPS = 5
BASE = {"model.name": "cnn", "model.dropout": 0.0, "optim.name": "sgd", "optim.lr": 0.1, "optim.momentum": 0.9,
        "dist.device": "cpu", "run.seed": 7}


def _train(rank: int, world: int, overrides: dict) -> dict:
    job = trained_digits_job({**BASE, **overrides}, STEPS)
    params = {k: v.detach().clone() for k, v in job.module.state_dict().items()}
    # the phase timer's DDP comm hook counts the buckets it hands to the all-reduce
    return {"params": params, "allreduces": job.st.timer.buckets, "accum": job.plan.accum_steps,
            "global_batch": job.plan.global_batch}


def _assert_same(got: dict, want: dict) -> float:
    worst = 0.0
    for name, ref in want.items():
        rel = ((got[name] - ref).norm() / ref.norm()).item()
        worst = max(worst, rel)
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-7)
    assert worst < 1e-6, worst
    return worst


def test_two_ranks_equal_one_process_with_twice_the_batch():
    single = _train(0, 1, {"data.batch_size": 32})
    ranks = run_ranks(_train, 2, {"data.batch_size": 16})
    assert single["global_batch"] == ranks[0]["global_batch"] == 32
    for r in ranks:
        _assert_same(r["params"], single["params"])
    assert torch.equal(ranks[0]["params"]["head.1.weight"], ranks[1]["params"]["head.1.weight"])  # in sync

    accum = run_ranks(_train, 2, {"data.batch_size": 8, "train.accum_steps": 2})
    assert accum[0]["global_batch"] == 32 and accum[0]["accum"] == 2
    for r in accum:
        _assert_same(r["params"], single["params"])
    # no_sync on the first micro-step: gradients are all-reduced once per optimizer step, as without accumulation
    assert accum[0]["allreduces"] == ranks[0]["allreduces"] > 0


def _count_collectives(rank: int, world: int) -> dict:
    cfg = load(None, {**BASE, "data.batch_size": 16, "train.max_steps": 12, "log.every": 4,
                      "run.dir": scratch_dir()})
    rt = runtime.init(cfg.dist)
    splits = digits(0.2)
    splits.eval = None
    job, _ = open_stepper(cfg, rt, splits)
    calls = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast", "all_gather_object")}
    for name, fn in real.items():
        setattr(dist, name, lambda *a, _fn=fn, _name=name, **k: (calls.append((_name, job.step)), _fn(*a, **k))[1])
    try:
        train_to_the_end(job, Console(False))
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    return {"calls": calls}


def test_the_loss_is_reduced_at_log_steps_only():
    """Besides DDP's gradient all-reduce (inside backward), the loop's only collective is one all_gather
    per log interval: loss, non-finite counters and the preemption flag travel together."""
    ranks = run_ranks(_count_collectives, 2)
    calls = ranks[0]["calls"]
    assert calls == ranks[1]["calls"]
    assert [c for c in calls if c[0] not in ("all_reduce", "all_gather_object")] == \
        [("all_gather", 4), ("all_gather", 8), ("all_gather", 12)]
    # DDP's gradient all-reduce (through the phase timer's hook): one bucket per step, at steps 0..11
    assert [c for c in calls if c[0] == "all_reduce"] == [("all_reduce", s) for s in range(12)]
    assert not [c for c in calls if c[0] == "all_gather_object"]  # the host names: once, as the session opened


class _WithBatchNorm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn, self.head = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.lin(x))))


def _bn_loop(cfg: dict, *, opened: bool = False) -> tuple[list[float], list[str]]:
    """_WithBatchNorm trained with SGD by a session loop of one's own under ``cfg``, its forward and loss inside
    st.autocast() when ``opened``: the step losses and the forward's output dtypes."""
    import scaletrain

    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    losses, dtypes = [], set()
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(_WithBatchNorm(), lambda p: torch.optim.SGD(p, lr=0.1))
        loader = st.loader((x, (x[:, 0] > 0).long()))
        while not st.done:
            for xb, yb in loader:
                with st.step():
                    with st.autocast() if opened else contextlib.nullcontext():
                        out = model(xb)
                        loss = torch.nn.functional.cross_entropy(out, yb)
                    dtypes.add(str(out.dtype))
                    st.backward(loss)
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.detach())
                if st.done:
                    break
    return [float(loss) for loss in losses], sorted(dtypes)


def _bn_run(run_dir: Path, steps: int) -> None:
    _bn_loop({"run.dir": str(run_dir), "train.max_steps": steps, "checkpoint.every": 2, "log.every": 2,
              "data.batch_size": 8, "debug.trace": True})


def _bn_resumed(rank: int, world: int, where: str) -> None:
    """A BatchNorm model under DDP: 4 steps straight; 2 steps, then resumed to 4 (three sessions in a row)."""
    _bn_run(Path(where) / "straight", 4)
    _bn_run(Path(where) / "parts", 2)
    if rank == 0:  # finished at 2; rank 0 decides the run directory, so it goes on from its checkpoint
        (Path(where) / "parts" / "summary.json").unlink()
    _bn_run(Path(where) / "parts", 4)


def test_a_batchnorm_model_under_ddp_is_loaded_as_saved_on_every_rank(tmp_path: Path) -> None:
    """verify-resume's check at the resume, on the traces: between steps rank 1's BatchNorm statistics are those
    of its own batch, and a checkpoint (rank 0's) gives it rank 0's; DDP hands every rank rank 0's at the next
    forward, so the state the next step runs with is the same (verify-resume said 'weights differ' on rank 1 of
    such a run, whose resume was exact)."""
    from scaletrain.train.verify import STATE_FIELDS, read_trace

    run_ranks(_bn_resumed, 2, str(tmp_path))
    straight, parts = read_trace(tmp_path / "straight"), read_trace(tmp_path / "parts")
    for rank in (0, 1):
        saved = next(r for r in straight[rank] if r.get("step") == 2 and "event" not in r)
        loaded = next(r for r in parts[rank] if r.get("event") == "resume")
        assert loaded["step"] == 2 and all(loaded[f] == saved[f] for f in STATE_FIELDS), (rank, loaded, saved)
        after = [r for r in parts[rank] if "event" not in r and r["step"] > 2]
        assert after == [r for r in straight[rank] if "event" not in r and r["step"] > 2], rank


def _precision_loops(rank: int, world: int, where: str) -> dict:
    """The same DDP loop two ways: bf16-mixed without st.autocast(), and inside it."""
    return {name: _bn_loop({"run.dir": str(Path(where) / name), "train.max_steps": 4, "checkpoint.every": 100,
                            "log.every": 2, "data.batch_size": 8, "train.precision": "bf16-mixed",
                            "train.progress": False}, opened=opened)
            for name, opened in (("bare", False), ("opened", True))}


def test_a_loop_of_ones_own_gets_the_runs_precision_without_opening_autocast(tmp_path: Path) -> None:
    """--train.precision=bf16-mixed under DDP was an autocast only a loop that opened st.autocast() got: one that
    did not trained in fp32, silently. The set-up model's forward now runs in the run's autocast when called
    outside one, its bf16 outputs handed back in fp32 (as Accelerate and Lightning Fabric do), so the loop
    computes what it computes inside st.autocast(), to the bit (in fp32 its losses differed from 1e-4 on);
    inside one nothing changes."""
    for found in run_ranks(_precision_loops, 2, str(tmp_path)):
        bare, opened = found["bare"], found["opened"]
        assert bare[1] == ["torch.float32"] and opened[1] == ["torch.bfloat16"]
        assert bare[0] == opened[0] and len(bare[0]) == 4
