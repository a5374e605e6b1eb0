"""`scaletrain train --parallel.pp`: the trainer's pipelined runs equal one process, and their checkpoints
resume at another layout, in both directions.

The built-in GPT (its head tied to the token embedding: under pp the last stage holds a copy, stored once in a
checkpoint under the embedding's name) and llama-tiny, fp32, AdamW with clipping, a global batch of 8
sequences throughout, 6 steps, a held-out evaluation of the same 8 sequences at steps 0 and 6:

- GPT: PP=2 under the interleaved schedule (4 stages of one block, rank 0 holding stages 0 and 2: the tied head
  on rank 1's stage 3) stopped after step 3, its DCP checkpoint resumed under TP=2 (a GPT pipeline's resumed by
  one process: test_gpt_pp_x_tp_equals_one_process);
- GPT: FSDP=2 stopped after step 3, resumed as PP=2 x DP=2 (GPipe) on 4 ranks, 4 rows per pipeline (its
  summary: the bubble measured on every rank, and the planner's model state of stage 0 against rank 0's);
- Llama: PP=2 x FSDP=2 x TP=2 on 8 ranks (each stage's matrices split over 2 ranks, sequence-parallel, and
  sharded over 2 more) stopped after step 3, resumed as PP=2 on 2 ranks with batches of 4 accumulated twice.

Sums differ in order only (micro-batch gradients accumulated, replicas' averaged), so the final weights, the
logged losses and the held-out losses agree with one process's to 1e-5. (The pipeline runner on its own:
tests/dist/test_pipeline.py.)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import safetensors.torch
import torch
from test_resume import losses, train

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pipeline_loop.py"
BIN = Path(sys.executable).parent

JOB = ["--train.max_steps=6", "--log.every=3", "--train.eval_batches=1", "--data.eval_batch_size=8",
       "--train.progress=false",
       "--checkpoint.every=3"]


def _evals(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval_loss"]) for r in records if r["kind"] == "eval"]


def _close(got: Path, want: Path) -> None:
    a = safetensors.torch.load_file(str(got / "model.safetensors"))
    b = safetensors.torch.load_file(str(want / "model.safetensors"))
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in b)
    assert worst < 1e-5, worst
    for mine, ref in ((losses(got), losses(want)), (_evals(got)[-1:], _evals(want)[-1:])):
        assert [s for s, _ in mine] == [s for s, _ in ref] and ref
        assert all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(mine, ref)), (mine, ref)


def _legs(tmp_path: Path, job: list[str], legs: list[list[str]], run: str) -> list[str]:
    said = []
    for leg in legs:
        code, out, err = train(*job, *leg, f"--run.dir={run}", cwd=tmp_path)
        assert code == 0, err[-3000:]
        said.append(out)
    return said


def test_gpt_pipelines_resume_under_tp_and_from_fsdp(tmp_path):
    gpt = ["gpt-stdlib", *JOB]
    _legs(tmp_path, gpt, [["--nproc", "1", "--data.batch_size=8"]], "one")
    said = _legs(tmp_path, gpt, [["--nproc", "2", "--parallel.pp=2", "--parallel.pp_schedule=interleaved",
                                  "--data.batch_size=8", "--chaos.interrupt_step=3"],
                                 ["--nproc", "2", "--parallel.tp=2", "--data.batch_size=8"]], "pp2-then-tp2")
    assert "parallel: pp 2 | pipeline interleaved x 2 stages per rank, 4 micro-batches of 2: bubble (p - 1)/(v m + " \
        "p - 1) = 11.1%" in said[0], said[0]
    assert "effective batch 8 = 8 per rank x 1 data-parallel rank x 1 accumulation" in said[0], said[0]
    # the pipeline's checkpoint holds the tied head once, under the embedding's name: tensor parallelism, whose
    # tied DTensor the state dict lists under both names, reads it from there (it asked DCP for head.weight)
    assert "resumed from" in said[1] and "step 3 of 6" in said[1] and "parallel.pp: 2 -> 1" in said[1], said[1]
    _close(tmp_path / "pp2-then-tp2", tmp_path / "one")
    said = _legs(tmp_path, gpt, [["--nproc", "2", "--parallel.strategy=fsdp", "--data.batch_size=4",
                                  "--chaos.interrupt_step=3"],
                                 ["--nproc", "4", "--parallel.pp=2", "--parallel.pp_schedule=gpipe",
                                  "--data.batch_size=4", "--data.eval_batch_size=4"]], "fsdp-then-pp2xdp2")
    assert "parallel: ddp x pp 2" in said[1] and "parallel.pp: 1 -> 2" in said[1], said[1]
    _close(tmp_path / "fsdp-then-pp2xdp2", tmp_path / "one")
    summary = json.loads((tmp_path / "fsdp-then-pp2xdp2" / "summary.json").read_text())
    pipeline = summary["pipeline"]
    assert pipeline["pp"] == 2 and pipeline["microbatches"] == 4 and pipeline["schedule"] == "gpipe"
    assert pipeline["bubble_formula"] == 1 / 5 and len(pipeline["rank_bubble"]) == 4
    assert all(0 < b < 1 for b in pipeline["rank_bubble"])  # measured on each rank, steps 5-6
    # the planner's model state of stage 0 (its blocks, the embeddings; plan/parallel.py) against rank 0's tensors
    assert abs(summary["plan_vs_actual"]["error"]["model_state"]) < 1e-3, summary["plan_vs_actual"]


def test_llama_pp_x_tp_x_fsdp_resumes_as_pp_with_accumulation(tmp_path):
    llama = ["llama-tiny", *JOB]
    _legs(tmp_path, llama, [["--nproc", "1", "--data.batch_size=8"]], "one")
    said = _legs(tmp_path, llama, [["--nproc", "8", "--parallel.pp=2", "--parallel.tp=2", "--parallel.strategy=fsdp",
                                    "--data.batch_size=4", "--data.eval_batch_size=4", "--chaos.interrupt_step=3"],
                                   ["--nproc", "2", "--parallel.pp=2", "--data.batch_size=4",
                                    "--train.global_batch=8"]], "mixed")
    assert "parallel: fsdp x pp 2 x tp 2 | FSDP: 1 x Block + root" in said[0], said[0]
    assert "effective batch 8 = 4 per rank x 2 data-parallel ranks x 1 accumulation" in said[0], said[0]
    assert "effective batch 8 = 4 per rank x 1 data-parallel rank x 2 accumulation" in said[1], said[1]
    _close(tmp_path / "mixed", tmp_path / "one")


def test_a_slow_stage_replica_is_named(tmp_path):
    """PP=2 x DP=2 with rank 3 (stage 1's second replica) 150 ms late into every step: every rank's step takes as
    long (the others wait for it in the pipeline and the replicas' all-reduce), so only its own work, the
    runner's busy time, tells it apart; it is named against its stage's other replica, rank 2, and no other
    rank is."""
    code, out, err = train("llama-tiny", "--nproc", "4", "--parallel.pp=2", "--data.batch_size=8",
                           "--train.max_steps=30", "--log.every=5", "--train.eval_batches=1", "--train.progress=false",
                           "--checkpoint.every=1000", "--chaos.delay_rank=3", "--chaos.delay_phase=compute",
                           "--chaos.delay_ms=150", "--run.dir=slow", cwd=tmp_path)
    assert code == 0, err[-3000:]
    assert "straggler: rank 3 (host" in out and "slower than ranks 2 (its pipeline stage's replicas)" in out, out
    summary = json.loads((tmp_path / "slow" / "summary.json").read_text())
    (found,) = summary["stragglers"]
    assert found["rank"] == 3 and found["phase"] == "compute" and found["peers"] == [2]
    assert 0.12 < found["slower_by_s"] < 0.3, found


def test_a_nan_on_a_stage_before_the_last_stops_the_pipeline_naming_it(tmp_path):
    """chaos.nan_rank on stage 0, which computes no loss: its gradients turn NaN as a NaN loss's would, the whole
    model's norm (summed over the stages) is NaN on every rank, the step is not applied, and the run stops at
    the log step naming rank 0 and step 2 (exit 1), as one process does."""
    code, _, err = train("llama-tiny", "--nproc", "2", "--parallel.pp=2", "--data.batch_size=8", "--train.max_steps=4",
                         "--log.every=2", "--train.eval_batches=1", "--train.progress=false", "--chaos.nan_rank=0",
                         "--chaos.nan_step=2", "--run.dir=nan", cwd=tmp_path)
    assert code == 1, err[-3000:]
    assert "training failed: non-finite loss on rank 0 at step 2; the step was not applied" in err, err[-3000:]


def test_a_loop_of_ones_own_runs_as_a_pipeline_and_equals_one_process(tmp_path):
    """examples/pipeline_loop.py (a session loop: st.setup returns the stage, st.pipeline_step runs it) on one
    process and as PP=2 through `scaletrain launch`: the same losses and final weights within 1e-5 after 20
    steps, and the loss falls below 0.8 x log(vocabulary) (the model learns to continue the sequences)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    short = ["--train.max_steps=20", "--log.every=10"]
    runs = {"one": [str(BIN / "python"), str(EXAMPLE)],
            "pp2": [str(BIN / "scaletrain"), "launch", "--nproc", "2", str(EXAMPLE), "--parallel.pp=2"]}
    for name, cmd in runs.items():
        proc = subprocess.run([*cmd, *short, f"--run.dir={tmp_path / name}"], capture_output=True, text=True,
                              env=env, timeout=240, check=False, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a = safetensors.torch.load_file(str(tmp_path / "pp2" / "model.safetensors"))
    b = safetensors.torch.load_file(str(tmp_path / "one" / "model.safetensors"))
    assert a.keys() == b.keys()
    # Micro-batches sum the gradients in another order. AdamW (lr 3e-3, eps 1e-8) turns that rounding of a
    # gradient summing to about 0 (~1e-10) into up to lr x 1e-10 / eps = 3e-5 a step on that one weight (seen:
    # 1.7e-5 on 1 of 254,528): all but 0.1% agree to 1e-6 and none is off by 1e-4; a wrong split is off by far more.
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in b])
    assert diff.max().item() < 1e-4 and (diff > 1e-6).float().mean().item() < 1e-3, diff.max().item()
    mine, ref = losses(tmp_path / "pp2"), losses(tmp_path / "one")
    assert [s for s, _ in mine] == [s for s, _ in ref] == [10, 20]
    assert all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(mine, ref)), (mine, ref)
    assert ref[-1][1] < 0.8 * math.log(64), ref


