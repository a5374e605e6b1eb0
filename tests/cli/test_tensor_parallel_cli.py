"""`scaletrain train --parallel.tp`: the trainer's tensor-parallel runs equal one process, and their checkpoints
resume at another layout (FSDP x TP as FSDP alone, TP=2 as one process).

llama-tiny, fp32, AdamW with clipping, a global batch of 8 sequences throughout, 6 steps: one process (batch
8); FSDP=2 x TP=2 on 4 ranks stopped after step 3 (batch 4 per data-parallel rank), its DCP checkpoint resumed
by FSDP=2 on 2 ranks (no TP) for steps 4-6. And gpt-stdlib: FSDP=2 x TP=2 on 4 ranks stopped after step 3,
resumed by one process. The sums differ in order only (halves of row-parallel
matmuls added across ranks), so the final weights and the logged losses agree with one process's to 1e-5.
(TP=2 alone against one process, both models: tests/dist/test_tensor_parallel.py.)
"""

from __future__ import annotations

from pathlib import Path

import safetensors.torch
import torch
from test_resume import losses, train

JOB = ["llama-tiny", "--train.max_steps=6", "--log.every=3", "--train.eval_batches=1", "--train.progress=false",
       "--checkpoint.every=3"]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(run / "model.safetensors"))


def _close(got: Path, want: Path) -> float:
    a, b = _weights(got), _weights(want)
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in b)
    assert worst < 1e-5, worst
    assert [s for s, _ in losses(got)] == [s for s, _ in losses(want)] == [3, 6]
    for (_, x), (_, y) in zip(losses(got), losses(want)):
        assert abs(x - y) < 1e-5
    return worst


def test_fsdp_x_tp_resumed_as_fsdp_equals_one_process(tmp_path):
    code, _, err = train(*JOB, "--nproc", "1", "--data.batch_size=8", "--run.dir=one", cwd=tmp_path)
    assert code == 0, err[-3000:]
    legs = [["--nproc", "4", "--parallel.tp=2", "--parallel.strategy=fsdp", "--chaos.interrupt_step=3"],
            ["--nproc", "2", "--parallel.strategy=fsdp"]]
    said = []
    for leg in legs:
        code, out, err = train(*JOB, *leg, "--data.batch_size=4", "--run.dir=mixed", cwd=tmp_path)
        assert code == 0, err[-3000:]
        said.append(out)
    assert "parallel: fsdp x tp 2" in said[0], said[0]
    assert "effective batch 8 = 4 per rank x 2 data-parallel ranks x 1 accumulation" in said[0], said[0]
    assert "resumed from" in said[1] and "step 3" in said[1], said[1]
    _close(tmp_path / "mixed", tmp_path / "one")


def test_gpt_fsdp_x_tp_checkpoint_resumes_at_one_process(tmp_path):
    """The built-in GPT under FSDP=2 x TP=2 on 4 ranks (its fused query/key/value split part by part over tp and
    by columns over dp_shard, its bias whole, the tied head split by vocabulary), stopped after step 3; its DCP
    checkpoint resumed by one process: the same weights and losses as one process throughout, within 1e-5; and the
    weights a whole FSDP x TP run exports too."""
    gpt = ["gpt-stdlib", *JOB[1:]]
    code, _, err = train(*gpt, "--nproc", "1", "--data.batch_size=8", "--run.dir=one", cwd=tmp_path)
    assert code == 0, err[-3000:]
    legs = [["--nproc", "4", "--parallel.tp=2", "--parallel.strategy=fsdp", "--data.batch_size=4",
             "--chaos.interrupt_step=3"], ["--nproc", "1", "--data.batch_size=8"]]
    said = []
    for leg in legs:
        code, out, err = train(*gpt, *leg, "--run.dir=mixed", cwd=tmp_path)
        assert code == 0, err[-3000:]
        said.append(out)
    assert "parallel: fsdp x tp 2" in said[0], said[0]
    assert "resumed from" in said[1] and "parallel.tp: 2 -> 1" in said[1], said[1]
    _close(tmp_path / "mixed", tmp_path / "one")
    # and a whole FSDP x TP run's exported weights, gathered from both splits, are one process's
    code, _, err = train(*gpt, *legs[0][:-1], "--run.dir=whole", cwd=tmp_path)
    assert code == 0, err[-3000:]
    _close(tmp_path / "whole", tmp_path / "one")


def test_a_data_straggler_within_a_tp_group_is_named(tmp_path):
    """TP=2 on 2 ranks, rank 1 150 ms late reading every batch: both ranks' steps take as long (rank 0 waits for
    it in the first tensor-parallel collective of forward), so only the time before forward starts, pre_comm,
    tells them apart: rank 1 is named, in the data phase, and rank 0 is not."""
    import json

    code, out, err = train("llama-tiny", "--nproc", "2", "--parallel.tp=2", "--data.batch_size=8",
                           "--train.max_steps=30", "--log.every=5", "--train.eval_batches=1", "--train.progress=false",
                           "--checkpoint.every=1000", "--chaos.delay_rank=1", "--chaos.delay_phase=data",
                           "--chaos.delay_ms=150", "--run.dir=slow", cwd=tmp_path)
    assert code == 0, err[-3000:]
    assert "straggler: rank 1 (host" in out, out
    (found,) = json.loads((tmp_path / "slow" / "summary.json").read_text())["stragglers"]
    assert found["rank"] == 1 and found["phase"] == "data"
    assert 0.12 < found["slower_by_s"] < 0.3, found


def test_a_compute_straggler_within_a_tp_group_is_named(tmp_path):
    """TP=2 on 2 ranks, rank 1 150 ms late between forward and backward of every step: the two ranks' phase times
    are alike (rank 0 waits inside backward's collectives), but rank 1 issues the group's collectives later
    (torch's Flight Recorder keeps when: observe/arrivals.py): it is named, in phase compute, by about 150 ms."""
    import json

    code, out, err = train("llama-tiny", "--nproc", "2", "--parallel.tp=2", "--data.batch_size=8",
                           "--train.max_steps=30", "--log.every=5", "--train.eval_batches=1", "--train.progress=false",
                           "--checkpoint.every=1000", "--chaos.delay_rank=1", "--chaos.delay_phase=compute",
                           "--chaos.delay_ms=150", "--run.dir=slow", cwd=tmp_path)
    assert code == 0, err[-3000:]
    assert "straggler: rank 1 (host" in out and "tensor-parallel group" in out, out
    (found,) = json.loads((tmp_path / "slow" / "summary.json").read_text())["stragglers"]
    assert found["rank"] == 1 and found["phase"] == "compute"
    assert 0.12 < found["slower_by_s"] < 0.2, found
