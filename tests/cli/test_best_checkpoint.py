"""checkpoint.best (Lightning's ModelCheckpoint(monitor="val_loss"), HF's load_best_model_at_end): the checkpoint of
the lowest held-out loss is saved at its evaluation and outlives checkpoint.keep's rotation; best.json and the summary
name it, `scaletrain checkpoint export --best` exports it, and its weights give that loss back."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import torch
from noisy import noisy_labels, wide_net
from torch import nn
from torch.utils.data import IterableDataset
from warm import SCALETRAIN_M

import scaletrain
from scaletrain.checkpoint import commit
from scaletrain.errors import ConfigError, Stopped

# 30 steps an epoch (480 training samples in batches of 16), an evaluation after each; at most 12 epochs
CONFIG = {"train.epochs": 12, "data.batch_size": 16, "optim.lr": 1e-2, "train.progress": False, "log.every": 100,
          "checkpoint.best": True, "checkpoint.every": 30, "checkpoint.keep": 1, "checkpoint.async_save": False}


def _data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """480 training samples, 120 held out: the best evaluation is not the last one."""
    x, y = noisy_labels()
    return (x[:480], y[:480]), (x[480:], y[480:])


_net = wide_net


def _evals(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval_loss"]) for r in records if r.get("kind") == "eval"]


def _fit(run: Path, **config: object) -> dict:
    train, held = _data()
    return scaletrain.fit(_net(), train, eval_data=held, config={**CONFIG, "run.dir": str(run), **config})


def test_the_best_checkpoint_outlives_keep_and_holds_the_best_weights(tmp_path: Path) -> None:
    run = tmp_path / "r"
    summary = _fit(run)
    evals = _evals(run)
    step, loss = min(evals[1:], key=lambda e: e[1])  # the baseline (step 0) is the initial weights: never saved
    last = evals[-1][0]
    assert step < last, "the data were chosen for a best before the end"
    root = run / "checkpoints"
    # keep = 1: the latest, and the best beside it; nothing else
    assert [p.name for _, p in commit.committed(root)] == [commit.step_name(step), commit.step_name(last)]
    best = json.loads((root / commit.BEST).read_text())
    assert best == {"step": step, "eval_loss": loss}
    assert summary["best_checkpoint"] == {"step": step, "eval_loss": loss, "path": str(root / commit.step_name(step))}
    out = tmp_path / "best.safetensors"
    done = subprocess.run([*SCALETRAIN_M, "checkpoint", "export", str(run), str(out), "--best"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"exported step {step} of {root / commit.step_name(step)}:")
    net = _net()
    net.load_state_dict(safetensors.torch.load_file(out))
    (_, _), (x, y) = _data()
    with torch.no_grad():
        again = nn.functional.cross_entropy(net(x), y).item()
    assert again == pytest.approx(loss, rel=1e-5)  # the weights of the best evaluation give its loss back
    shown = subprocess.run([*SCALETRAIN_M, "checkpoint", "inspect", str(run), "--json"],
                           capture_output=True, text=True, check=False)
    assert [i["best"] for i in json.loads(shown.stdout)] == [True, False]


def test_a_best_at_a_step_saved_anyway_is_that_checkpoint(tmp_path: Path) -> None:
    """Evaluations and saves both every epoch: the best is the periodic checkpoint of its step (saved once), and
    with checkpoint.every = 0 it is saved at its evaluation alone."""
    for every in (30, 0):
        run = tmp_path / f"every{every}"
        summary = _fit(run, **{"checkpoint.every": every, "checkpoint.async_save": True})
        step = min(_evals(run)[1:], key=lambda e: e[1])[0]
        names = [p.name for _, p in commit.committed(run / "checkpoints")]
        assert summary["best_checkpoint"]["step"] == step and commit.step_name(step) in names
        assert len(names) == (2 if every else 1), names  # every = 0: only the best (no final save)


def test_a_resumed_run_keeps_the_best_of_the_whole_run(tmp_path: Path) -> None:
    whole = _fit(tmp_path / "whole")
    cut = tmp_path / "cut"
    with pytest.raises(Stopped):
        _fit(cut, **{"chaos.interrupt_step": 150})  # after the best evaluation of this data
    resumed = _fit(cut)
    assert resumed["best_checkpoint"]["step"] == whole["best_checkpoint"]["step"]
    assert resumed["best_checkpoint"]["eval_loss"] == whole["best_checkpoint"]["eval_loss"]
    assert (cut / "checkpoints" / commit.step_name(resumed["best_checkpoint"]["step"])).is_dir()


def test_prune_and_make_room_spare_the_best(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        stage = commit.new_stage(root, step)
        records = {"w": commit.write_bytes(stage / "w", bytes(1000))}
        commit.commit(stage, step, records, {})
    commit.write_best(root, 20, {"eval_loss": 0.5})
    assert [p.name for p in commit.prune(root, 1)] == [commit.step_name(10), commit.step_name(30)]
    assert [s for s, _ in commit.committed(root)] == [20, 40]
    assert commit.make_room(root, 1 << 62, 1)[0] == []  # the disk is short, and neither may go
    assert [s for s, _ in commit.committed(root)] == [20, 40]


class Stream(IterableDataset):
    def __iter__(self):
        (x, y), _ = _data()
        yield from zip(x, y)


def test_without_held_out_data_it_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint.best = True: expected false for training data without a "
                                          r"held-out split \(a stream\).*fix: eval_data=..."):
        scaletrain.fit(_net(), Stream(), config={**CONFIG, "run.dir": str(tmp_path / "s"), "train.max_steps": 10})


def test_export_best_of_a_run_without_one_is_one_line(tmp_path: Path) -> None:
    run = tmp_path / "r"
    _fit(run, **{"checkpoint.best": False, "train.epochs": 1})
    done = subprocess.run([*SCALETRAIN_M, "checkpoint", "export", str(run),
                           str(tmp_path / "o.safetensors"), "--best"], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "names no best checkpoint" in done.stderr and "fix: " in done.stderr


def test_a_loop_of_ones_own_keeps_its_best_by_its_own_measure(tmp_path: Path) -> None:
    """st.save_best(): the loop decides what is best (here the highest held-out accuracy), the session saves and
    spares the checkpoint; a call at a step saved anyway saves nothing twice."""
    (x, y), (hx, hy) = _data()
    run = tmp_path / "loop"
    chosen = []
    with scaletrain.session({"train.max_steps": 60, "log.every": 10, "checkpoint.every": 20, "checkpoint.keep": 1,
                             "data.batch_size": 16, "run.dir": str(run), "train.progress": False,
                             "checkpoint.load_best": True}) as st:
        model, opt = st.setup(_net(), lambda p: torch.optim.SGD(p, lr=0.5))
        loader, best = st.loader((x, y)), -1.0
        while not st.done:
            for xb, yb in loader:
                with st.step():
                    st.backward(nn.functional.cross_entropy(model(xb), yb))
                    opt.step()
                    opt.zero_grad()
                if st.steps % 10 == 0:
                    with st.evaluating(), torch.no_grad():
                        accuracy = (model(hx).argmax(1) == hy).float().mean().item()
                    if accuracy > best:
                        best = accuracy
                        chosen.append(st.steps)
                        st.save_best(eval_accuracy=accuracy)
                if st.done:
                    break
    step = chosen[-1]
    assert json.loads((run / "checkpoints" / commit.BEST).read_text()) == {"step": step, "eval_accuracy": best}
    names = sorted({commit.step_name(step), commit.step_name(60)})
    assert [p.name for _, p in commit.committed(run / "checkpoints")] == names
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_checkpoint"]["step"] == step < 60 and summary["best_checkpoint"]["loaded"]
    # checkpoint.load_best: the loop's model, and model.safetensors, hold the best checkpoint's weights
    saved = safetensors.torch.load_file(run / "model.safetensors")
    best = safetensors.torch.load_file(run / "checkpoints" / commit.step_name(step) / "model.safetensors")
    assert sorted(saved) == sorted(best) and all(torch.equal(saved[k], best[k]) for k in saved)


def test_load_best_leaves_the_best_weights_in_the_model_given_and_model_safetensors(tmp_path: Path) -> None:
    run, net = tmp_path / "r", _net()
    summary = scaletrain.fit(net, _data()[0], eval_data=_data()[1], config={
        **CONFIG, "run.dir": str(run), "checkpoint.load_best": True, "train.early_stop": 3})
    best = summary["best_checkpoint"]
    assert best["loaded"] and best["step"] < summary["steps"]
    (_, _), (x, y) = _data()
    with torch.no_grad():
        assert nn.functional.cross_entropy(net(x), y).item() == pytest.approx(best["eval_loss"], rel=1e-5)
    saved = safetensors.torch.load_file(run / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in net.state_dict().items())
    last = safetensors.torch.load_file(run / "checkpoints" / commit.step_name(summary["steps"]) / "model.safetensors")
    assert not torch.equal(last["0.weight"], saved["0.weight"])  # the last checkpoint keeps the last step's


def test_load_best_under_fsdp_reads_the_sharded_best_back(tmp_path: Path) -> None:
    """Two ranks, FSDP: the best checkpoint is DCP shards; model.safetensors at the end is its weights."""
    run = tmp_path / "r"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    done = subprocess.run([*SCALETRAIN_M, "train", "digits", "--nproc", "2",
                           "--parallel.strategy=fsdp", "--checkpoint.best", "--checkpoint.load_best",
                           "--train.eval_every=10", "--train.max_steps=60", "--optim.lr=0.5", f"--run.dir={run}",
                           "--train.progress=false"], capture_output=True, text=True, env=env, timeout=240,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    best = summary["best_checkpoint"]
    assert best["step"] < 60, "lr 0.5 was chosen to diverge after the best evaluation"
    assert best["loaded"] and f"loaded the weights of the best checkpoint (step {best['step']})" in done.stdout
    assert "its weights loaded into the model" in done.stdout
    out = tmp_path / "best.safetensors"
    exported = subprocess.run([*SCALETRAIN_M, "checkpoint", "export", str(run), str(out),
                               "--best"], capture_output=True, text=True, check=False)
    assert exported.returncode == 0, exported.stderr
    a, b = safetensors.torch.load_file(out), safetensors.torch.load_file(run / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    report = subprocess.run([*SCALETRAIN_M, "report", str(run)], capture_output=True, text=True,
                            env={**env, "COLUMNS": "200"}, check=False)
    assert f"step {best['step']}, its weights loaded into the model" in report.stdout, report.stdout


def test_load_best_without_best_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^checkpoint.load_best = True: expected false without checkpoint.best"):
        _fit(tmp_path / "r", **{"checkpoint.best": False, "checkpoint.load_best": True})
