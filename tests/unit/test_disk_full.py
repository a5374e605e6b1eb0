"""A full disk at any write: one line naming the path, the bytes needed and free (exit code 1), the previous
checkpoint intact and still the latest, what could be written written, and a resume that continues.

A full disk is simulated where each kind of write happens: safetensors' own writer (checkpoint files, final
weights; it reports ENOSPC as "... (os error 28)"), the metrics file, summary.json and the truncation of
metrics.jsonl at a resume, each raising what the OS raises there. Runs are the digits recipe in-process, on
one process, a few steps with a small model.
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

import scaletrain
from scaletrain.checkpoint import commit
from scaletrain.cli import main
from scaletrain.config import CheckpointConfig, load
from scaletrain.errors import DiskFull, exit_code, is_disk_full, one_line
from scaletrain.observe import metrics
from scaletrain.runtime import Runtime
from scaletrain.train import run as run_module
from scaletrain.train.checkpointing import Checkpointer, Resume, read_model
from scaletrain.train.resume import truncate_metrics
from scaletrain.train.run import run

ENOSPC = OSError(errno.ENOSPC, "No space left on device")
FIX = "; fix: free space on that disk, or point --run.dir at a larger one"
_save_file = safetensors.torch.save_file


def _cfg(run_dir: Path, **extra: object):
    return load("digits", {"run.dir": str(run_dir), "train.max_steps": 4, "checkpoint.every": 2, "checkpoint.keep": 2,
                           "log.every": 2, "train.progress": False, "train.eval_batches": 1, "model.channels": 8,
                           "model.hidden": 16, **extra})


def _full_for(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """safetensors finds the disk full for any file whose path holds one of ``names``."""
    def save_file(tensors, filename, metadata=None):
        if any(name in str(filename) for name in names):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return _save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def _latest(run_dir: Path) -> str:
    warnings: list[str] = []
    found = commit.latest_valid(run_dir / "checkpoints", warnings.append)
    assert found is not None and not warnings, warnings
    return found[0].name


def _stages(run_dir: Path) -> list[str]:
    return [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def _resumes_and_finishes(run_dir: Path, step: int, capsys: pytest.CaptureFixture[str], into: Path | None = None) -> None:
    """The same run again, with room: it continues from checkpoint ``step`` and ends with its outputs. ``into``:
    a new run directory, continuing from that checkpoint of ``run_dir`` (a run directory with summary.json is
    finished and never written again)."""
    path = run_dir / "checkpoints" / commit.step_name(step)
    if into is None:
        summary = run(_cfg(run_dir))
    else:
        summary, run_dir = run(_cfg(into, **{"checkpoint.resume": str(path)})), into
    assert f"resumed from {path}: step {step} of 4" in capsys.readouterr().out
    assert summary["steps"] == 4
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "summary.json").is_file()
    assert _latest(run_dir) == "step-00000004"
    steps = [r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "train"]
    assert steps == ([2, 4] if into is None else [4])  # records after the checkpoint dropped at the resume


def test_periodic_saves_on_a_full_disk_warn_and_the_final_one_ends_the_run_with_the_outputs_written(tmp_path, capsys,
                                                                                                   monkeypatch):
    """Background saves: step 2 commits, steps 4 (the last) fails. The failure is a warning naming what stays
    the latest; the end of the run writes the weights and the summary, then says the last checkpoint is
    missing in one line (exit code 1)."""
    run_dir = tmp_path / "run"
    _full_for(monkeypatch, "step-00000004")
    with pytest.raises(DiskFull) as caught:
        run(_cfg(run_dir))
    out = capsys.readouterr().out
    ckpt = run_dir / "checkpoints"
    needed = commit.size_of(ckpt / "step-00000002")
    line = one_line(caught.value)
    assert line.startswith(f"scaletrain: training failed: disk full: {ckpt / 'step-00000004'} needs {needed:,} "
                           "bytes, ")
    assert line.endswith(f" free; {ckpt / 'step-00000002'} stays the latest checkpoint; model.safetensors and "
                         f"summary.json were written{FIX}")
    assert exit_code(caught.value) == 1 and "\n" not in line
    assert f"warning: checkpoint not saved: disk full: {ckpt / 'step-00000004'} needs {needed:,} bytes" in out
    assert _latest(run_dir) == "step-00000002" and _stages(run_dir) == []
    assert (run_dir / "model.safetensors").is_file() and (run_dir / "summary.json").is_file()
    monkeypatch.undo()
    _resumes_and_finishes(run_dir, 2, capsys, into=tmp_path / "again")


def test_a_stop_whose_save_finds_the_disk_full_ends_in_one_line(tmp_path, capsys, monkeypatch):
    """Saves on the loop's thread (async_save off): the periodic one at step 2 commits; the stop at step 3
    (chaos.interrupt_step) saves before it stops, finds the disk full, and the run ends naming step 2."""
    run_dir = tmp_path / "run"
    _full_for(monkeypatch, "step-00000003")
    with pytest.raises(DiskFull) as caught:
        run(_cfg(run_dir, **{"checkpoint.async_save": False, "chaos.interrupt_step": 3}))
    ckpt = run_dir / "checkpoints"
    assert str(caught.value).startswith(f"disk full: {ckpt / 'step-00000003'} needs ")
    assert str(caught.value).endswith(f"free; {ckpt / 'step-00000002'} stays the latest checkpoint{FIX}")
    assert _latest(run_dir) == "step-00000002" and _stages(run_dir) == []
    assert not (run_dir / "model.safetensors").exists()
    monkeypatch.undo()
    _resumes_and_finishes(run_dir, 2, capsys)


class _FullFile:
    """A text file whose writes of a train record of step 4 or later find the disk full."""

    def __init__(self, file) -> None:
        self.file = file

    def write(self, text: str) -> int:
        record = json.loads(text)
        if record["kind"] == "train" and record["step"] >= 4:
            raise OSError(ENOSPC.errno, ENOSPC.strerror)
        return self.file.write(text)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def test_metrics_on_a_full_disk_stop_the_run_in_one_line(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(metrics, "open", lambda *a, **k: _FullFile(open(*a, **k)), raising=False)  # noqa: SIM115
    with pytest.raises(DiskFull) as caught:
        run(_cfg(run_dir))
    message = str(caught.value)
    assert message.startswith(f"disk full: {run_dir / 'metrics.jsonl'} needs ")
    assert message.endswith(f"free; {run_dir / 'checkpoints' / 'step-00000002'} stays the latest checkpoint{FIX}")
    assert caught.value.needed > 50 and _latest(run_dir) == "step-00000002"
    monkeypatch.undo()
    _resumes_and_finishes(run_dir, 2, capsys)


def test_final_weights_written_nowhere_leave_the_run_unfinished_and_the_same_command_resumes(tmp_path, capsys,
                                                                                              monkeypatch):
    """The last checkpoint and model.safetensors both find the disk full (every checkpoint kept, keep=0, filled
    it): the trained weights are nowhere. summary.json was still written, so the run counted as finished and the
    same command refused its directory; the fix it offered (another --run.dir) trained from step 0. The summary
    is now left out: the line says so, and the same command resumes from step 2 once there is room."""
    run_dir = tmp_path / "run"
    _full_for(monkeypatch, "step-00000004", "model.safetensors.tmp")
    with pytest.raises(DiskFull) as caught:
        run(_cfg(run_dir, **{"checkpoint.keep": 0}))
    ckpt = run_dir / "checkpoints"
    assert str(caught.value).endswith(
        f"free; {ckpt / 'step-00000002'} stays the latest checkpoint; model.safetensors was not written either; the "
        f"run is not marked finished (summary.json left out): the same command resumes from {ckpt / 'step-00000002'}"
        f" once there is room{FIX}"), str(caught.value)
    assert not (run_dir / "summary.json").exists() and not (run_dir / "model.safetensors").exists()
    monkeypatch.undo()
    _resumes_and_finishes(run_dir, 2, capsys)


@pytest.mark.parametrize("full", ["model.safetensors", "summary.json"])
def test_final_outputs_on_a_full_disk_end_in_one_line_and_a_rerun_writes_them(tmp_path, capsys, monkeypatch, full):
    run_dir = tmp_path / "run"
    if full == "model.safetensors":
        _full_for(monkeypatch, "model.safetensors.tmp")
    else:
        write_bytes = Path.write_bytes

        def no_room(path: Path, data: bytes) -> int:
            if path.name == "summary.json.tmp":
                path.write_text("{")  # half written, then full
                raise OSError(ENOSPC.errno, ENOSPC.strerror, str(path))
            return write_bytes(path, data)

        monkeypatch.setattr(Path, "write_bytes", no_room)
    with pytest.raises(DiskFull) as caught:
        run(_cfg(run_dir))
    last = run_dir / "checkpoints" / "step-00000004"
    assert str(caught.value).startswith(f"disk full: {run_dir / full} needs ")
    if full == "model.safetensors":
        assert str(caught.value).endswith(
            f"free; {last} holds the same weights (`scaletrain checkpoint export {last} {run_dir / full}` writes them "
            f"once there is room); summary.json was written{FIX}")
    else:
        assert str(caught.value).endswith(f"free; {last} is the latest checkpoint; model.safetensors was written{FIX}")
    assert not (run_dir / full).exists() and not (run_dir / f"{full}.tmp").exists()
    assert _latest(run_dir) == "step-00000004"
    monkeypatch.undo()
    if full == "model.safetensors":  # what the line says to do, once there is room
        assert main(["checkpoint", "export", str(last), str(run_dir / full)]) == 0
        assert safetensors.torch.load_file(str(run_dir / full)).keys() == read_model_keys(last)
    else:  # the run is not finished without its summary: the same command again writes the outputs
        summary = run(_cfg(run_dir))
        assert summary["steps"] == 4 and (run_dir / full).is_file()


def test_a_file_too_large_ends_in_one_line_that_names_the_limit(tmp_path, monkeypatch):
    """EFBIG (a file past `ulimit -f`, or the filesystem's largest) ended the run in safetensors' traceback from
    the final weights, each checkpoint before it a warning that quoted the library. It is a refused write like a
    full disk: the same one line and outcome, naming the limit rather than the free space."""
    run_dir = tmp_path / "run"

    def save_file(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    with pytest.raises(DiskFull) as caught:
        run(_cfg(run_dir))
    message = str(caught.value)
    assert message.startswith(f"file too large: {run_dir / 'checkpoints' / 'step-00000004'} needs "), message
    assert "past this process's file size limit (ulimit -f)" in message and "free space" not in message
    assert message.endswith("; no checkpoint saved yet; model.safetensors was not written either; the run is not "
                            "marked finished (summary.json left out): the same command trains it again (no checkpoint "
                            "to resume from) once there is room; fix: raise the limit (ulimit -f unlimited), or point "
                            "--run.dir at another filesystem"), message
    assert exit_code(caught.value) == 1 and one_line(caught.value) == f"scaletrain: training failed: {message}"


def read_model_keys(path: Path) -> set[str]:
    return set(read_model(Resume(path, commit.verify(path)))[0])


def test_a_resume_on_a_full_disk_writes_nothing_before_its_first_step(tmp_path, capsys, monkeypatch):
    """A run that died after logging step 4 and before committing its checkpoint: the metrics of step 4 are
    after the checkpoint it resumes from (step 2). Until the first step no new file can be written; the
    resume drops those records in place and trains on."""
    run_dir = tmp_path / "run"
    run(_cfg(run_dir))
    commit.set_aside(run_dir / "checkpoints" / "step-00000004")
    (run_dir / "summary.json").unlink()
    (run_dir / "model.safetensors").unlink()

    def no_room(path: Path, *args: object, **kwargs: object) -> int:
        raise OSError(ENOSPC.errno, ENOSPC.strerror, str(path))

    def room_again(job, console) -> None:  # the first step frees space (as a user would, or retention)
        monkeypatch.undo()
        return train(job, console)

    train = run_module._train
    monkeypatch.setattr(Path, "write_bytes", no_room)
    monkeypatch.setattr(Path, "write_text", no_room)
    monkeypatch.setattr(run_module, "_train", room_again)
    _resumes_and_finishes(run_dir, 2, capsys)


def test_truncating_metrics_needs_no_free_space(tmp_path, monkeypatch):
    def no_room(path: Path, *args: object, **kwargs: object) -> int:
        raise OSError(ENOSPC.errno, ENOSPC.strerror, str(path))

    monkeypatch.setattr(Path, "write_bytes", no_room)
    path = tmp_path / "metrics.jsonl"
    records = [{"kind": "train", "step": 2}, {"kind": "train", "step": 4}, {"kind": "checkpoint", "step": 2},
               {"kind": "eval", "step": 4}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tr')
    assert truncate_metrics(path, 4) == 1  # only the line cut short: a tail, truncated in place
    assert truncate_metrics(path, 4) == 0
    assert truncate_metrics(path, 2) == 2  # not a tail: written over the old records in place
    assert [json.loads(line) for line in path.read_text().splitlines()] == [records[0], records[2]]


def _checkpointer(root: Path, keep: int) -> Checkpointer:
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "none")
    return Checkpointer(CheckpointConfig(every=1, keep=keep, async_save=True), root, rt)


def _save(ck: Checkpointer, step: int) -> None:
    model = {"w": torch.full((256,), float(step))}  # 1 kB
    ck.save(step, (model, {}), {"state": {}, "param_groups": []}, {"step": step}, {"x": step}, {"format": "full"})
    ck.wait()


def test_the_first_save_failing_says_no_checkpoint_is_saved_yet(tmp_path, monkeypatch):
    ck = _checkpointer(tmp_path, keep=2)
    _full_for(monkeypatch, "step-00000001")
    ck.save(1, ({"w": torch.ones(4)}, {}), {"state": {}, "param_groups": []}, {"step": 1}, {}, {"format": "full"})
    ck.close()
    [warning] = ck.warnings
    assert warning.startswith(f"checkpoint not saved: disk full: {tmp_path / 'checkpoints' / 'step-00000001'} "
                              "needs 16 bytes, ")
    assert warning.endswith(f" free; no checkpoint saved yet{FIX}")
    assert isinstance(ck.failed, DiskFull) and _stages(tmp_path) == [] and commit.committed(ck.root) == []

    def denied(tensors, filename, metadata=None):
        raise PermissionError(errno.EACCES, "Permission denied", str(filename))

    monkeypatch.setattr(safetensors.torch, "save_file", denied)  # any other failure says the same of the latest
    other = _checkpointer(tmp_path / "other", keep=2)
    other.save(1, ({"w": torch.ones(4)}, {}), {"state": {}, "param_groups": []}, {"step": 1}, {}, {"format": "full"})
    other.close()
    [warning] = other.warnings
    assert re.fullmatch(r"checkpoint save failed \(PermissionError: \[Errno 13\] Permission denied: "
                        r"'\S+/model.safetensors'\); no checkpoint saved yet", warning), warning


def test_a_session_whose_last_checkpoint_finds_the_disk_full_still_writes_its_outputs(tmp_path, monkeypatch):
    _full_for(monkeypatch, "step-00000004")
    config = {"run.dir": str(tmp_path), "train.max_steps": 4, "checkpoint.every": 2, "log.every": 2}
    with pytest.raises(DiskFull) as caught, scaletrain.session(config) as st:  # raised by its close, at the end
        model, opt = st.setup(torch.nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
        for x, y in st.loader(data, batch_size=8):
            with st.step():
                st.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
            if st.done:
                break
    ckpt = tmp_path / "checkpoints"
    assert str(caught.value).endswith(f" free; {ckpt / 'step-00000002'} stays the latest checkpoint; "
                                      f"model.safetensors and summary.json were written{FIX}")
    assert _latest(tmp_path) == "step-00000002" and _stages(tmp_path) == []
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "summary.json").is_file()


def test_retention_makes_room_before_a_save_but_never_deletes_the_newest_valid_checkpoint(tmp_path, monkeypatch):
    ck = _checkpointer(tmp_path, keep=2)
    for step in (1, 2):
        _save(ck, step)
    size = commit.size_of(ck.root / "step-00000002")

    def free_bytes(path: Path) -> int:  # room for a little less than one more checkpoint, until step 1 goes
        return size - 1 + (0 if (ck.root / "step-00000001").exists() else size)

    monkeypatch.setattr(commit, "free_bytes", free_bytes)
    ck.warnings.clear()
    _save(ck, 3)  # keep = 2 deletes step 1 after saving step 3 anyway: it goes first, and step 3 fits
    assert [p.name for _, p in commit.committed(ck.root)] == ["step-00000002", "step-00000003"]
    assert ck.warnings == [(f"{ck.root} is short of space for step 3 ({size:,} bytes): deleted step-00000001 before "
                           "the save rather than after it (checkpoint.keep = 2)")]

    one = _checkpointer(tmp_path / "one", keep=1)
    _save(one, 1)
    monkeypatch.setattr(commit, "free_bytes", lambda path: 0)
    deleted, _ = commit.make_room(one.root, 10**6, keep=1)
    assert deleted == [] and [s for s, _ in commit.committed(one.root)] == [1]  # the only valid one stays


def test_a_save_that_would_not_fit_is_said_ahead(tmp_path, monkeypatch):
    ck = _checkpointer(tmp_path, keep=0)
    _save(ck, 1)
    needed = commit.size_of(ck.root / "step-00000001")
    monkeypatch.setattr(commit, "free_bytes", lambda path: 100)
    ck.warnings.clear()
    _save(ck, 2)  # the warning comes before the save; this one still fits (the disk is not really full)
    assert ck.warnings == [(f"disk nearly full: {tmp_path} has 100 bytes free and the checkpoint of step 2 needs "
                           f"{needed:,}; the save will likely fail and {ck.root / 'step-00000001'} stays the latest "
                           "checkpoint; fix: free space on that disk, a lower --checkpoint.keep, or a --run.dir on "
                           "a larger one")]


def test_a_full_disk_is_recognised_however_it_is_reported():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert is_disk_full(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert is_disk_full(RuntimeError("CheckpointException ranks:dict_keys([0])\nOSError: [Errno 28] No space left"))
    try:
        try:
            raise ENOSPC
        except OSError as err:
            raise RuntimeError("write failed") from err
    except RuntimeError as err:
        assert is_disk_full(err)
    assert is_disk_full(OSError(errno.EFBIG, "File too large"))  # past `ulimit -f`: a write refused for its size
    assert is_disk_full(SafetensorError("Error while serializing: I/O error: File too large (os error 27)"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(RuntimeError("(os error 2)"))


def _second_sharded_save_failing(tmp_path, monkeypatch, error: Exception, async_save: bool) -> Checkpointer:
    """A one-process DCP checkpointer whose step 1 is saved and whose step 2 fails with ``error`` in the
    storage writer; returned closed."""
    from scaletrain.checkpoint import dcp

    class FailingWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            raise error

    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "none")
    ck = Checkpointer(CheckpointConfig(every=1, keep=2, async_save=async_save), tmp_path, rt)
    ck.save_sharded(1, model, opt, {"step": 1}, {"x": 1}, {"format": "dcp"})
    ck.wait()
    monkeypatch.setattr(dcp, "FileSystemWriter", FailingWriter)
    ck.save_sharded(2, model, opt, {"step": 2}, {"x": 2}, {"format": "dcp"})
    ck.close()
    return ck


@pytest.mark.parametrize("async_save", [True, False])
def test_a_sharded_save_on_a_full_disk_is_a_warning_and_leaves_no_stage(tmp_path, monkeypatch, async_save):
    """The DCP path in one process: DCP wraps each rank's ENOSPC in its own error; the periodic save becomes a
    warning naming the checkpoint and what stays the latest, with no staging directory left behind."""
    torch.manual_seed(0)
    ck = _second_sharded_save_failing(tmp_path, monkeypatch, OSError(ENOSPC.errno, ENOSPC.strerror), async_save)
    [warning] = ck.warnings
    assert warning.startswith(f"checkpoint not saved: disk full: {ck.root / 'step-00000002'} needs ")
    assert warning.endswith(f" free; {ck.root / 'step-00000001'} stays the latest checkpoint{FIX}")
    assert [s for s, _ in commit.committed(ck.root)] == [1] and _stages(tmp_path) == []
    commit.verify(ck.root / "step-00000001")


def test_an_export_to_a_full_disk_is_one_line_and_leaves_no_part_file(tmp_path, monkeypatch, capsys):
    from scaletrain.cli import main

    ck = _checkpointer(tmp_path, keep=2)
    _save(ck, 1)
    ck.close()
    _full_for(monkeypatch, "out.safetensors")
    assert main(["checkpoint", "export", str(tmp_path / "checkpoints"), str(tmp_path / "out.safetensors")]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"disk full: {tmp_path / 'out.safetensors'} needs 1,024 bytes" in line and "Traceback" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_a_sharded_save_failing_for_another_reason_is_a_warning_not_a_traceback(tmp_path, monkeypatch):
    """DCP wraps every rank's error in a CheckpointException, a BaseException: any other failure than a full
    disk must not escape the checkpoint thread either."""
    ck = _second_sharded_save_failing(tmp_path, monkeypatch, ValueError("a storage plugin's own bug"), True)
    [warning] = ck.warnings
    assert "ValueError: a storage plugin's own bug" in warning and "\n" not in warning
    assert warning.endswith(f"{ck.root / 'step-00000001'} stays the latest checkpoint")
    assert [s for s, _ in commit.committed(ck.root)] == [1] and _stages(tmp_path) == []
