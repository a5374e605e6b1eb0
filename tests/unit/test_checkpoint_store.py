"""The checkpoint format and commit protocol: exact round trips, manifests, fallback, tampering.

A planted pickle payload would create a marker file if anything unpickled it; every file the loader reads is
tried, with the manifest updated to match (the attacker rewrote it too), and must be refused.
"""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import pytest
import safetensors.torch
import torch

from scaletrain.checkpoint import commit, tree
from scaletrain.config import load
from scaletrain.errors import CheckpointError
from scaletrain.runtime import Runtime
from scaletrain.train.checkpointing import Resume
from scaletrain.train.run import run


def test_tree_round_trip_is_exact():
    state = {
        "state": {"fc.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}},
        "param_groups": [{"params": ["fc.weight"], "lr": 0.1, "betas": (0.9, 0.999), "foreach": None,
                          "fused": True}],
        "ints": {1: "one", 2: [torch.arange(5), 2.5]},
        "odd": [float("nan"), float("inf"), -0.0, 1e-310, 2**70],
        "dtypes": [torch.randn(3, dtype=torch.bfloat16), torch.tensor([1, 2], dtype=torch.uint8),
                   torch.tensor([True, False])],
    }
    back, meta = tree.decode(tree.encode(state, {"note": "x"}), "test")
    assert meta == {"note": "x"}
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    assert set(back["ints"]) == {1, 2}  # int keys stay ints
    assert math.isnan(back["odd"][0]) and back["odd"][1:] == [float("inf"), -0.0, 1e-310, 2**70]
    assert math.copysign(1.0, back["odd"][2]) == -1.0
    assert torch.equal(back["state"]["fc.weight"]["exp_avg"], state["state"]["fc.weight"]["exp_avg"])
    for a, b in zip(back["dtypes"], state["dtypes"]):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _stage(root: Path, step: int, payload: bytes = b"weights") -> Path:
    stage = commit.new_stage(root, step)
    records = {"a.bin": commit.write_bytes(stage / "a.bin", payload)}
    (stage / "sub").mkdir()
    (stage / "sub" / "b.bin").write_bytes(b"shard of another rank")  # hashed by commit itself
    return commit.commit(stage, step, records, {"note": step})


def test_commit_writes_the_manifest_last_and_never_overwrites(tmp_path):
    path = _stage(tmp_path, 5)
    assert path.name == "step-00000005" and not list(tmp_path.glob(".tmp-*"))
    manifest = commit.verify(path)
    assert manifest["step"] == 5 and manifest["meta"] == {"note": 5}
    assert manifest["files"]["a.bin"]["bytes"] == 7 and set(manifest["files"]) == {"a.bin", "sub/b.bin"}
    with pytest.raises(CheckpointError, match="never overwritten"):
        _stage(tmp_path, 5, b"other")
    assert commit.verify(path)["files"]["a.bin"]["bytes"] == 7  # untouched
    assert not list(tmp_path.glob(".tmp-*"))  # the refused stage is gone


def test_stale_stages_are_not_checkpoints_and_are_cleaned(tmp_path):
    _stage(tmp_path, 1)
    half = commit.new_stage(tmp_path, 2)  # a save killed before its manifest
    (half / "a.bin").write_bytes(b"partial")
    trash = tmp_path / ".trash-step-00000000-dead"  # a delete killed half way
    trash.mkdir()
    assert [s for s, _ in commit.committed(tmp_path)] == [1]
    removed = commit.clean_stale(tmp_path)
    assert sorted(p.name for p in removed) == sorted([half.name, trash.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        _stage(tmp_path, step)
    commit.prune(tmp_path, keep=2)
    assert [s for s, _ in commit.committed(tmp_path)] == [3, 4]
    commit.prune(tmp_path, keep=0)  # 0 keeps all
    assert [s for s, _ in commit.committed(tmp_path)] == [3, 4]


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-manifest", "garbage-manifest"])
def test_a_bad_latest_is_named_set_aside_and_the_previous_one_used(tmp_path, damage):
    _stage(tmp_path, 1)
    latest = _stage(tmp_path, 2, b"0123456789")
    if damage == "truncate":
        (latest / "a.bin").write_bytes(b"01234")
    elif damage == "flip":
        (latest / "a.bin").write_bytes(b"0123456780")
    elif damage == "no-manifest":
        (latest / commit.MANIFEST).unlink()
    else:
        (latest / commit.MANIFEST).write_text("{not json")
    warnings: list[str] = []
    found = commit.latest_valid(tmp_path, warnings.append)
    assert found is not None and found[0].name == "step-00000001"
    assert len(warnings) == 1 and "step-00000002" in warnings[0] and "falling back" in warnings[0]
    named = {"truncate": "a.bin", "flip": "a.bin", "no-manifest": "manifest.json", "garbage-manifest": "manifest.json"}
    assert named[damage] in warnings[0]
    assert (tmp_path / "corrupt-step-00000002-1").is_dir()  # kept for inspection, not deleted


def test_a_checkpoint_renamed_to_a_later_step_is_set_aside_not_taken_for_the_newest(tmp_path):
    """step-00000020 renamed step-00000099 was the newest by name: every resume went back to step 20 and
    retention deleted the newer real checkpoints beside it."""
    _stage(tmp_path, 10)
    os.rename(_stage(tmp_path, 20), tmp_path / "step-00000099")
    _stage(tmp_path, 30)
    warnings: list[str] = []
    found = commit.latest_valid(tmp_path, warnings.append)
    assert found is not None and found[0].name == "step-00000030"  # 99 > 30 by name: it came first, before
    assert warnings == ["checkpoint " + str(tmp_path / "step-00000099") + ": is named for step 99 but holds "
                        "step 20 (renamed); moved aside to corrupt-step-00000099-1, falling back to the previous one"]


# -- a real checkpoint, tampered with ---------------------------------------------------------------------

MARKER = Path(os.environ.get("TMPDIR", "/tmp")) / "scaletrain-pwned-marker"


class _Payload:
    def __reduce__(self):
        return (open, (str(MARKER), "w"))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tamper") / "run"
    cfg = load("digits", {"run.dir": str(run_dir), "train.max_steps": 6, "checkpoint.every": 3,
                          "checkpoint.keep": 0, "train.progress": False, "train.log_every": 3})
    run(cfg)
    return run_dir


def _restore_into_fresh_job(run_dir: Path, step_dir: Path):
    """A job built from ``run_dir``'s config, set up on a session (in a new run directory) that resumes from
    ``step_dir``: (the job, the trainer state read, this rank's state read)."""
    from scaletrain.data import digits
    from scaletrain.observe.console import Console
    from scaletrain.train.job import build_job
    from scaletrain.train.preempt import PreemptFlag
    from scaletrain.train.session import Opened, Session

    cfg = load("digits", {"run.dir": str(step_dir.parent / "fresh"), "train.progress": False})
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "none")
    job = build_job(cfg, rt, digits(0.2))
    resume = Resume(step_dir, commit.verify(step_dir))
    st = Session(cfg, opened=Opened(rt, Console(False), resume, PreemptFlag(), job.layout, 0.0))
    try:
        job.attach(st)
    finally:
        st.close(finished=False)
    return job, st._trainer, st._rank_state


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "rank-00000.safetensors",
                                  "trainer.json"])
