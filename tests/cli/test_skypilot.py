"""scaletrain skypilot: the SkyPilot task is valid YAML with the layout SkyPilot needs, its `run` script trains the
job when given SkyPilot's variables (one node of 2 CPU "GPUs" here), and bad input is one line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from scaletrain.cli import main

yaml = pytest.importorskip("yaml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_task_runs_one_agent_per_node_with_the_run_in_the_bucket(tmp_path: Path, capsys) -> None:
    out = tmp_path / "task.yaml"
    port = _free_port()
    assert main(["skypilot", "digits", "--nodes", "1", "--gpus", "T4:2", "--spot", "--mount", str(tmp_path / "bucket"),
                 "--port", str(port), "--setup", "true", "--out", str(out), "--train.max_steps=4", "--log.every=2",
                 "--train.progress=false", "--train.eval_batches=1"]) == 0
    task = yaml.safe_load(out.read_text())
    assert task["num_nodes"] == 1 and task["resources"]["accelerators"] == "T4:2"
    assert task["resources"]["use_spot"] is True and task["file_mounts"][str(tmp_path / "bucket")]["mode"] == "MOUNT"
    assert "--checkpoint.every=500" in task["run"] and '--dist.rdzv_id="$SKYPILOT_TASK_ID"' in task["run"]
    assert "# plan: T4 is not in the planner's catalog" in out.read_text()
    assert subprocess.run(["bash", "-n"], input=task["run"], text=True, check=False).returncode == 0
    env = {**os.environ, "SKYPILOT_NODE_IPS": "127.0.0.1\n", "SKYPILOT_NUM_NODES": "1",
           "SKYPILOT_NUM_GPUS_PER_NODE": "2", "SKYPILOT_TASK_ID": "sky-test-1", "GLOO_SOCKET_IFNAME": "lo",
           "OMP_NUM_THREADS": "1", "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    done = subprocess.run(["bash", "-c", task["run"]], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "bucket" / "digits" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert (tmp_path / "bucket" / "digits" / "checkpoints").is_dir()  # the last step saved: a restart resumes it


def test_a_known_gpu_gets_the_planners_time_and_cost(capsys) -> None:
    assert main(["skypilot", "digits", "--nodes", "2", "--gpus", "H100:8", "--price", "2.5"]) == 0
    text = capsys.readouterr().out
    plan = next(line for line in text.splitlines() if line.startswith("# plan ("))
    assert "scaletrain plan digits --gpu h100 --nproc 8 --nnodes 2 --price 2.5" in plan
    assert "GPU-hours" in plan and "at $2.5/GPU-hour" in plan


@pytest.mark.parametrize(("argv", "words"), [
    (["--gpus", "H100"], "--gpus = 'H100': expected KIND:COUNT"),
    (["--run.dir=x"], "--run.dir = 'x': the task sets it"),
    (["--price", "-1"], "--price = '-1': expected US dollars"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], words: str, capsys) -> None:
    assert main(["skypilot", "digits", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_skypilots_a100_is_planned_as_the_40_gb_one(capsys) -> None:
    """SkyPilot names the 40 GB A100 `A100` and the other `A100-80GB`; the plan took `A100` for the 80 GB one
    and recommended DDP for gpt2-1.5b on 8 of them, which does not fit in 40 GB."""
    assert main(["skypilot", "gpt2-1.5b", "--gpus", "A100:8"]) == 0
    plan = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("# plan ("))
    assert "--gpu a100-40gb" in plan and "fsdp" in plan


def test_short_runs_keep_their_hours() -> None:
    """A 0.13 h run on 3 GPUs said '(0 GPU-hours)'."""
    from scaletrain.cli.skypilot import _hours

    assert [_hours(h) for h in (0.39, 0.13, 3.7, 30.4, 1234.5, 5.6e-8)] == \
        ["0.39", "0.13", "3.7", "30", "1,234", "under 0.01"]
