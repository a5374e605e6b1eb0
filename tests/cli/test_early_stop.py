"""train.early_stop (Lightning's EarlyStopping on the held-out loss): the run ends, finished, at the evaluation
that makes N in a row without a new best; a stopped and resumed run ends where the uninterrupted one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from noisy import noisy_labels, wide_net
from torch.utils.data import IterableDataset

import scaletrain
from scaletrain.errors import ConfigError, Stopped

# 30 steps an epoch (480 training samples in batches of 16), an evaluation after each; 60 epochs at most
CONFIG = {"train.epochs": 60, "data.batch_size": 16, "optim.lr": 1e-2, "train.progress": False, "log.every": 100,
          "train.early_stop": 3}


_data, _net = noisy_labels, wide_net


def _evals(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval_loss"]) for r in records if r.get("kind") == "eval"]


def test_the_run_stops_at_the_third_evaluation_without_a_new_best(tmp_path: Path) -> None:
    summary = scaletrain.fit(_net(), _data(), config={**CONFIG, "run.dir": str(tmp_path / "r")})
    evals = _evals(tmp_path / "r")
    # the rule, recomputed from the evaluations written: the first one that is the 3rd in a row above the best
    best, since, stop = float("inf"), 0, None
    for step, loss in evals:
        best, since = (loss, 0) if loss < best else (best, since + 1)
        if since == 3:
            stop = step
            break
    assert stop is not None and stop < 60 * 30 and evals[-1][0] == stop  # nothing evaluated after it
    assert summary["steps"] == stop and summary["early_stop"]["step"] == stop
    assert summary["early_stop"]["best"] == min(loss for _, loss in evals)
    assert (tmp_path / "r" / "summary.json").is_file()  # it ended finished


def test_a_stopped_run_resumed_stops_where_the_whole_run_does(tmp_path: Path) -> None:
    whole = scaletrain.fit(_net(), _data(), config={**CONFIG, "run.dir": str(tmp_path / "whole")})
    cut = {**CONFIG, "run.dir": str(tmp_path / "cut")}
    with pytest.raises(Stopped):  # fit() does not return from a stop
        scaletrain.fit(_net(), _data(), config={**cut, "chaos.interrupt_step": 70})  # between the 2nd and 3rd evals
    resumed = scaletrain.fit(_net(), _data(), config=cut)
    assert resumed["early_stop"] == whole["early_stop"] and resumed["steps"] == whole["steps"]


def test_a_checkpoint_made_without_it_resumes_with_it(tmp_path: Path) -> None:
    """A run started without train.early_stop (or by an older scaletrain) resumed with it: it counts from the
    resume, instead of refusing the checkpoint for not holding its state."""
    config = {**CONFIG, "run.dir": str(tmp_path / "r"), "train.early_stop": 0}
    with pytest.raises(Stopped):
        scaletrain.fit(_net(), _data(), config={**config, "chaos.interrupt_step": 70})
    resumed = scaletrain.fit(_net(), _data(), config={**config, "train.early_stop": 3})
    assert resumed["early_stop"]["step"] == resumed["steps"] < 60 * 30


class Stream(IterableDataset):
    def __iter__(self):
        x, y = _data()
        yield from zip(x, y)


def test_without_held_out_data_it_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^train.early_stop = 3: expected 0 for training data without a held-out "
                                          r"split \(a stream\).*fix: eval_data=..."):
        scaletrain.fit(_net(), Stream(), config={**CONFIG, "run.dir": str(tmp_path / "s"), "train.max_steps": 10})
    with pytest.raises(ConfigError, match=r"^train.early_stop = 3: expected 0 for training data without a held-out "
                                          r"split \(data.val_fraction = 0\).*fix: .*--data.val_fraction=0.1"):
        scaletrain.fit(_net(), _data(), config={**CONFIG, "run.dir": str(tmp_path / "v"), "data.val_fraction": 0})
