"""`scaletrain doctor` end to end: the self-test really runs 2 Gloo ranks on loopback (started through
torchrun's API, or joining a torchrun job's own world) and checks their all-reduce; findings print one line
each; exit codes say whether the setup can work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spawn_ranks import free_port
from warm import SCALETRAIN

from scaletrain.cli import main
from scaletrain.cluster.doctor import _expected

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun")] if (BIN / "torchrun").exists() else [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT_S = 180
_CLEAR = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
          "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in _CLEAR and not k.startswith("TORCHELASTIC_")}
    clean.update({"PYTHONUNBUFFERED": "1", "COLUMNS": "200", "OMP_NUM_THREADS": "1", **env})
    return subprocess.run(cmd, check=False, cwd=REPO, env=clean, capture_output=True, text=True, timeout=TIMEOUT_S)


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"


def test_expected_sum_is_the_sum_of_what_the_ranks_send() -> None:
    sent = [torch.arange(6, dtype=torch.float32) + r * 1000 for r in range(3)]
    assert torch.equal(_expected(6, 3), sum(sent))


def test_self_test_runs_two_gloo_ranks_and_checks_the_sum(documented) -> None:
    """docs/observe.md's `scaletrain doctor --json`, as the docs tour ran it."""
    ran = documented("scaletrain doctor --json").find("scaletrain doctor --json")
    assert ran.proc is not None and ran.proc.returncode == 0, ran.problem or ran.note
    report = json.loads(ran.proc.stdout)
    result = report["self_test"]
    assert result["ok"] is True and result["result_correct_on_all_ranks"] is True, result
    assert (result["world_size"], result["backend"], result["device"]) == (2, "gloo", "cpu")
    assert len(result["hosts"]) == 2
    assert result["bytes"] == 8 * 2**20 and result["seconds_per_op"] > 0
    assert result["busbw_gb_per_s"] == pytest.approx(result["algbw_gb_per_s"])  # 2(W-1)/W = 1 for W = 2
    assert report["findings"] == []
    assert report["facts"]["gloo_available"] is True and report["facts"]["python"]


def test_under_torchrun_the_self_test_uses_the_launchers_world() -> None:
    proc = _run([*TORCHRUN, "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "scaletrain",
                 "doctor", "--json"], GLOO_SOCKET_IFNAME="lo", CUDA_VISIBLE_DEVICES="")  # 2 CPU ranks anywhere
    assert proc.returncode == 0, _explain(proc)
    report = json.loads(proc.stdout)  # one JSON object: only local rank 0 reports
    env = report["facts"]["env"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("0", "2", "2")
    assert report["self_test"]["ok"] is True and report["self_test"]["world_size"] == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA_VISIBLE_DEVICES=0,1 is a finding only without GPUs")
def test_findings_are_one_line_each_with_the_fix() -> None:
    proc = _run([*SCALETRAIN, "doctor", "--no-self-test"], CUDA_VISIBLE_DEVICES="0,1", OMP_NUM_THREADS="512")
    assert proc.returncode == 0, _explain(proc)  # warnings: the setup works, worse than it could
    lines = proc.stdout.splitlines()
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert len(warnings) == 2, proc.stdout
    assert any("CUDA_VISIBLE_DEVICES='0,1' is set but torch sees no GPU" in w for w in warnings)
    assert any(w.startswith("warning: OMP_NUM_THREADS=512 threads on") and "; fix: OMP_NUM_THREADS=" in w
               for w in warnings)
    assert "self-test" not in proc.stdout and "CUDA_VISIBLE_DEVICES" in proc.stdout


def test_an_error_finding_exits_1() -> None:
    proc = _run([*SCALETRAIN, "doctor", "--no-self-test"], GLOO_SOCKET_IFNAME="no-such-if0")
    assert proc.returncode == 1, _explain(proc)
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("error: ")]
    assert "GLOO_SOCKET_IFNAME='no-such-if0' matches no network interface here" in line and "; fix: " in line


def test_a_stray_argument_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--selftest"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("scaletrain: error: ") and "--selftest" in line and "; fix: " in line


def test_a_launchers_variables_left_in_the_shell_are_a_finding_not_a_traceback() -> None:
    """`RANK=1 WORLD_SIZE=2 scaletrain doctor`: the self-test joined a group that cannot form and died on
    KeyError 'LOCAL_RANK'; now the finding says why, the self-test is not run, and the exit code is 1."""
    proc = _run([*SCALETRAIN, "doctor", "--json"], RANK="1", WORLD_SIZE="2")
    assert proc.returncode == 1, _explain(proc)
    assert "Traceback" not in proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    [finding] = [f for f in report["findings"] if f["level"] == "error"]
    assert finding["check"] == "launcher-partial" and "MASTER_ADDR, MASTER_PORT not" in finding["message"]
    assert report["self_test"]["ok"] is False and report["self_test"]["error"].startswith("not run:")