def test_a_loop_of_ones_own_runs_as_a_pipeline_of_fsdp_ranks(tmp_path):
    """The example's second documented command, 2 stages x FSDP over 2 ranks each: e08dd1f gave the set-up
    models DDP's sync switches but not a pipeline stage, whose FSDP forward then read the missing switch
    ("'FSDP_LlamaStage' object has no attribute 'require_backward_grad_sync'") at the first step."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([str(BIN / "scaletrain"), "launch", "--nproc", "4", str(EXAMPLE), "--parallel.pp=2",
                           "--parallel.strategy=fsdp", "--train.max_steps=4", "--log.every=2",
                           f"--run.dir={tmp_path / 'ppfsdp'}"], capture_output=True, text=True, env=env, timeout=240,
                          check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s for s, _ in losses(tmp_path / "ppfsdp")] == [2, 4]


def test_gpt_pp_x_tp_equals_one_process(tmp_path):
    """The built-in GPT as 2 stages x tensor parallelism 2 (4 ranks): its tied embedding and head on different
    stages, each split by the same vocabulary rows, their gradients summed shard by shard; the weights, losses
    and held-out loss after 6 steps as one process has them (1e-5), and it resumes at pp 1."""
    gpt = ["gpt-stdlib", *JOB]
    _legs(tmp_path, gpt, [["--nproc", "1", "--data.batch_size=8"]], "one")
    said = _legs(tmp_path, gpt, [["--nproc", "4", "--parallel.pp=2", "--parallel.tp=2", "--data.batch_size=8",
                                  "--chaos.interrupt_step=3"],
                                 ["--nproc", "1", "--data.batch_size=8"]], "pp2xtp2")
    assert "parallel: pp 2 x tp 2" in said[0], said[0]
    assert "parallel.pp: 2 -> 1" in said[1] and "parallel.tp: 2 -> 1" in said[1], said[1]
    _close(tmp_path / "pp2xtp2", tmp_path / "one")
