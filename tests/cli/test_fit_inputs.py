"""scaletrain.fit() on other people's data and models: dict and tuple batches of any length, outputs that are
not tensors, token ids; and the library path failing like the CLI (one line, exit 2) on one process and on
2 ranks under `scaletrain launch` and plain torchrun."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawn_ranks import free_port, run_ranks
from test_fit_metrics import _evals  # the eval records of a run's metrics.jsonl
from torch import nn
from torch.utils.data import Dataset
from warm import PYTHON, SCALETRAIN

import scaletrain
from scaletrain.errors import ConfigError, UserError

BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun")] if (BIN / "torchrun").exists() else [sys.executable, "-m", "torch.distributed.run"]
DIRECTIONS = torch.randn(4, 8, generator=torch.Generator().manual_seed(1234))
QUICK = {"train.epochs": 4, "data.batch_size": 32, "optim.lr": 1e-2, "train.progress": False, "log.every": 20}
# A linear model can represent argmax(x @ D.T) exactly; measured 95.7-98.4% eval accuracy over seeds 0..3 at
# these settings (chance 25-36%), so 90% is far above guessing and below every run seen.
MIN_ACCURACY = 0.90


def _points(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return x, (x @ DIRECTIONS.T).argmax(dim=1)


class DictSet(Dataset):
    """Hugging Face's layout: a dict per sample, with a column the model does not take."""

    def __init__(self, n: int, seed: int) -> None:
        self.x, self.y = _points(n, seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"features": self.x[i], "labels": self.y[i], "row_id": i}


class OwnLoss(nn.Module):
    """A transformers-style model: keyword inputs, and the loss computed inside when labels are given."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, features: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.head(features)
        return {"logits": logits, **({"loss": F.cross_entropy(logits, labels)} if labels is not None else {})}


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor


class TwoInputs(nn.Module):
    """forward(a, b) returning a dataclass: (a, b, target) tuples feed it."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> Out:
        return Out(self.head(torch.cat([a, b], dim=-1)), a.mean())


class Triples(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.x, self.y = _points(n, seed)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple:
        return self.x[i], -self.x[i], self.y[i]


def _config(tmp_path: Path, name: str) -> dict:
    return {**QUICK, "run.dir": str(tmp_path / name)}


def test_batch_fn_maps_held_out_batches_too_without_gradients(tmp_path: Path) -> None:
    """batch_fn maps every batch, training's and the held-out ones; held-out batches come to it with gradients
    off, so an augmentation of training batches only (mixup) leaves them as they are by testing
    torch.is_grad_enabled() (README: fit()): their targets stay classes, and the accuracy is counted."""
    seen: list[bool] = []

    def mixup(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        seen.append(torch.is_grad_enabled())
        if not torch.is_grad_enabled():
            return x, y
        onehot = F.one_hot(y, 4).float()
        perm = torch.randperm(x.shape[0])
        return 0.7 * x + 0.3 * x[perm], 0.7 * onehot + 0.3 * onehot[perm]

    config = {**_config(tmp_path, "mix"), "train.max_steps": 8, "train.eval_every": 8}
    summary = scaletrain.fit(lambda: nn.Linear(8, 4), _points(512, 0), eval_data=_points(128, 1), batch_fn=mixup,
                             config=config)
    assert summary["eval"]["count"] == 128.0 and 0 <= summary["eval"]["accuracy"] <= 1
    # each of 8 steps' batches with gradients, the held-out ones (4 of 32, at step 0 and 8) without
    assert seen.count(True) >= 8 and seen.count(False) == 2 * 4, seen


def test_dict_batches_train_a_model_that_computes_its_own_loss(tmp_path: Path) -> None:
    summary = scaletrain.fit(OwnLoss, DictSet(2048, 0), eval_data=DictSet(512, 1), config=_config(tmp_path, "d"))
    assert summary["steps"] == 4 * 2048 // 32
    assert summary["eval"]["count"] == 512.0  # every held-out sample once
    # The model computed its own loss; its labels are one class per sample, so nothing can be shifted: accuracy.
    assert summary["eval"]["accuracy"] >= MIN_ACCURACY, summary["eval"]
    assert summary["eval"]["loss"] < 0.5 * summary["train_loss"] + 0.5 and summary["eval"]["loss"] < 0.5
    # plan vs actual for a model of one's own (its class given): the model state planned is the one counted, but
    # for AdamW's step counter of each of its 2 tensors (4 bytes each: the plan counts the moments)
    record = summary["plan_vs_actual"]
    assert record["predicted"]["model_state_bytes"] + 2 * 4 == record["actual"]["model_state_bytes"], record


class WholeBatch(nn.Module):
    """Lightning's way: forward(batch) takes the whole dict and returns its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, batch):
        logits = self.head(batch["features"])
        return {"loss": F.cross_entropy(logits, batch["labels"]), "logits": logits}


def test_a_forward_taking_the_whole_batch_dict_trains(tmp_path: Path) -> None:
    """It stopped before step one ("a batch with keys [...] has none that the model's forward takes (batch)")."""
    summary = scaletrain.fit(WholeBatch, DictSet(2048, 0), eval_data=DictSet(512, 1), config=_config(tmp_path, "w"))
    assert summary["steps"] == 4 * 2048 // 32 and summary["eval"]["count"] == 512.0
    assert summary["eval"]["accuracy"] >= MIN_ACCURACY, summary["eval"]


def test_unformatted_hugging_face_rows_of_python_lists_train(tmp_path: Path) -> None:
    """What a datasets.Dataset gives without set_format("torch"): lists and ints, not tensors."""
    rows = [{"features": x.tolist(), "labels": int(y)} for x, y in zip(*_points(2048, 0))]
    held_out = [{"features": x.tolist(), "labels": int(y)} for x, y in zip(*_points(512, 1))]
    summary = scaletrain.fit(OwnLoss, rows, eval_data=held_out, config=_config(tmp_path, "rows"))
    assert summary["eval"]["accuracy"] >= MIN_ACCURACY, summary["eval"]


def test_tuple_batches_of_three_and_a_dataclass_output(tmp_path: Path) -> None:
    loss = lambda out, y: F.cross_entropy(out.logits, y)  # the output as returned
    summary = scaletrain.fit(TwoInputs, Triples(2048, 0), eval_data=Triples(512, 1), loss_fn=loss,
                             config=_config(tmp_path, "t"))
    assert summary["eval"]["count"] == 512.0
    assert summary["eval"]["accuracy"] >= MIN_ACCURACY, summary["eval"]


class SmoothedTuple(nn.Module):
    """nanoGPT's convention: forward(x, targets=None) -> (logits, loss), here a loss with label smoothing 0.5."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> tuple:
        logits = self.head(x)
        return logits, None if targets is None else F.cross_entropy(logits, targets, label_smoothing=0.5)


def test_a_model_returning_logits_and_its_own_loss_trains_on_its_own_loss(tmp_path: Path) -> None:
    """The loss of a (logits, loss) tuple is the one trained and reported, not scaletrain's cross-entropy: with
    label smoothing 0.5 over 4 classes no prediction gets it below the smoothed targets' entropy, 1.07 nats
    (plain cross-entropy of the same run falls to about 0.1)."""
    floor = -(0.625 * math.log(0.625) + 3 * 0.125 * math.log(0.125))  # 1.0735: entropy of the smoothed target
    summary = scaletrain.fit(SmoothedTuple, _points(2048, 0), eval_data=_points(512, 1), config=_config(tmp_path, "s"))
    assert floor < summary["train_loss"] < floor + 0.15, summary["train_loss"]
    assert floor < summary["eval"]["loss"] < floor + 0.15, summary["eval"]
    assert summary["eval"]["accuracy"] >= MIN_ACCURACY, summary["eval"]  # the logits still learn the classes


def test_batch_fn_maps_a_layout_the_convention_does_not(tmp_path: Path) -> None:
    class Renamed(DictSet):
        def __getitem__(self, i: int) -> dict:
            return {"pixels": self.x[i], "cls": self.y[i]}

    summary = scaletrain.fit(OwnLoss, Renamed(2048, 0), eval_data=Renamed(512, 1),
                             batch_fn=lambda b: ({"features": b["pixels"]}, b["cls"]), config=_config(tmp_path, "b"))
    # Labels are not given to the model here, so it returns logits only and scaletrain's cross-entropy applies.
    assert summary["eval"]["accuracy"] >= MIN_ACCURACY, summary["eval"]


class Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, 16)
        return self.table(ids)


def test_token_ids_give_tokens_per_second(tmp_path: Path) -> None:
    ids = torch.arange(64 * 9).remainder(16).reshape(64, 9)  # a repeating sequence: next token = id + 1
    summary = scaletrain.fit(Bigram, (ids[:, :-1], ids[:, 1:]), config={**_config(tmp_path, "lm"), "train.epochs": 1,
                                                                         "data.batch_size": 8})
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 8, rel=1e-12)


