"""`scaletrain train --parallel.tp`: the trainer's tensor-parallel runs equal one process, and a checkpoint of
FSDP x TP resumes as FSDP alone.

llama-tiny, fp32, AdamW with clipping, a global batch of 8 sequences throughout, 6 steps: one process (batch
8); TP=2 on 2 ranks (one data-parallel rank: both read the 8); FSDP=2 x TP=2 on 4 ranks stopped after step 3
(batch 4 per data-parallel rank), its DCP checkpoint resumed by FSDP=2 on 2 ranks (no TP) for steps 4-6. The
sums differ in order only (halves of row-parallel matmuls added across ranks), so the final weights agree with
the one process's to 1e-5 (measured worst: see the assertions' messages); the logged losses to 1e-5 too.
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


def test_tp_and_fsdp_x_tp_resumed_as_fsdp_equal_one_process(tmp_path):
    runs = {"one": ["--nproc", "1", "--data.batch_size=8"],
            "tp": ["--nproc", "2", "--parallel.tp=2", "--data.batch_size=8"]}
    for name, args in runs.items():
        code, out, err = train(*JOB, *args, f"--run.dir={name}", cwd=tmp_path)
        assert code == 0, err[-3000:]
    assert "parallel: tp 2" in out and "8 per rank x 1 data-parallel rank x 1 accumulation" in out, out
    _close(tmp_path / "tp", tmp_path / "one")
    legs = [["--nproc", "4", "--parallel.tp=2", "--parallel.strategy=fsdp", "--chaos.interrupt_step=3"],
            ["--nproc", "2", "--parallel.strategy=fsdp"]]
    for leg in legs:
        code, out, err = train(*JOB, *leg, "--data.batch_size=4", "--run.dir=mixed", cwd=tmp_path)
        assert code == 0, err[-3000:]
    assert "resumed from" in out and "step 3" in out, out
    _close(tmp_path / "mixed", tmp_path / "one")


def test_gpt_tp2_checkpoint_resumes_at_tp1(tmp_path):
    """The built-in GPT under TP=2 (its fused query/key/value split part by part, the tied head split by
    vocabulary), stopped after step 3; its DCP checkpoint resumed by one process: the same weights as one
    process throughout, within 1e-5."""
    gpt = ["gpt-stdlib", *JOB[1:], "--data.batch_size=8"]
    code, _, err = train(*gpt, "--nproc", "1", "--run.dir=one", cwd=tmp_path)
    assert code == 0, err[-3000:]
    for leg in (["--nproc", "2", "--parallel.tp=2", "--chaos.interrupt_step=3"], ["--nproc", "1"]):
        code, out, err = train(*gpt, *leg, "--run.dir=mixed", cwd=tmp_path)
        assert code == 0, err[-3000:]
    assert "resumed from" in out and "parallel.tp: 2 -> 1" in out, out
    _close(tmp_path / "mixed", tmp_path / "one")