def test_a_planted_pickle_is_refused_even_with_a_matching_manifest(real_run, tmp_path, name):
    import shutil

    step_dir = tmp_path / "step-00000006"
    shutil.copytree(real_run / "checkpoints" / "step-00000006", step_dir)
    (step_dir / name).write_bytes(pickle.dumps(_Payload()))
    manifest = json.loads((step_dir / commit.MANIFEST).read_text())
    record = commit.hash_file(step_dir / name)
    manifest["files"][name] = {"bytes": record.bytes, "sha256": record.sha256}  # the attacker fixed it too
    (step_dir / commit.MANIFEST).write_text(json.dumps(manifest))
    MARKER.unlink(missing_ok=True)
    with pytest.raises(CheckpointError) as err:
        _restore_into_fresh_job(real_run, step_dir)
    assert name in str(err.value) and "fix:" in str(err.value)
    assert not MARKER.exists(), "a pickle payload ran"


def test_a_tampered_file_without_a_new_manifest_falls_back(real_run, tmp_path):
    import shutil

    root = tmp_path / "checkpoints"
    shutil.copytree(real_run / "checkpoints", root)
    (root / "step-00000006" / "optimizer.safetensors").write_bytes(pickle.dumps(_Payload()))
    warnings: list[str] = []
    path, _ = commit.latest_valid(root, warnings.append)
    assert path.name == "step-00000003" and "optimizer.safetensors" in warnings[0]
    assert not MARKER.exists()


