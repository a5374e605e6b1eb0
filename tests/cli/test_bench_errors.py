"""Every bench mistake: exit code 2 and one line naming the flag, the value, what is allowed and the fix.
Never a traceback, and nothing started."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from warm import SCALETRAIN_M

from scaletrain.cli import main

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("argv, words", [
    (["bench", "throughput", "--recipe", "nope"],
     ["--recipe = 'nope'", "a built-in recipe (digits, gpt-stdlib, ", "fix: --recipe"]),
    (["bench", "scaling", "--recipe", "digitz"], ["--recipe = 'digitz'", "fix: --recipe digits"]),
    (["bench", "allreduce", "--sizes", "1XB"], ["--sizes = '1XB'", "expected sizes like 1KB", "fix: --sizes 1KB..256MB"]),
    (["bench", "allreduce", "--sizes", "8KB..1KB"], ["--sizes = '8KB..1KB'", "a <= b", "fix: --sizes 1KB..8KB"]),
    (["bench", "allreduce", "--sizes", "2B", "--nproc", "2"], ["--sizes = '2B'", "at least 8 bytes", "fix:"]),
    (["bench", "allreduce", "--nproc", "0"], ["--nproc = '0'", "integers >= 1", "fix: --nproc 2"]),
    (["bench", "scaling", "--nproc", "1,0"], ["--nproc = '1,0'", "integers >= 1", "fix: --nproc 1,2"]),
    (["bench", "allreduce", "--ops", "allreduce"], ["--ops = 'allreduce'", "all_reduce, all_gather", "fix: --ops all_reduce"]),
    (["bench", "allreduce", "--backend", "mpi"], ["--backend = 'mpi'", "one of auto, gloo, nccl", "fix: --backend"]),
    (["bench", "allreduce", "--iters", "0"], ["--iters = '0'", ">= 1", "fix: --iters 20"]),
    (["bench", "allreduce", "--size", "1KB"], ["unrecognized argument '--size'", "did you mean --sizes?"]),
    (["bench", "throughput", "--batch-sizes", "2,x"], ["--batch-sizes = '2,x'", "integers >= 1", "fix: --batch-sizes 2,4,64"]),
    (["bench", "throughput", "--devices", "tpu"], ["--devices = 'tpu'", "cpu, cuda, cuda:N", "fix: --devices cpu,cuda"]),
    (["bench", "throughput", "--train.max_steps=5"], ["train.max_steps = '5'", "use --batch-sizes, --steps"]),
    (["bench", "throughput", "--optim.lrr=1"], ["optim.lrr = '1' (command line)", "did you mean --optim.lr?"]),
    (["bench", "scaling", "--mode", "medium"], ["--mode = 'medium'", "one of weak, strong", "fix: --mode"]),
    (["bench", "scaling", "--recipe", "digits", "--mode", "strong", "--nproc", "1,2", "--train.global_batch=100",
      "--dist.device=cpu"],
     ["train.global_batch = 100", "32 x 2 = 64", "fix: --train.global_batch=64"]),
    (["bench", "scaling", "--json", "no/such/dir/out.json"], ["--json = 'no/such/dir/out.json'", "mkdir -p no/such/dir"]),
    (["bench", "scaling", "--plot", "out.jpg"], ["--plot = 'out.jpg'", ".png", "fix: --plot out.png"]),
    (["bench"], ["bench needs one of allreduce, throughput, scaling", "fix: scaletrain bench allreduce"]),
    (["bench", "fly"], ["invalid choice: 'fly'"]),
])
def test_bad_input_exits_2_with_one_line(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith("scaletrain: error: ")
    for word in words:
        assert word in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing was started or written


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
@pytest.mark.parametrize("argv, words", [
    (["bench", "throughput", "--devices", "cpu,cuda"],
     ["--devices = 'cpu,cuda'", "it has no CUDA device", "fix: --devices cpu"]),
    (["bench", "allreduce", "--backend", "nccl"], ["--backend = 'nccl'", "without CUDA", "fix: --backend gloo"]),
])
def test_asking_for_cuda_without_it(argv, words, capsys):
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and all(word in lines[0] for word in words), lines


ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "GLOO_SOCKET_IFNAME": "lo"}


@pytest.mark.parametrize("extra, words", [
    (["--batch-sizes", "4096"], ["--batch-sizes = 4096: expected a global batch",
                                 "no larger than the 1437 training samples", "fix: smaller --batch-sizes"]),
    (["--train.precision=fp16-mixed"], ["train.precision = 'fp16-mixed': expected fp32 or bf16-mixed on a CPU",
                                  "fix: --train.precision=bf16-mixed"]),
])
def test_mistakes_found_by_the_device_process_are_one_line(extra, words, tmp_path):
    """Found only in the per-device process (with the data loaded): still one line, no traceback."""
    proc = subprocess.run([*SCALETRAIN_M, "bench", "throughput", "--recipe", "digits",
                           "--devices", "cpu", "--steps", "1", "--warmup", "0", "--repeats", "1", *extra],
                          capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=180, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("scaletrain: error: ")
    for word in words:
        assert word in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