class ShiftedLM(nn.Module):
    """A causal LM as transformers writes one: labels are the input ids, and the loss inside shifts them (or, with
    ``how``, scores them in place as a token classifier does, or smooths them)."""

    def __init__(self, how: str = "shift") -> None:
        super().__init__()
        self.table, self.how = nn.Embedding(16, 16), how

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.table(input_ids)
        if labels is None:
            return {"logits": logits}
        if self.how == "shift":
            return {"logits": logits, "loss": F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())}
        return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                          label_smoothing=0.1 if self.how == "smooth" else 0.0)}


def test_a_loss_that_shifts_sequence_labels_is_scored_on_the_next_token(tmp_path: Path) -> None:
    """Labels (B, T) beside logits (B, T, V) from a loss computed elsewhere: scaletrain's argmax at t against label t
    said ~0% for a model that predicts every next token, and 93% for an untrained GPT-2 (its tied embedding
    predicts the current token), so such runs got no accuracy. The first training sample's output now tells which
    alignment the loss is (batch.label_shift): a shifted one is scored at t against t + 1, over the positions it
    counts (7 of 8 per sequence); one matching neither (label smoothing) still gets none."""
    ids = torch.arange(64 * 8).remainder(16).reshape(64, 8)  # next token = id + 1
    samples = [{"input_ids": row, "labels": row} for row in ids]
    config = {"train.epochs": 20, "data.batch_size": 8, "optim.lr": 0.1}
    summary = scaletrain.fit(ShiftedLM, samples[:48], eval_data=samples[48:], config={**_config(tmp_path, "shift"),
                                                                                       **config})
    assert summary["eval"]["count"] == 16 * 7 and summary["eval"]["accuracy"] == 1.0, summary["eval"]
    assert _evals(tmp_path / "shift")[0]["eval_accuracy"] < 0.5  # untrained
    # The same shift in a loss_fn of one's own (the ids as the target of their own logits).
    shifted = lambda out, ids: F.cross_entropy(out[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    summary = scaletrain.fit(Bigram, (ids[:48], ids[:48]), eval_data=(ids[48:], ids[48:]), loss_fn=shifted,
                             config={**_config(tmp_path, "own"), **config})
    assert summary["eval"]["count"] == 16 * 7 and summary["eval"]["accuracy"] == 1.0, summary["eval"]
    # A token classifier's own loss scores each position in place: every position counted.
    tagged = [{"input_ids": row, "labels": (row + 3) % 16} for row in ids]
    summary = scaletrain.fit(lambda: ShiftedLM("tag"), tagged[:48], eval_data=tagged[48:],
                             config={**_config(tmp_path, "tag"), **config})
    assert summary["eval"]["count"] == 16 * 8 and summary["eval"]["accuracy"] == 1.0, summary["eval"]
    summary = scaletrain.fit(lambda: ShiftedLM("smooth"), tagged[:48], eval_data=tagged[48:],
                             config={**_config(tmp_path, "smooth"), **config})
    assert "accuracy" not in summary["eval"] and summary["eval"]["count"] == 16 * 8, summary["eval"]


def test_label_shift_tells_the_alignments_apart_and_admits_what_it_cannot() -> None:
    from scaletrain.batch import label_shift

    torch.manual_seed(0)
    logits, labels = torch.randn(2, 6, 10) * 0.01, torch.randint(0, 10, (2, 6))  # near-uniform: both CEs ~log 10
    ce = lambda lo, y: F.cross_entropy(lo.flatten(0, 1), y.flatten())
    assert label_shift(logits, labels, ce(logits, labels)) == 0
    assert label_shift(logits, labels, ce(logits[:, :-1], labels[:, 1:])) == 1
    assert label_shift(logits, labels, ce(logits, labels) * 1.01) is None  # neither
    flat = torch.zeros(2, 6, 10)  # both alignments score log 10 exactly: no telling
    assert label_shift(flat, labels, ce(flat, labels)) is None
    assert label_shift(logits, labels.float(), ce(logits, labels)) is None
    one_each = logits[:, 0], labels[:, 0]  # one class per sample: nothing to shift (accuracy needs no shift)
    assert label_shift(*one_each, F.cross_entropy(*one_each)) is None


def test_a_refused_run_dir_is_one_line_and_exit_2_on_one_process(tmp_path: Path) -> None:
    finished = tmp_path / "done"
    finished.mkdir()
    (finished / "summary.json").write_text("{}")
    proc = subprocess.run([*PYTHON, str(_script(tmp_path)), str(finished)], check=False, capture_output=True,
                          text=True, timeout=120, env=_env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [_refusal(finished)]


def test_an_error_that_is_not_scaletrains_keeps_its_traceback(tmp_path: Path) -> None:
    script = tmp_path / "bug.py"
    script.write_text("import scaletrain, torch\n"
                      "scaletrain.fit(lambda: torch.nn.Linear(7, 4), (torch.randn(64, 8), torch.zeros(64).long()),\n"
                      f"               config={{'run.dir': {str(tmp_path / 'r')!r}, 'train.progress': False}})\n")
    proc = subprocess.run([*PYTHON, str(script)], check=False, capture_output=True, text=True, timeout=120,
                          env=_env())
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr  # a bug in the user's code: theirs to read
    assert "scaletrain: error" not in proc.stderr


def test_a_stopped_fit_does_not_return_to_the_code_after_it(tmp_path: Path) -> None:
    """fit() stopped after saving (a preemption, here chaos.interrupt_step) returned a dict without the summary's
    keys: a script reading its result after fit() ended in a KeyError traceback, exit 1 (and `scaletrain
    verify-resume` of it failed). Now the stop ends the program as the CLI's does (exit 0, nothing after fit()
    ran, no traceback) and the same command resumes and finishes."""
    script = tmp_path / "fit_then_report.py"
    script.write_text("import sys, torch, scaletrain\n"
                      "x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0)); y = (x.sum(1) > 0).long()\n"
                      "summary = scaletrain.fit(lambda: torch.nn.Linear(8, 2), (x, y), config={'train.max_steps': 6,\n"
                      "                         'train.progress': False, 'run.dir': 'run'})\n"
                      "print('finished, held-out accuracy', summary['eval']['accuracy'])\n")
    command = [*SCALETRAIN, "launch", "--nproc", "2", str(script)]
    stopped = subprocess.run([*command, "--chaos.interrupt_step=3"], cwd=tmp_path, check=False, capture_output=True,
                             text=True, timeout=180, env=_env())
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "stopped (chaos.interrupt_step) at step 3" in stopped.stdout and "finished" not in stopped.stdout
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    done = subprocess.run(command, cwd=tmp_path, check=False, capture_output=True, text=True, timeout=180,
                          env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from run/checkpoints/step-00000003: step 3 of 6" in done.stdout, done.stdout[-3000:]
    assert done.stdout.count("finished, held-out accuracy") == 2  # each rank, after the whole run


@pytest.mark.parametrize("launcher", ["launch", "torchrun"])
def test_a_refused_run_dir_is_one_line_and_exit_2_on_two_ranks(tmp_path: Path, launcher: str) -> None:
    """Rank 0 refuses a finished run directory and broadcasts the refusal; every rank stops with exit 2 and the
    line is said once (rank 1 could not even unpickle the error before)."""
    finished = tmp_path / "done"
    finished.mkdir()
    (finished / "summary.json").write_text("{}")
    prefix = [*SCALETRAIN, "launch", "--nproc", "2"] if launcher == "launch" else \
        [*TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port())]
    proc = subprocess.run([*prefix, str(_script(tmp_path)), str(finished)], check=False, capture_output=True,
                          text=True, timeout=180, env=_env(), cwd=tmp_path)
    ours = [line for line in proc.stderr.splitlines() if "scaletrain:" in line]
    assert ours == [_refusal(finished)], proc.stderr
    assert "scaletrain/" not in proc.stderr  # no frame of scaletrain's code: no worker traceback
    if launcher == "launch":
        assert proc.returncode == 2
        assert proc.stderr.splitlines() == ours, proc.stderr  # nothing else: not the agent's log either
    else:  # torchrun reports its workers' exit codes in its own summary, which we do not control
        assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr


UNUSED = """import sys, torch, scaletrain
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.aux_head = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)  # aux_head: never called
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
    def forward(self, x):
        return self.body(self.frozen(x))
x = torch.randn(256, 8); y = (x.sum(1) > 0).long()
scaletrain.fit(Net, (x, y), config={'train.progress': False, 'train.max_steps': 3}, argv=sys.argv[1:])
"""


def test_parameters_without_a_gradient_under_ddp_are_named_in_one_line(tmp_path: Path) -> None:
    """A model with a layer its forward never calls: DDP's page about "finished reduction in the prior
    iteration" (raised on every rank in the step after) becomes one line naming the parameters, said once,
    exit 2; --parallel.find_unused=true, the fix it gives, then trains."""
    line = _refused_then_fixed(tmp_path, UNUSED, [], ["--parallel.find_unused=true"])
    assert ("got no gradient in step 1 (aux_head.weight, aux_head.bias)" in line
            and "fix: --parallel.find_unused=true" in line), line
    assert (tmp_path / "b" / "summary.json").is_file()


def _refused_then_fixed(tmp_path: Path, text: str, refused_args: list[str], fixed_args: list[str]) -> str:
    """The script ``text`` under `scaletrain launch --nproc 2`: refused with ``refused_args`` (run dir a), in
    one line said once, exit 2, no traceback; trained with the fix, ``fixed_args`` (run dir b). Returns the line."""
    script = tmp_path / "script.py"
    script.write_text(text)

    def launch(run_dir: str, args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*SCALETRAIN, "launch", "--nproc", "2", str(script), f"--run.dir={tmp_path / run_dir}",
                               *args], check=False, capture_output=True, text=True, timeout=180, env=_env(),
                              cwd=tmp_path)

    refused = launch("a", refused_args)
    assert refused.returncode == 2, refused.stderr[-3000:]
    ours = [line for line in refused.stderr.splitlines() if "scaletrain:" in line]
    assert len(ours) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    fixed = launch("b", fixed_args)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    return ours[0]


CASTS = """import sys, torch, scaletrain
class Router(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.classifier = torch.nn.Linear(8, 8)
    def forward(self, x):
        self.classifier = self.classifier.to(torch.float32)  # as transformers' Switch router does
        return self.classifier(x.float()).softmax(-1).to(x.dtype)
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.mlp = Router(), torch.nn.Linear(8, 8)
    def forward(self, x):
        return x + self.mlp(x) * self.router(x)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks, self.head = torch.nn.ModuleList(Block() for _ in range(2)), torch.nn.Linear(8, 2)
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
x = torch.randn(256, 8); y = (x.sum(1) > 0).long()
scaletrain.fit(Net, (x, y), config={'train.progress': False, 'train.max_steps': 3}, argv=sys.argv[1:])
"""


def test_a_module_that_casts_itself_to_float32_under_fsdp_mixed_precision_is_one_line(tmp_path: Path) -> None:
    """A block holding a module that turns its parameters to float32 inside forward (transformers' Switch
    router) under FSDP and bf16-mixed: FSDP2's AssertionError about gradients of two dtypes, a traceback on every
    rank, becomes one line with the fix, said once, exit 2; the fix it gives (fp32) trains."""
    fsdp = "--parallel.strategy=fsdp"
    line = _refused_then_fixed(tmp_path, CASTS, [fsdp, "--train.precision=bf16-mixed"], [fsdp, "--train.precision=fp32"])
    assert line.startswith("scaletrain: error: train.precision = 'bf16-mixed': expected a model whose forward") \
        and "fix: --train.precision=fp32, or --parallel.strategy=ddp" in line, line


SCALAR = """import sys, torch, scaletrain
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 2)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.0))  # a 0-dimensional parameter, as CLIP's
    def forward(self, x):
        return self.body(x) * self.logit_scale.exp()
x = torch.randn(256, 8); y = (x.sum(1) > 0).long()
scaletrain.fit(Net, (x, y), config={'train.progress': False, 'train.max_steps': 3}, argv=sys.argv[1:])
"""


def test_a_scalar_parameter_under_fsdp_is_one_line(tmp_path: Path) -> None:
    """transformers' CLIPModel (logit_scale, a 0-dimensional parameter) under FSDP: fully_shard's ValueError, a
    traceback on every rank, is one line naming the parameter with the fix; DDP, the fix it gives, trains it."""
    line = _refused_then_fixed(tmp_path, SCALAR, ["--parallel.strategy=fsdp"], ["--parallel.strategy=ddp"])
    assert line.startswith("scaletrain: error: parallel.strategy = 'fsdp': expected a model without "
                           "0-dimensional parameters") and "(here: logit_scale;" in line \
        and "fix: --parallel.strategy=ddp" in line, line


def _sweep(rank: int, world: int, where: str) -> list[str]:
    """A small sweep on every rank: one fit() after another in one process."""
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    y = x[:, :4].argmax(1)
    os.chdir(where)
    return [scaletrain.fit(lambda: nn.Linear(8, 4), (x, y), argv=["--dist.timeout_s=60"],
                           config={"run.name": "sweep", "optim.lr": lr, "train.epochs": 1, "data.batch_size": 16,
                                   "train.progress": False})["run_dir"] for lr in (0.1, 0.01)]


def test_fit_called_twice_on_two_ranks_trains_twice(tmp_path: Path) -> None:
    """Two fit() calls in one 2-rank job (ranks meeting in one store, as torchrun's agent's): the second process
    group read the first one's Gloo addresses in the store (dead by then) and hung in init_process_group until
    dist.timeout_s, then a traceback. Each group's keys now have a namespace of their own; each summary names
    its run directory."""
    assert run_ranks(_sweep, 2, str(tmp_path), timeout_s=120) == [["runs/sweep", "runs/sweep-2"]] * 2
    assert all((tmp_path / "runs" / name / "summary.json").is_file() for name in ("sweep", "sweep-2"))


def _refusal(finished: Path) -> str:
    return (f"scaletrain: error: run.dir = '{finished}': expected a new or unfinished run directory ({finished}/"
            f"summary.json says this one finished); fix: --run.dir={finished}-2, or remove {finished} first")


def _script(tmp_path: Path) -> Path:
    script = tmp_path / "fit_byo.py"
    script.write_text("import sys, torch, scaletrain\n"
                      "x = torch.randn(256, 8); y = (x.sum(1) > 0).long()\n"
                      "scaletrain.fit(lambda: torch.nn.Linear(8, 2), (x, y),\n"
                      "               config={'run.dir': sys.argv[1], 'train.progress': False})\n")
    return script


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def test_evaluation_is_bounded_by_default_and_whole_on_request(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """train.eval_batches (default 100 per rank) caps each evaluation, spread over the split, and the run says
    so once at start; 0 evaluates every held-out sample."""
    x, y = _points(2600, 0)
    cfg = {**_config(tmp_path, "e"), "train.epochs": 1, "data.batch_size": 8}
    bounded = scaletrain.fit(lambda: nn.Linear(8, 4), (x[:600], y[:600]), eval_data=(x[600:], y[600:]), config=cfg)
    assert bounded["eval"]["count"] == 100 * 8  # of 2000
    out = capsys.readouterr().out
    assert out.count("eval: 800 of 2,000 held-out samples") == 1, out
    whole = scaletrain.fit(lambda: nn.Linear(8, 4), (x[:600], y[:600]), eval_data=(x[600:], y[600:]),
                           config={**cfg, "run.dir": str(tmp_path / "all")}, argv=["--train.eval_batches=0"])
    assert whole["eval"]["count"] == 2000
    assert "held-out samples, spread" not in capsys.readouterr().out


def test_the_command_line_goes_on_top_of_a_config_object(tmp_path: Path) -> None:
    """fit(argv=sys.argv[1:]) as a session's: `--key=value` and `--key value` over a Config (or a mapping)."""
    from scaletrain.config import load

    x, y = _points(640, 0)
    cfg = load(None, overrides={**_config(tmp_path, "c"), "data.source": "memory", "train.epochs": 1})
    summary = scaletrain.fit(lambda: nn.Linear(8, 4), (x[:512], y[:512]), eval_data=(x[512:], y[512:]), config=cfg,
                             argv=["--data.batch_size=16", "--train.epochs", "2"])
    assert (summary["global_batch"], summary["steps"], summary["epochs"]) == (16, 2 * 512 // 16, 2.0)


OWN_ARGS = """import argparse, sys, torch, scaletrain
parser = argparse.ArgumentParser()
parser.add_argument("features", type=int)
parser.add_argument("--width", type=int, default=4)
args, _ = parser.parse_known_args()
x = torch.randn(256, args.features); y = (x.sum(1) > 0).long()
net = lambda: torch.nn.Sequential(torch.nn.Linear(args.features, args.width), torch.nn.Linear(args.width, 2))
summary = scaletrain.fit(net, (x, y), config={'train.progress': False, 'run.dir': 'runs/mine'})
# one write of the whole line: print() writes each of its arguments apart, and under `python -u` (torchrun's) the
# other rank's line can land between them
sys.stdout.write(f"SAW {args.width} {summary['run_dir']} {summary['strategy']} {summary['steps']}\\n")
"""


def test_fit_without_argv_takes_the_command_lines_options_and_leaves_the_scripts_own(tmp_path: Path) -> None:
    """`scaletrain launch --nproc 2 mine.py 8 --parallel.strategy=fsdp --run.dir=runs/given --train.max_steps 3`
    on a script calling fit() without argv trained under DDP in runs/mine for all its epochs, without a word:
    the options reached no one (and verify-resume's --run.dir and --chaos.* neither: "traced no step"). fit()
    and session() now read the command line's --section.key options; the script's own (a positional, --width)
    are left to it, argparse's parse_known_args reading them as before."""
    (tmp_path / "mine.py").write_text(OWN_ARGS)
    proc = subprocess.run([*SCALETRAIN, "launch", "--nproc", "2", "mine.py", "8", "--parallel.strategy=fsdp",
                           "--width", "6", "--run.dir=runs/given", "--train.max_steps", "3"], check=False,
                          capture_output=True, text=True, timeout=180, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("SAW 6 runs/given fsdp 3\n") == 2, proc.stdout


def test_the_command_lines_options_are_told_from_a_scripts_own() -> None:
    from scaletrain.cli.options import command_line_options

    line = ["data.csv", "--lr", "0.1", "--train.max_steps", "5", "--run.dir=r", "--model.kind.x", "--log.trace",
            "--verbose", "--parallel.strategy", "--other", "--", "--optim.lr=1"]
    assert command_line_options(line) == ["--train.max_steps", "5", "--run.dir=r", "--model.kind.x", "--log.trace",
                                          "--parallel.strategy"]  # --model.kind.x: ours, and refused by name
    assert command_line_options(["--nproc", "2", "--trainer.x=1", "--train"]) == []  # aliases, other sections


def test_a_session_without_argv_reads_the_command_line_and_argv_given_replaces_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from scaletrain.train.session import resolve_config

    monkeypatch.setattr(sys, "argv", ["my.py", "7", "--optim.lr", "0.5", "--mine=1"])
    assert resolve_config({"optim.lr": 0.1}, None, defaults={}).optim.lr == 0.5
    assert resolve_config({"optim.lr": 0.1}, [], defaults={}).optim.lr == 0.1
    monkeypatch.setattr(sys, "argv", ["my.py", "--optim.lrr=0.5"])
    with pytest.raises(ConfigError, match="did you mean"):
        resolve_config(None, None, defaults={})
    # fit(argv=[]) reads none of them, and the session fit() opens does not read them again (it logged every
    # step, as the command line's --log.every=1 said, over the config's 100)
    monkeypatch.setattr(sys, "argv", ["my.py", "--log.every=1"])
    x, y = _points(256, 0)
    summary = scaletrain.fit(lambda: nn.Linear(8, 4), (x, y), config={**_config(tmp_path, "none"), "train.epochs": 1,
                                                                        "log.every": 100}, argv=[])
    records = [json.loads(line) for line in (tmp_path / "none" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 6 and [r["step"] for r in records if r["kind"] == "train"] == [6]


@pytest.mark.parametrize("argv", [["--nproc", "2"], ["--nnodes=2", "--rdzv-endpoint=node0:29500"]])
def test_workers_asked_of_a_script_run_as_one_process_are_one_line(tmp_path: Path, argv: list[str]) -> None:
    """`python my.py --nproc 2` trained on one process without a word (fit() joins the workers a launcher starts
    and starts none): now a config error naming the launcher command."""
    with pytest.raises(ConfigError, match=r"expected 1 in a script run as one process: .* fix: scaletrain launch "
                                          r"--nproc \d+ \S+ \(or torchrun --nproc_per_node"):
        scaletrain.fit(lambda: nn.Linear(8, 4), _points(64, 0), config=_config(tmp_path, "np"), argv=argv)
    assert not (tmp_path / "np").exists()


def test_float64_data_for_a_float32_model_is_one_line_naming_the_data(tmp_path: Path) -> None:
    """numpy's float64 arrays into a float32 model: torch's "mat1 and mat2 must have the same dtype" from inside
    the model's first forward becomes a data error naming float64 and the fix (exit 2 from a script); the same
    data as float32 trains."""
    import numpy as np

    from scaletrain.errors import UserError

    x, y = _points(256, 0)
    with pytest.raises(UserError, match=r"data: the model's first forward failed \(mat1 and mat2 must have the same "
                                        r"dtype.*the samples hold float64 tensors .* fix: make the data float32"):
        scaletrain.fit(lambda: nn.Linear(8, 4), (x.double().numpy(), y.numpy()), config=_config(tmp_path, "f64"))
    done = scaletrain.fit(lambda: nn.Linear(8, 4), (x.double().numpy().astype(np.float32), y.numpy()),
                          config={**_config(tmp_path, "f32"), "train.epochs": 1})
    assert done["steps"] > 0


class NeedsWidth(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.head = nn.Linear(8, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


@pytest.mark.parametrize("mistake, said", [
    ("class needs arguments", (r"model: NeedsWidth\(\) is called with no arguments to build the model, and missing a "
                              r"required argument: 'width'; fix: pass an instance \(NeedsWidth\(...\)\)")),
    ("loss of one argument", r"loss_fn: scaletrain calls loss_fn\(output, target\), and <lambda> cannot take that"),
    ("loss per sample", r"loss_fn: <lambda> returned a tensor of shape \(32,\), not one number; fix: reduce it"),
    ("loss as a float", r"loss_fn: <lambda> returned a float, not a tensor; .* fix: return the loss as a tensor"),
    ("loss with logs", r"loss_fn: <lambda> returned a tuple, not a tensor; .* fix: return the loss tensor alone"),
    ("loss without a gradient", (r"loss_fn: <lambda> returned a loss without a gradient \(int64\): nothing "
                                 r"differentiable leads from the model's output to it .* not the accuracy\)$")),
    ("integer features", (r"data: the model's first forward failed \(mat1 and mat2 must have the same dtype.*the "
                         r"inputs hold int64 tensors and the model's parameters are float32; fix: make the features")),
    ("multi-hot targets", r"loss: the float targets are not class probabilities .*binary_cross_entropy_with_logits"),
    ("a label too many", r"loss: class target 4 for logits of 4 classes .* \(5 here\)"),
    ("a bfloat16 model", (r"model: its first forward failed \(.*\): its parameters are bfloat16 and the inputs "
                          r"float32; fix: keep the model in float32 and train with --train.precision=bf16-mixed")),
    ("a float64 model", (r"model: its first forward failed \(.*\): its parameters are float64 and the inputs "
                         r"float32; fix: keep the model in float32 \(drop its .double\(\)")),
    # held-out features of another width: a traceback at the evaluation before step 1
    ("held-out data of another layout", (r"eval_data: the model's forward failed on the first held-out batch "
                                         r"\(mat1 and mat2 shapes cannot be multiplied .*\): its inputs are float32 "
                                         r"\(5,\) per sample, and the training samples' float32 \(8,\); fix: ")),
    # (x, weight, y): torch's 'Linear.forward() takes 2 positional arguments but 3 were given', traceback and all
    ("a sample weight", (r"model: Linear.forward\(input\) cannot take what each sample gives it: 2 positional inputs "
                         r"\(a sample's items but the last, which is the target\): too many positional arguments; "
                         r"fix: .* batch_fn=lambda b: \(b\[0\], b\[-1\]\)\)")),
])
def test_first_mistakes_with_fit_are_one_line(tmp_path: Path, mistake: str, said: str) -> None:
    """What users get wrong in the first minutes, before or at the first step: one line naming it, with the fix
    (a script exits 2 with it), not a traceback from inside scaletrain or torch."""
    x, y = _points(256, 0)
    model, data, loss_fn, eval_data = (lambda: nn.Linear(8, 4)), (x, y), None, None
    if mistake == "class needs arguments":
        model = NeedsWidth
    elif mistake == "loss of one argument":
        loss_fn = lambda out: out.mean()
    elif mistake == "loss per sample":
        loss_fn = lambda out, t: F.cross_entropy(out, t, reduction="none")
    elif mistake == "loss as a float":
        loss_fn = lambda out, t: float(F.cross_entropy(out, t))
    elif mistake == "loss with logs":
        loss_fn = lambda out, t: (F.cross_entropy(out, t), {"accuracy": (out.argmax(-1) == t).float().mean()})
    elif mistake == "loss without a gradient":
        loss_fn = lambda out, t: (out.argmax(-1) != t).sum()
    elif mistake == "integer features":
        data = ((x * 10).long(), y)
    elif mistake == "multi-hot targets":
        data = (x, (x[:, :4] > 0).float())
    elif mistake == "a bfloat16 model":
        model = lambda: nn.Linear(8, 4).to(torch.bfloat16)
    elif mistake == "a float64 model":
        model = lambda: nn.Linear(8, 4).double()
    elif mistake == "held-out data of another layout":
        eval_data = (torch.randn(32, 5), y[:32])
    elif mistake == "a sample weight":
        data = list(zip(x, torch.rand(256), y))
    elif mistake == "a label too many":
        data = (x, torch.where(torch.arange(256) == 200, 4, y))  # one sample of 256, not the first
    with pytest.raises(UserError, match=said) as err:
        scaletrain.fit(model, data, eval_data=eval_data, loss_fn=loss_fn, config=_config(tmp_path, "m"))
    assert "\n" not in str(err.value)


def test_a_model_given_compiled_trains_compiled_and_saves_its_own_names(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile(model) given to fit(): its module is set up and compiled as train.compile does it (before
    any wrapping), so the weights are named 'weight', not '_orig_mod.weight', and the verdict does not tell
    the user to compile what is compiled."""
    import safetensors.torch

    from scaletrain.train import session as session_module

    seen: list[bool] = []
    real = session_module.parallelize

    def spy(*args, **kwargs):
        seen.append(kwargs["compile"])
        return real(*args, **kwargs)

    monkeypatch.setattr(session_module, "parallelize", spy)
    x, y = _points(256, 0)
    summary = scaletrain.fit(torch.compile(nn.Linear(8, 4)), (x, y),
                             config={**_config(tmp_path, "c"), "train.max_steps": 3})
    assert seen == [True]
    assert sorted(safetensors.torch.load_file(str(tmp_path / "c" / "model.safetensors"))) == ["bias", "weight"]
    assert "torch.compile" not in summary["bottleneck"]["fix"], summary["bottleneck"]


def test_eval_indices_spread_over_the_split() -> None:
    from scaletrain.data import eval_indices

    assert eval_indices(10, batch_size=4, world=2) == list(range(10))
    assert eval_indices(10, batch_size=4, world=2, max_batches=5) == list(range(10))  # 40 >= 10: all
    chosen = eval_indices(1000, batch_size=4, world=2, max_batches=5)
    assert len(chosen) == 40 and len(set(chosen)) == 40
    assert chosen[0] == 0 and chosen[-1] == 975  # first to last part of the split, every 25th sample


def test_a_model_of_ones_own_on_the_meta_device_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """scaletrain fills the weights of its built-in models built on the meta device, not of a model of one's own
    (it cannot know their initialisation): one line, exit 2, before any step."""
    script = tmp_path / "meta.py"
    script.write_text("import scaletrain, torch\n"
                      "with torch.device('meta'):\n"
                      "    model = torch.nn.Linear(8, 4)\n"
                      "scaletrain.fit(model, (torch.randn(64, 8), torch.randint(0, 4, (64,))),\n"
                      f"               config={{'run.dir': {str(tmp_path / 'r')!r}, 'train.progress': False}})\n")
    proc = subprocess.run([*PYTHON, str(script)], check=False, capture_output=True, text=True, timeout=120,
                          env=_env())
    assert proc.returncode == 2, proc.stderr
    said = ("scaletrain: error: this Linear's parameters are on the meta device (no values), and scaletrain fills "
            "only its built-in models' weights; fix: build the model on the CPU (or load its weights) before training it")
    assert proc.stderr.splitlines() == [said]


class Ragged(Dataset):
    """Token sequences of 3 to 9 ids, the label their first id's parity: they need padding to make a batch."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(0, 16, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i].tolist(), "labels": int(self.rows[i][0]) % 2}


class FirstToken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(16, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        assert attention_mask is None or attention_mask.shape == input_ids.shape  # the collator's, passed on
        return self.table(input_ids[:, 0])


def pad(samples: list[dict]) -> dict:
    """What a padding collator does (transformers' DataCollatorWithPadding): pad to the batch's longest."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.tensor([s["input_ids"] + [0] * (longest - len(s["input_ids"])) for s in samples])
    mask = torch.tensor([[1] * len(s["input_ids"]) + [0] * (longest - len(s["input_ids"])) for s in samples])
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([s["labels"] for s in samples])}


def test_a_collate_fn_pads_sequences_of_unequal_length(tmp_path: Path) -> None:
    config = {**_config(tmp_path, "pad"), "train.epochs": 3, "optim.lr": 0.1}
    with pytest.raises(UserError, match="field 'input_ids' has different shapes in one batch"):
        scaletrain.fit(FirstToken, Ragged(512, 0), eval_data=Ragged(128, 1), config=config)
    summary = scaletrain.fit(FirstToken, Ragged(512, 0), eval_data=Ragged(128, 1), collate_fn=pad,
                             config={**config, "run.dir": str(tmp_path / "padded")})
    assert summary["eval"]["count"] == 128.0 and summary["eval"]["accuracy"] == 1.0, summary["eval"]


class OpenedInWorkers(Dataset):
    """Read in a DataLoader worker through a handle that worker opened (as an HDF5 file is opened per worker by
    a worker_init_fn): a worker's read without it fails; this process reads directly."""

    def __init__(self, n: int) -> None:
        self.x, self.y = _points(n, 0)
        self.opened_by: int | None = None

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        worker = torch.utils.data.get_worker_info()
        if worker is not None and self.opened_by != worker.id:
            raise RuntimeError(f"worker {worker.id} read before it opened its handle")
        return self.x[i], self.y[i]


def _open_handle(worker_id: int) -> None:
    torch.utils.data.get_worker_info().dataset.opened_by = worker_id


def test_a_dataloaders_worker_init_fn_runs_in_its_workers(tmp_path: Path) -> None:
    """fit() and st.loader() keep a DataLoader's worker_init_fn (it was dropped: every read failed), and the data
    set it sets up through get_worker_info().dataset is the data set's own, not scaletrain's wrapper around it."""
    import multiprocessing

    from torch.utils.data import DataLoader

    given = DataLoader(OpenedInWorkers(256), batch_size=16, shuffle=True, num_workers=2, worker_init_fn=_open_handle)
    summary = scaletrain.fit(nn.Linear(8, 4), given, config={**_config(tmp_path, "w"), "train.max_steps": 6,
                                                             "data.batch_size": 16, "train.eval_batches": 0})
    assert summary["steps"] == 6
    # ... and its workers (training's and evaluation's) are gone once fit() returns: left to the garbage collector,
    # their shutdown came after their queues were finalized, and the next gc.collect() waited 5 s on each of them
    assert multiprocessing.active_children() == []
    with scaletrain.session({"run.dir": str(tmp_path / "s"), "train.max_steps": 3, "data.batch_size": 16}) as st:
        model, opt = st.setup(nn.Linear(8, 4), lambda p: torch.optim.SGD(p, lr=0.1))
        for xb, yb in st.loader(OpenedInWorkers(256), worker_init_fn=_open_handle):
            with st.step():
                st.backward(F.cross_entropy(model(xb), yb))
                opt.step()
                opt.zero_grad()
            if st.done:
                break
        assert st.steps == 3
    assert multiprocessing.active_children() == []


def test_dataloaders_train_as_their_datasets_with_their_settings(tmp_path: Path) -> None:
    """A script's own DataLoaders (plain torch, Lightning's trainer.fit): their dataset, batch size, collate_fn
    and shuffle, sharded and reshuffled as fit()'s own; the same weights, bitwise, as the dataset given with
    the same settings. A key given in the config wins over the loader's."""
    from torch.utils.data import DataLoader

    config = {**_config(tmp_path, "set"), "train.epochs": 2, "data.batch_size": 16, "data.eval_batch_size": 50}
    torch.manual_seed(0)
    by_set = FirstToken()
    summary = scaletrain.fit(by_set, Ragged(512, 0), eval_data=Ragged(128, 1), collate_fn=pad, config=config)
    torch.manual_seed(0)
    by_loader = FirstToken()
    loaders = (DataLoader(Ragged(512, 0), batch_size=16, shuffle=True, collate_fn=pad),
               DataLoader(Ragged(128, 1), batch_size=50, collate_fn=pad))
    unset = {k: v for k, v in QUICK.items() if k != "data.batch_size"}  # the loaders' batch sizes, then
    loaded = scaletrain.fit(by_loader, loaders[0], eval_data=loaders[1],
                            config={**unset, "run.dir": str(tmp_path / "loader"), "train.epochs": 2})
    assert loaded["steps"] == summary["steps"] == 2 * (512 // 16)
    assert all(torch.equal(a, b) for a, b in zip(by_set.parameters(), by_loader.parameters()))
    assert loaded["eval"] == summary["eval"] and loaded["eval"]["count"] == 128.0
    wider = scaletrain.fit(FirstToken(), loaders[0], config={**unset, "run.dir": str(tmp_path / "wide"),
                                                             "train.epochs": 1, "data.batch_size": 64})
    assert wider["steps"] == (512 - math.ceil(512 * 0.2)) // 64  # the config's 64, not the loader's 16


def test_a_dataloader_with_a_sampler_of_its_own_is_one_line(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader, SubsetRandomSampler

    x, y = _points(256, 0)
    loader = DataLoader(list(zip(x, y)), batch_size=32, sampler=SubsetRandomSampler(range(128)))
    with pytest.raises(UserError, match=(r"^fit\(\): a DataLoader reading its sampler SubsetRandomSampler cannot be "
                                         r"sharded over ranks and resumed exactly; fix: pass its dataset, as fit\(model, "
                                         r"loader.dataset, config=\{'data.batch_size': ...\}, collate_fn=")):
        scaletrain.fit(nn.Linear(8, 4), loader, config=_config(tmp_path, "w"))


class RareCounter(nn.Module):
    """A linear model that counts the training samples it sees and the rare ones among them (first input 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.seen = [0, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen[0] += len(x)
            self.seen[1] += int((x[:, 0] == 1).sum())
        return self.lin(x)


def test_a_weighted_random_sampler_draws_its_epochs_by_weight(tmp_path: Path) -> None:
    """A DataLoader reading a WeightedRandomSampler (rare samples, 10%, weighed 9): training draws by weight, about
    half rare (10% unweighted), its epoch the sampler's num_samples in proportion to the samples kept after the
    held-out split; the held-out samples are evaluated each once, unweighted."""
    from torch.utils.data import DataLoader, WeightedRandomSampler

    x, y = _points(500, 0)
    x[:, 0] = (torch.arange(500) % 10 == 0).float()  # every tenth sample rare
    weights = 1 + 8 * x[:, 0]
    loader = DataLoader(list(zip(x, y)), batch_size=20, sampler=WeightedRandomSampler(weights, 1000))
    model = RareCounter()
    summary = scaletrain.fit(model, loader, config={**_config(tmp_path, "w"), "train.epochs": 2})
    assert summary["steps"] == 2 * (800 // 32)  # 400 samples kept: 800 of the 1000 draws per epoch, batches of 32
    assert summary["eval"]["count"] == 100.0
    # 50 batches of 32 (and fit's own first forwards, which measure the model, a sample or two)
    assert 50 * 32 <= model.seen[0] <= 50 * 32 + 4 and 0.4 < model.seen[1] / model.seen[0] < 0.6, model.seen


class VAE(nn.Module):
    """A model that returns its loss and nothing else (a VAE's ELBO), trained on unlabelled rows."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(8, 4), nn.Linear(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        rec = self.dec(mu + torch.randn_like(mu) * (0.5 * logvar).exp())
        return ((rec - x) ** 2).sum(-1).mean() - 0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(-1).mean()


def test_a_tensor_of_rows_trains_a_model_that_returns_its_loss(tmp_path: Path) -> None:
    """fit(model, x): a tensor's rows are unlabelled samples, as a DataLoader takes it; a model returning one
    number returns its loss (both were one line refusing them). Measured: held-out loss 22.5 -> 4.9 in 10 epochs."""
    x = torch.randn(1024, 2, generator=torch.Generator().manual_seed(0)) @ torch.randn(
        2, 8, generator=torch.Generator().manual_seed(1))  # 8 features on a 2-dimensional plane
    summary = scaletrain.fit(VAE, x, config={**_config(tmp_path, "vae"), "train.epochs": 10})
    records = [json.loads(line) for line in (tmp_path / "vae" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if r.get("kind") == "eval"]
    assert summary["eval"]["count"] == 205.0 and "accuracy" not in summary["eval"]
    assert evals[-1] < 0.4 * evals[0], evals


class Deep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body, self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU()), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _wrapped(rank: int, world: int, root: str) -> list[dict[str, torch.Tensor]]:
    """A script's own DDP wrapper given to fit(), beside the bare model, on the script's own group."""
    import safetensors.torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    x, y = _points(256, 0)
    out = []
    for name, model in (("bare", Deep()), ("ddp", DistributedDataParallel(Deep())), ("dp", nn.DataParallel(Deep()))):
        scaletrain.fit(model, (x, y), config={**QUICK, "run.dir": f"{root}/{name}", "train.max_steps": 5})
        out.append(safetensors.torch.load_file(f"{root}/{name}/model.safetensors"))
    return out


def test_a_model_the_script_wrapped_in_ddp_itself_trains_as_the_bare_model(tmp_path: Path) -> None:
    """DistributedDataParallel (or DataParallel) made by the script is taken off: fit() wraps the module for
    its layout, so the gradients are all-reduced once (DDP in DDP did it twice) and the weights keep their own
    names (they were saved as module.body.0.weight, which the bare model does not load)."""
    bare, ddp, dp = run_ranks(_wrapped, 2, str(tmp_path), timeout_s=120)[0]
    assert sorted(ddp) == sorted(dp) == sorted(bare) == sorted(Deep().state_dict())
    assert all(torch.equal(bare[k], ddp[k]) and torch.equal(bare[k], dp[k]) for k in bare)


def _unseeded(rank: int, world: int, where: str, strategy: str) -> dict[str, torch.Tensor] | None:
    """A model built before fit() from another seed on each rank, trained under ``strategy``."""
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model.register_buffer("noise", torch.randn(4))  # a buffer: FSDP does not shard it, nor DDP average it
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    run = Path(where) / strategy
    scaletrain.fit(model, (x, x[:, :4].argmax(1)), argv=["--dist.timeout_s=60"],
                   config={"run.dir": str(run), "train.max_steps": 4, "data.batch_size": 16, "train.progress": False,
                           "parallel.strategy": strategy, "optim.lr": 0.01})
    from safetensors.torch import load_file

    return load_file(str(run / "model.safetensors")) if rank == 0 else None  # rank 0 writes it


def test_a_model_built_unseeded_before_fit_starts_from_rank_0s_weights_under_fsdp_as_under_ddp(tmp_path: Path) -> None:
    """Each rank built its model from another seed before fit(): DDP broadcasts rank 0's weights when it wraps,
    FSDP kept each rank's rows of its own (a mixture of two initialisations, saved as the model) and each rank
    its own unsharded buffer. The session now finds the difference (one all-gather of a fingerprint) and
    broadcasts rank 0's parameters and buffers first: FSDP ends as DDP does, to float rounding, and the buffer is
    rank 0's."""
    ddp, fsdp = (run_ranks(_unseeded, 2, str(tmp_path), strategy, timeout_s=120)[0] for strategy in ("ddp", "fsdp"))
    torch.manual_seed(0)
    rank0 = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    assert torch.equal(fsdp["noise"], torch.randn(4)) and torch.equal(ddp["noise"], fsdp["noise"])
    for name, value in ddp.items():
        torch.testing.assert_close(fsdp[name], value, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # trained from rank 0's: 4 Adam steps of lr 0.01 move a weight by at most about 0.04
        moved = (fsdp["0.weight"] - rank0[0].weight).abs().max()
    assert 1e-4 < moved < 0.05, moved


class Spots(Dataset):
    """torchvision's detection layout: (image, {"boxes": (n, 4), "labels": (n,)}) per sample, the images of
    unequal sizes (they do not stack: a batch is a tuple of images and a tuple of targets). One bright 4x4 spot
    per image, its class the channel it lights."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict]:
        g = torch.Generator().manual_seed(i)
        h, w = 12 + 2 * (i % 3), 16 + 4 * (i % 2)
        y, x, c = (int(torch.randint(0, n - 4, (1,), generator=g)) for n in (h, w, 6))
        image = 0.1 * torch.rand(3, h, w, generator=g)
        image[1 + c % 2, y:y + 4, x:x + 4] = 1.0
        return image, {"boxes": torch.tensor([[x, y, x + 4, y + 4]], dtype=torch.float32),
                       "labels": torch.tensor([1 + c % 2])}


class Detector(nn.Module):
    """torchvision's detection models' interface: forward(images, targets=None) takes a list of images of any
    sizes; in training it returns a dict of losses, in eval mode a list of predictions, one dict per image."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.cls, self.box = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 3), nn.Linear(8, 4)

    def forward(self, images: list[torch.Tensor], targets: list[dict] | None = None) -> dict | list:
        feats = torch.stack([self.conv(im[None]).amax((2, 3))[0] for im in images])
        logits, boxes = self.cls(feats), 20 * self.box(feats)
        if self.training:
            assert targets is not None
            labels = torch.cat([t["labels"] for t in targets])
            return {"loss_classifier": F.cross_entropy(logits, labels),
                    "loss_box_reg": F.smooth_l1_loss(boxes, torch.cat([t["boxes"] for t in targets])) / 20}
        return [{"boxes": b[None], "labels": s.argmax()[None], "scores": s.softmax(-1).amax()[None]}
                for b, s in zip(boxes, logits)]


def _listed(samples: list) -> tuple:
    return tuple(zip(*samples))  # torchvision's detection reference's collate_fn


def test_a_detection_model_on_lists_of_images_trains_and_its_eval_mode_output_is_one_line(tmp_path: Path) -> None:
    """torchvision's detection tutorial ported to fit(): the FLOP count before step one expanded the batch of one
    image as if it were a stacked batch (a RuntimeError from inside scaletrain), and the held-out loss met the
    predictions the model returns in eval mode (the user's loss_fn's AttributeError and traceback)."""
    total = lambda out, targets: sum(out.values())
    config = {**_config(tmp_path, "det"), "data.batch_size": 8, "train.epochs": 3, "optim.lr": 3e-2, "log.every": 1}
    with pytest.raises(UserError, match=r"^loss_fn: <lambda> failed on the first held-out batch \(AttributeError: "
                                        r"'list' object has no attribute 'values'\), whose output from the model in "
                                        r"eval mode is a list of 8 \(a dict, \.\.\.\);.* fix: data.val_fraction=0"):
        scaletrain.fit(Detector, Spots(192), loss_fn=total, collate_fn=_listed, config=config)
    summary = scaletrain.fit(Detector, Spots(192), loss_fn=total, collate_fn=_listed,
                             config={**config, "data.val_fraction": 0, "run.dir": str(tmp_path / "det-all")})
    assert summary["steps"] == 3 * 192 // 8 and summary["eval"] == {}
    assert summary["flops_per_s"] > 0  # counted on two copies of the first image, as the loader lists them
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "det-all" / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    assert len(losses) == 72 and summary["train_loss"] == losses[-1] < 0.25 * losses[0], losses