def test_restore_reproduces_the_saved_state(real_run):
    step_dir = real_run / "checkpoints" / "step-00000006"
    job, trainer, rank_state = _restore_into_fresh_job(real_run, step_dir)
    assert job.step == trainer["step"] == 6 and trainer["loaders"][0]["cursor"] == 6 * 32
    assert job.loader.inner.state_dict()["cursor"] == 6 * 32
    assert rank_state is not None and set(rank_state) >= {"rng", "sums", "since", "guard"}
    final = safetensors.torch.load_file(str(real_run / "model.safetensors"))  # the run's own final weights
    for name, value in job.module.state_dict().items():
        assert torch.equal(value, final[name]), name
    assert job.optimizer.state_dict()["state"][0]["momentum_buffer"].abs().sum() > 0  # momentum came back


def test_the_finiteness_check_finds_every_nan_and_inf_and_no_false_alarm():
    """_finite screens by sums (one reduction per tensor); a sum that overflows is only a hint, so large finite
    values must not be reported, and a NaN or infinity anywhere, in any float dtype, must be."""
    from scaletrain.train.checkpointing import _finite

    big = torch.full((1000,), 3e38)  # every value finite, the sum is inf
    assert _finite({"big": big, "half": torch.full((100,), 60000.0, dtype=torch.float16)}) is None
    assert _finite({"ints": torch.arange(5), "empty": torch.empty(0)}) is None
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for bad in (math.nan, math.inf, -math.inf):
            t = torch.zeros(4097, dtype=dtype)
            t[4000] = bad
            assert _finite({"ok": torch.ones(3), "big": big, "bad": t}) == "bad", (dtype, bad)
    mixed = torch.tensor([math.inf, -math.inf])  # the sum is NaN, still non-finite
    assert _finite({"mixed": mixed}) == "mixed"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("async_save", [True, False])
def test_a_sharded_save_commits_in_the_background_and_refuses_a_nan(tmp_path, async_save):
    """The DCP path of the Checkpointer in one process: an async save returns before the commit, wait()
    commits a checkpoint that verifies and loads back; a NaN anywhere refuses the save and leaves no stage."""
    from scaletrain.checkpoint import dcp
    from scaletrain.config import CheckpointConfig
    from scaletrain.train.checkpointing import Checkpointer, NonFiniteState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 8)).square().sum().backward()
    opt.step()
    rt = Runtime(0, 0, 1, 1, torch.device("cpu"), "none")
    ck = Checkpointer(CheckpointConfig(every=1, keep=2, async_save=async_save), tmp_path, rt)
    ck.save_sharded(1, model, opt, {"step": 1}, {"x": 1}, {"format": "dcp"})
    ck.wait()
    [result] = ck.poll()
    assert (result.step, result.background) == (1, async_save)
    manifest = commit.verify(result.path)
    assert "dcp/.metadata" in manifest["files"] and "optimizer-groups.safetensors" in manifest["files"]
    back = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(back, result.path / dcp.DCP_DIR)
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())

    with torch.no_grad():
        model[1].weight[2, 3] = math.nan
    with pytest.raises(NonFiniteState, match="model.1.weight"):
        ck.save_sharded(2, model, opt, {"step": 2}, {"x": 2}, {"format": "dcp"})
    ck.close()
    assert [p.name for p in tmp_path.joinpath("checkpoints").iterdir()] == ["step-00000001"]


def _to_fits_old_layout(step_dir: Path) -> None:
    """Rewrite a checkpoint of a one-process scaletrain train run as fit() wrote it before it ran on the session
    (up to commit 5b0d4c0): one loader and the LR schedule at the top of trainer.json, one running loss per rank,
    no ``session`` or ``bare`` in the manifest. The model and optimizer files were already in this layout."""
    trainer = json.loads((step_dir / "trainer.json").read_text())
    old = {"step": trainer["step"], "loader": trainer["loaders"][0], "scheduler": trainer["tracked"]["scheduler"],
           "scaler": trainer["scaler"], "train_time_s": trainer["train_time_s"], "last_loss": float("nan")}
    (step_dir / "trainer.json").write_text(json.dumps(old))
    rank = step_dir / "rank-00000.safetensors"
    state, _ = tree.decode(rank.read_bytes(), str(rank))
    sums = state.pop("sums")
    rank.write_bytes(tree.encode({**state, "loss_sum": sums["loss"], "loss_count": sums["loss#n"]}))
    manifest = json.loads((step_dir / commit.MANIFEST).read_text())
    for name in ("trainer.json", rank.name):
        record = commit.hash_file(step_dir / name)
        manifest["files"][name] = {"bytes": record.bytes, "sha256": record.sha256}
    manifest["meta"] = {k: v for k, v in manifest["meta"].items() if k not in ("session", "bare")}
    (step_dir / commit.MANIFEST).write_text(json.dumps(manifest))


