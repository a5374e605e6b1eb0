"""A checkpoint whose files match its manifest but whose contents do not load (a planted or damaged DCP index,
tensors of the wrong shape) is treated as a hash failure is: one warning naming the file, moved aside, the
previous checkpoint used; `checkpoint inspect` says "damaged". A model that changed is not damage: then every
checkpoint misfits, and resuming is an error that moves nothing."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from warm import SCALETRAIN_M

from scaletrain.checkpoint import commit
from scaletrain.cli import main
from scaletrain.config import load
from scaletrain.errors import CheckpointError
from scaletrain.train.checkpointing import latest_usable
from scaletrain.train.run import run

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "GLOO_SOCKET_IFNAME": "lo",
       "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_key, None)
# 12 steps, saved every 4; stopped at step 8, the run resumes from step-00000008 unless it is damaged
JOB = ["digits", "--train.max_steps=12", "--checkpoint.every=4", "--checkpoint.keep=0",
       "--train.progress=false", "--run.dir=run"]
FSDP = ["--nproc", "2", "--parallel.strategy=fsdp"]


def scaletrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*SCALETRAIN_M, *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=240, check=False)


def inspect(path: str, capsys, *flags: str) -> tuple[int, str]:
    code = main(["checkpoint", "inspect", path, *flags])
    return code, capsys.readouterr().out


def replace_file(ckpt: Path, name: str, data: bytes) -> None:
    """Write ``name`` and rewrite the manifest to match it: the hashes are fine, the contents are not."""
    (ckpt / name).write_bytes(data)
    manifest = json.loads((ckpt / commit.MANIFEST).read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / commit.MANIFEST).write_text(json.dumps(manifest))


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # unpickling it runs os.system
        return os.system, (f"touch {self.marker}",)


def warnings_of(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("warning:")]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """An FSDP run on 2 ranks (DCP checkpoints at steps 4 and 8), stopped at step 8."""
    work = tmp_path_factory.mktemp("fsdp")
    done = scaletrain("train", *JOB, *FSDP, "--chaos.interrupt_step=8", cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [s for s, _ in commit.committed(work / "run" / "checkpoints")] == [4, 8]
    return work


def test_a_planted_dcp_index_is_set_aside_and_2_ranks_resume_from_the_one_before(fsdp_run, tmp_path,
                                                                                 monkeypatch, capsys):
    shutil.copytree(fsdp_run / "run", tmp_path / "run")
    marker = tmp_path / "payload-ran"
    latest = tmp_path / "run" / "checkpoints" / "step-00000008"
    replace_file(latest, "dcp/.metadata", pickle.dumps(_Payload(marker)))

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    code, out = inspect("run", capsys)
    assert code == 1
    assert all(len(line) <= 80 for line in out.splitlines()), out
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert rows == {"4": "verified", "8": "damaged"}, out
    said = " ".join(out.split())  # the reason below the table, wrapped but whole
    assert ("step 8 damaged: checkpoint run/checkpoints/step-00000008/dcp/.metadata: its DCP index refers to "
            "posix.system") in said, out

    done = scaletrain("train", *JOB, *FSDP, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists()
    assert warnings_of(done.stdout) == [(
        "warning: checkpoint run/checkpoints/step-00000008/dcp/.metadata: its DCP index refers to "
        "posix.system, which no checkpoint index holds (a planted payload?); nothing was executed; moved "
        "aside to corrupt-step-00000008-1; resuming from step-00000004")], done.stdout
    assert "resumed from run/checkpoints/step-00000004: step 4 of 12" in done.stdout
    assert "Traceback" not in done.stderr
    assert (tmp_path / "run" / "checkpoints" / "corrupt-step-00000008-1").is_dir()
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 12
    assert not marker.exists()


def test_a_dcp_index_of_garbage_is_damaged_and_falls_back(fsdp_run, tmp_path, monkeypatch, capsys):
    shutil.copytree(fsdp_run / "run", tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    replace_file(root / "step-00000008", "dcp/.metadata", b"\x80\x05garbage, not an index")
    monkeypatch.setenv("COLUMNS", "80")
    code, out = inspect(str(root / "step-00000008"), capsys, "--no-hashes")
    assert code == 1 and "damaged" in out and "unreadable DCP index" in out, out
    said: list[str] = []
    found = latest_usable(root, said.append)
    assert found is not None and found.step == 4
    assert len(said) == 1, said
    assert said[0].startswith(f"checkpoint {root}/step-00000008/dcp/.metadata: unreadable DCP index (")
    assert said[0].endswith("; moved aside to corrupt-step-00000008-1; resuming from step-00000004")


def _cfg(run_dir: Path, **extra: object):
    return load("digits", {"run.dir": str(run_dir), "train.max_steps": 12, "checkpoint.every": 4,
                           "checkpoint.keep": 0, "train.progress": False, **extra})


def test_a_full_checkpoint_with_wrong_shapes_falls_back_and_a_changed_model_is_an_error(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run(_cfg(run_dir, **{"chaos.interrupt_step": 8}))["stopped"]
    root = run_dir / "checkpoints"
    with pytest.raises(CheckpointError) as changed:  # every checkpoint misfits: the model changed
        run(_cfg(run_dir, **{"model.hidden": 64}))
    assert str(changed.value) == (
        f"checkpoint {root}/step-00000008/model.safetensors: head.1.weight has shape (128, 1024) in the "
        "checkpoint, (64, 1024) in this model; fix: resume with the model and optimizer configuration the "
        "checkpoint was made with")
    assert [p.name for p in sorted(root.iterdir())] == ["step-00000004", "step-00000008"]  # nothing moved

    tensors = safetensors.torch.load_file(str(root / "step-00000008" / "model.safetensors"))
    tensors["head.4.bias"] = torch.zeros(11)
    replace_file(root / "step-00000008", "model.safetensors", safetensors.torch.save(tensors))
    capsys.readouterr()
    assert run(_cfg(run_dir))["steps"] == 12
    out = capsys.readouterr().out
    assert warnings_of(out) == [(
        f"warning: checkpoint {root}/step-00000008/model.safetensors: head.4.bias has shape (11,) in the "
        "checkpoint, (10,) in this model; moved aside to corrupt-step-00000008-1; resuming from "
        "step-00000004")]
    assert f"resumed from {root}/step-00000004: step 4 of 12" in out


def test_export_passes_over_a_damaged_newest_checkpoint_as_a_resume_does(tmp_path, capsys):
    """`checkpoint export RUN` refused the whole run when its newest checkpoint was damaged (with a fix, "resume
    from an earlier checkpoint", that export cannot follow); it exports the newest sound one now, says which it
    passed over, and makes the OUT's folder; a damaged checkpoint named by itself is still its error."""
    run_dir = tmp_path / "run"
    assert run(_cfg(run_dir, **{"chaos.interrupt_step": 8}))["stopped"]
    newest = run_dir / "checkpoints" / "step-00000008" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["checkpoint", "export", str(run_dir), str(tmp_path / "new" / "w.safetensors")]) == 0
    out, err = capsys.readouterr()
    assert "exported step 4 of" in out and "step-00000008/model.safetensors: SHA-256 does not match" in err
    assert safetensors.torch.load_file(str(tmp_path / "new" / "w.safetensors"))
    assert main(["checkpoint", "export", str(newest.parent), str(tmp_path / "x.safetensors")]) == 2
    assert "SHA-256 does not match" in capsys.readouterr().err and not (tmp_path / "x.safetensors").exists()


def test_inspect_gives_a_truncated_checkpoints_size_as_it_is_on_disk(fsdp_run, tmp_path, monkeypatch, capsys):
    """The size column summed the manifest's sizes: a checkpoint whose file was cut to 1,000 bytes showed its whole
    size beside BAD. Now the files' own sizes: what the BAD one holds."""
    shutil.copytree(fsdp_run / "run", tmp_path / "run")
    latest = tmp_path / "run" / "checkpoints" / "step-00000008"
    manifest = json.loads((latest / commit.MANIFEST).read_text())
    biggest = max(manifest["files"], key=lambda name: manifest["files"][name]["bytes"])
    recorded = sum(f["bytes"] for f in manifest["files"].values())
    os.truncate(latest / biggest, 1000)
    code, out = inspect(str(tmp_path / "run"), capsys, "--json")
    assert code == 1
    infos = {i["step"]: i for i in json.loads(out)}
    assert infos[8]["status"] == "BAD"
    assert infos[8]["bytes"] == recorded - manifest["files"][biggest]["bytes"] + 1000
    assert infos[4]["bytes"] == sum(f["bytes"] for f in json.loads(
        (latest.parent / "step-00000004" / commit.MANIFEST).read_text())["files"].values())
