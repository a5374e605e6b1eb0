"""fit(metrics=...): held-out measures of one's own beside the loss, each the mean of per-sample values over the
whole split (exact at any world size); train.monitor / monitor_mode point early stop and checkpoint.best at any
of them (Lightning's monitor= and mode=)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from noisy import noisy_labels, wide_net
from torch import nn
from warm import SCALETRAIN

import scaletrain
from scaletrain.errors import ConfigError, UserError

CONFIG = {"train.epochs": 12, "data.batch_size": 16, "optim.lr": 1e-2, "train.progress": False, "log.every": 100}
BIN = Path(sys.executable).parent


def _data() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """480 training samples, 121 held out: uneven over 2 ranks and over batches of 16."""
    x, y = noisy_labels(601)
    return (x[:480], y[:480]), (x[480:], y[480:])


_net = wide_net


def top1(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y).float()


def margin(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The true class's logit over the other's: a float per sample."""
    return out.gather(1, y[:, None])[:, 0] - out.gather(1, 1 - y[:, None])[:, 0]


METRICS = {"top1": top1, "margin": margin}


def _evals(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind") == "eval"]


def _recomputed(run: Path) -> dict[str, float]:
    """The metrics of the saved model over the held-out split, in one pass, here."""
    net = _net()
    net.load_state_dict(safetensors.torch.load_file(run / "model.safetensors"))
    _, (x, y) = _data()
    with torch.no_grad():
        out = net(x)
    return {name: fn(out, y).double().mean().item() for name, fn in METRICS.items()}


def test_metrics_are_the_mean_over_the_split_and_top1_is_the_accuracy(tmp_path: Path) -> None:
    run = tmp_path / "r"
    summary = scaletrain.fit(_net(), _data()[0], eval_data=_data()[1], metrics=METRICS,
                             config={**CONFIG, "train.epochs": 2, "run.dir": str(run)})
    assert summary["eval"]["top1"] == summary["eval"]["accuracy"]  # the same count, two ways
    again = _recomputed(run)
    assert summary["eval"]["margin"] == pytest.approx(again["margin"], rel=1e-6)
    assert summary["eval"]["top1"] == pytest.approx(again["top1"], abs=1e-12)
    assert all("eval_top1" in r and "eval_margin" in r for r in _evals(run))


def test_a_metric_returning_its_batch_mean_is_weighed_by_the_batch(tmp_path: Path) -> None:
    """121 held-out samples in batches of 16 (the last of 9): a metric returning one number per batch, its mean,
    is the split's mean of the per-sample values (a mean of the 8 batch means would weigh the 9 as 16)."""
    means = {"top1": lambda out, y: top1(out, y).mean(), "margin": lambda out, y: margin(out, y).mean()}
    summary = scaletrain.fit(_net(), _data()[0], eval_data=_data()[1], metrics=means,
                             config={**CONFIG, "train.epochs": 2, "run.dir": str(tmp_path / "r")})
    again = _recomputed(tmp_path / "r")
    assert summary["eval"]["top1"] == pytest.approx(summary["eval"]["accuracy"], abs=1e-12)
    assert summary["eval"]["margin"] == pytest.approx(again["margin"], rel=1e-6)


SCRIPT = """
import sys, torch, scaletrain
sys.path[:0] = [{tests!r}, {root!r}]  # this file, and tests/noisy.py
from test_fit_metrics import CONFIG, METRICS, _data, _net
scaletrain.fit(_net(), _data()[0], eval_data=_data()[1], metrics=METRICS, argv=sys.argv[1:],
               config={{**CONFIG, "train.epochs": 2}})
"""


def test_on_two_ranks_each_evaluating_its_share_they_are_the_whole_splits(tmp_path: Path) -> None:
    script = tmp_path / "two.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), root=str(Path(__file__).parents[1])))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    run = tmp_path / "r"
    done = subprocess.run([*SCALETRAIN, "launch", "--nproc", "2", str(script), f"--run.dir={run}"],
                          capture_output=True, text=True, env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["eval"]["count"] == 121
    again = _recomputed(run)
    assert summary["eval"]["margin"] == pytest.approx(again["margin"], rel=1e-6)
    assert summary["eval"]["top1"] == pytest.approx(again["top1"], abs=1e-12)


def test_early_stop_and_the_best_checkpoint_follow_the_monitored_metric(tmp_path: Path) -> None:
    run = tmp_path / "r"
    summary = scaletrain.fit(_net(), _data()[0], eval_data=_data()[1], metrics=METRICS, config={
        **CONFIG, "run.dir": str(run), "train.early_stop": 2, "train.monitor": "margin", "train.monitor_mode": "max",
        "checkpoint.best": True})
    evals = [(r["step"], r["eval_margin"]) for r in _evals(run)]
    best, since, stop = -float("inf"), 0, None  # the rule recomputed from what was logged: higher is better
    for step, value in evals:
        best, since = (value, 0) if value > best else (best, since + 1)
        if since == 2:
            stop = step
            break
    assert stop is not None and evals[-1][0] == stop == summary["steps"] < 12 * 30
    assert summary["early_stop"]["monitor"] == "margin" and summary["early_stop"]["best"] == best
    step = max(evals[1:], key=lambda e: e[1])[0]
    assert summary["best_checkpoint"]["step"] == step and summary["best_checkpoint"]["eval_margin"] == best


def test_accuracy_is_monitored_by_rising(tmp_path: Path) -> None:
    summary = scaletrain.fit(_net(), _data()[0], eval_data=_data()[1], config={
        **CONFIG, "run.dir": str(tmp_path / "r"), "train.early_stop": 2, "train.monitor": "accuracy"})
    evals = [(r["step"], r["eval_accuracy"]) for r in _evals(tmp_path / "r")]
    assert summary["early_stop"]["best"] == max(a for _, a in evals)


@pytest.mark.parametrize(("config", "metrics", "error", "said"), [
    ({"train.monitor": "f1"}, METRICS, ConfigError,
     (r"^train.monitor = 'f1': expected one of loss, accuracy, top1, margin.*fix: --train.monitor=loss, or "
     r"fit\(metrics=\{'f1': fn\}\)")),
    ({"train.monitor": "margin"}, METRICS, ConfigError,
     (r"^train.monitor_mode = 'auto': expected min or max for 'margin', a metric of your own.*fix: "
     r"--train.monitor_mode=max")),
    ({}, [top1], UserError, r"^fit\(metrics=...\): a list; expected a dict of names to functions"),
    ({}, {"loss": top1}, UserError, r"^fit\(metrics=...\): the name 'loss'; expected an identifier other than loss"),
    ({}, {"top1": 1.0}, UserError, r"^fit\(metrics=\{'top1': ...\}\): a float is not a function"),
    ({}, {"n": lambda out, y: 1.0}, UserError, r"^fit\(metrics=\{'n': ...\}\) returned a float; expected a tensor"),
])
def test_bad_metrics_and_monitors_are_one_line(tmp_path: Path, config, metrics, error, said) -> None:
    with pytest.raises(error, match=said):
        scaletrain.fit(_net(), _data()[0], eval_data=_data()[1], metrics=metrics,
                       config={**CONFIG, "train.max_steps": 2, "run.dir": str(tmp_path / "r"), **config})


def test_accuracy_monitored_on_targets_that_are_not_classes_is_one_line(tmp_path: Path) -> None:
    x = torch.randn(64, 4)
    with pytest.raises(ConfigError, match=r"^train.monitor = 'accuracy': expected a measure this evaluation has: "
                                          r"loss; fix: --train.monitor=loss"):
        scaletrain.fit(nn.Linear(4, 1), (x, x.sum(1, keepdim=True)), loss_fn=nn.functional.mse_loss,
                       config={**CONFIG, "train.max_steps": 2, "run.dir": str(tmp_path / "r"), "train.early_stop": 2,
                               "train.monitor": "accuracy"})


class Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_on_eval_sees_each_evaluation_in_eval_mode_and_leaves_training_as_without_it(tmp_path: Path) -> None:
    """The hook samples from the model (random numbers drawn, dropout's module in eval mode): the trained weights
    are bit for bit those of the run without it, and it saw every evaluation's metrics as logged."""
    seen = []

    def hook(model: nn.Module, step: int, metrics: dict) -> None:
        torch.randn(100)  # a sampler's draws: its own, not training's
        seen.append((step, metrics["loss"], model.training, torch.is_grad_enabled()))

    runs = []
    for name, on_eval in (("with", hook), ("without", None)):
        torch.manual_seed(1)
        scaletrain.fit(Dropout, _data()[0], eval_data=_data()[1], on_eval=on_eval,
                       config={**CONFIG, "train.epochs": 3, "run.dir": str(tmp_path / name)})
        runs.append(safetensors.torch.load_file(tmp_path / name / "model.safetensors"))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert [(step, loss) for step, loss, _, _ in seen] == [(r["step"], r["eval_loss"]) for r in _evals(tmp_path / "with")]
    assert [step for step, *_ in seen] == [0, 30, 60, 90]
    assert not any(training or grad for _, _, training, grad in seen)


def test_on_eval_that_is_not_a_function_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"^fit\(on_eval=...\): a str is not a function"):
        scaletrain.fit(_net(), _data()[0], on_eval="print", config={**CONFIG, "run.dir": str(tmp_path / "r")})