def test_a_checkpoint_of_fit_before_it_ran_on_the_session_resumes_exactly(tmp_path, capsys):
    """Nothing saved is lost to the change of trainer: a checkpoint in fit()'s old layout, taken at step 3 (between
    log steps: the running loss of step 3 is in it), resumes and ends bit-identical to the uninterrupted run
    (dropout on: every rank's RNG restored), with the same logged losses."""
    base = {"train.max_steps": 8, "log.every": 2, "checkpoint.every": 100, "model.dropout": 0.1,
            "train.progress": False, "train.eval_batches": 1}
    run(load("digits", {**base, "run.dir": str(tmp_path / "ref")}))
    assert run(load("digits", {**base, "run.dir": str(tmp_path / "old"), "chaos.interrupt_step": 3}))["stopped"]
    _to_fits_old_layout(tmp_path / "old" / "checkpoints" / "step-00000003")
    summary = run(load("digits", {**base, "run.dir": str(tmp_path / "old")}))
    assert "resumed from" in capsys.readouterr().out and summary["steps"] == 8
    ref, got = (safetensors.torch.load_file(str(tmp_path / d / "model.safetensors")) for d in ("ref", "old"))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)

    def losses(run_dir: Path) -> list[tuple[int, float]]:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]

    assert losses(tmp_path / "old") == losses(tmp_path / "ref")  # step 4's mean counts step 3's saved loss


def test_a_resume_at_another_global_batch_counts_the_samples_each_part_drew(tmp_path):
    """3 steps of 16 samples, then (resumed with batches of 32) 3 of 32: 144 samples, not 6 x 32 = 192 (the
    summary multiplied the steps by the last global batch), and the epoch fraction is where the loader is."""
    from scaletrain.data import build_splits

    base = {"train.max_steps": 6, "log.every": 3, "checkpoint.every": 100, "train.progress": False,
            "train.eval_batches": 1, "run.dir": str(tmp_path / "run")}
    assert run(load("digits", {**base, "data.batch_size": 16, "chaos.interrupt_step": 3}))["stopped"]
    cfg = load("digits", {**base, "data.batch_size": 32})
    summary = run(cfg)
    assert summary["steps"] == 6 and summary["samples"] == 3 * 16 + 3 * 32
    size = len(build_splits(cfg.data, cfg.model).train)
    assert summary["epochs"] == pytest.approx(144 / (48 + (size - 48) // 32 * 32), rel=1e-12)


def test_one_model_with_two_optimizers_leaves_its_weights_by_its_own_names(tmp_path):
    """model.safetensors of a session with one model is what load_model(model, path) takes (the README's run
    directory), whether it has one optimizer or two: it was written under 'model0.' with two."""
    import scaletrain

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    with scaletrain.session({"train.max_steps": 2, "run.dir": str(tmp_path / "run"), "train.progress": False,
                             "checkpoint.every": 2}) as st:
        model, first, second = st.setup(net, lambda p: torch.optim.SGD(list(p)[:2], lr=0.1),
                                         lambda p: torch.optim.SGD(list(p)[2:], lr=0.1))
        for xb, yb in st.loader((x, (x[:, 0] > 0).long())):
            with st.step():
                st.backward(torch.nn.functional.cross_entropy(model(xb), yb))
                for opt in (first, second):
                    opt.step()
                    opt.zero_grad()
            if st.done:
                break
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert safetensors.torch.load_model(fresh, str(tmp_path / "run" / "model.safetensors")) == (set(), [])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), net.state_dict().values()))
    # `checkpoint export` of its checkpoint (whose layout keeps the model under its name beside two
    # optimizers) gives the same names and tensors
    from scaletrain.cli import main

    assert main(["checkpoint", "export", str(tmp_path / "run"), str(tmp_path / "exported.safetensors")]) == 0
    exported = safetensors.torch.load_file(str(tmp_path / "exported.safetensors"))
    final = safetensors.torch.load_file(str(tmp_path / "run" / "model.safetensors"))
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
