"""`scaletrain verify-resume`: identical for the built-in recipe, and each part of the state it checks is
caught when the resume leaves it out (debug.skip_restore through --drop)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from warm import SCALETRAIN_M

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_key, None)
JOB = ["digits", "--steps", "12", "--at", "5", "--model.dropout=0.2", "--train.log_every=3"]


def verify(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([*SCALETRAIN_M, "verify-resume", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=300, check=False)


def test_the_digits_recipe_resumes_bit_for_bit(documented):
    """The README's `scaletrain verify-resume digits --nproc 2`, as the docs tour ran it (4 steps, at step 2)."""
    ran = documented("scaletrain verify-resume digits --nproc 2").find("scaletrain verify-resume digits --nproc 2")
    assert ran.proc is not None and ran.proc.returncode == 0, ran.problem or ran.note
    assert "digits on 2 rank(s), 4 steps, interrupted after step 2 (epoch 1, 2 of 89 steps in)" in ran.proc.stdout
    assert "identical: interrupted after step 2 and resumed, the run matches the uninterrupted one bit for bit " \
           "at every one of 4 steps on all 2 rank(s)" in ran.proc.stdout


def test_a_part_left_out_of_the_resume_is_named(tmp_path):
    """Through the real runs for one part (RNG, with dropout on); tests/unit/test_verify_compare.py tells every
    part apart on traces."""
    proc = verify(*JOB, "--drop", "rng", "--work-dir", str(tmp_path / "w"), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "interrupted after step 5 (epoch 1, 5 of 44 steps in), resumed without: rng" in proc.stdout
    assert "diverged right after loading the checkpoint of step 5 on rank 0: RNG differs" in proc.stdout, \
        proc.stdout[-2000:]
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["resumed", "straight"]  # kept when asked


@pytest.mark.parametrize(("args", "words"), [
    (["--steps", "12", "--at", "12"], "--at 12: expected a step in [1, 11]"),
    (["--steps", "5000"], "--steps 5000: the job has only 880 steps"),
    (["--drop", "gradients"], ("--drop = 'gradients': expected a comma-separated subset of weights, optimizer, "
                               "rng, data, scheduler; fix: --drop rng")),  # it named debug.skip_restore, never typed
    (["--steps", "x"], "--steps = 'x': expected an integer >= 0"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, words, capsys, monkeypatch):
    from scaletrain.cli import main  # in this process: the checks come before any run starts

    monkeypatch.chdir(tmp_path)
    assert main(["verify-resume", "digits", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "fix:" in lines[0], lines


STREAM = """import sys, torch, scaletrain
from torch.utils.data import IterableDataset
class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(200):
            x = torch.randn(8, generator=g)
            yield x, int(x.sum() > 0)
scaletrain.fit(lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2)),
               Stream(), config={'train.progress': False, 'data.batch_size': 8}, argv=sys.argv[1:])
"""


def test_a_stream_resumes_bit_for_bit_across_the_end_of_a_pass(tmp_path):
    """200 items at 8 x accumulation 2 a step: 12 steps a pass. Stopped after step 10 and resumed, the run reads
    the pass again, skips what it had consumed, and crosses into the second pass as the straight run did."""
    (tmp_path / "stream.py").write_text(STREAM)
    proc = verify("stream.py", "--steps", "16", "--at", "10", "--train.max_steps=16", "--train.accum_steps=2",
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "identical: interrupted after step 10 and resumed, the run matches the uninterrupted one bit for bit " \
           "at every one of 16 steps" in proc.stdout, proc.stdout


OWN_ARGS = """import argparse, sys, torch, scaletrain
parser = argparse.ArgumentParser()
parser.add_argument("width", type=int)
args, rest = parser.parse_known_args()
torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(96, args.width), torch.randn(96, 1))
with scaletrain.session({"data.batch_size": 8, "train.progress": False}, argv=rest) as st:
    model, opt = st.setup(torch.nn.Linear(args.width, 1), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    assert args.width == 5, args.width
    loader = st.loader(data)
    while not st.done:
        for x, y in loader:
            with st.step():
                opt.zero_grad()
                st.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
            if st.done:
                break
"""


def test_a_scripts_own_arguments_go_after_a_double_dash(tmp_path):
    """A script with a positional argument of its own (argparse's, the rest to the session): what follows --
    reaches it as it is, in all three runs; before, the positional was taken for a bad --section.key."""
    (tmp_path / "own.py").write_text(OWN_ARGS)
    proc = verify("own.py", "--steps", "6", "--at", "3", "--", "5", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "at every one of 6 steps on all 1 rank(s)" in proc.stdout, proc.stdout


@pytest.mark.parametrize(("script", "words"), [
    # a loop of its own with no session: nothing traced, and comparing nothing said "identical ... 0 rank(s)"
    ("import torch\nm = torch.nn.Linear(4, 1)\nm(torch.randn(2, 4)).sum().backward()\n",
     ["ran to its end but traced no step", "fix: scaletrain.session() or fit() without argv (or argv=sys.argv[1:])"]),
    # a failure that prints nothing: the line said "failed (exit 3): ;" and "make `python x.py ...` work first"
    ("import sys\nsys.exit(3)\n", ["failed (exit 3): it printed nothing",
                                   "fix: make `python job.py --chaos.interrupt_step=4 --run.dir="]),
])
def test_a_script_that_cannot_be_verified_is_one_line(tmp_path, script, words):
    (tmp_path / "job.py").write_text(script)
    proc = verify("job.py", "--steps", "4", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
