"""train.loss_mean=tokens: with padded sequences of varied lengths (targets of -100 left out), a step's loss is
the global batch's, however the batch is split into micro-batches and ranks; micro_batch (the default) weighs
each micro-batch's own mean alike, which is a different gradient (the bias Hugging Face's Trainer fixed in 2024
by counting the step's tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn
from warm import SCALETRAIN

import scaletrain
from scaletrain.errors import ConfigError

VOCAB, T = 32, 12
# 64 samples, one epoch of global batches of 16: 4 steps
CONFIG = {"train.epochs": 1, "train.global_batch": 16, "optim.name": "sgd", "optim.lr": 0.5, "optim.momentum": 0.0,
          "train.progress": False, "log.every": 1, "schedule.warmup_steps": 0,
          "schedule.decay": "constant"}
BIN = Path(sys.executable).parent


def samples() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of 2 to 12 real tokens, padded to 12 with targets of -100: micro-batches count from 8 to 90."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(64):
        n = 12 if i % 4 == 3 else 2  # every 4th long: one micro-batch of 4 holds three short and one long
        x = torch.randint(0, VOCAB, (T,), generator=g)
        y = torch.full((T,), -100)
        y[:n] = torch.roll(x, -1)[:n]
        out.append((x, y))
    return out


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.emb, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x)))


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(run / "model.safetensors")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _fit(run: Path, **config: object) -> dict:
    return scaletrain.fit(Tokens(), samples(), eval_data=samples()[:8], config={**CONFIG, "run.dir": str(run), **config})


def test_tokens_is_the_global_batchs_loss_however_it_is_split(tmp_path: Path) -> None:
    whole = _fit(tmp_path / "whole", **{"data.batch_size": 16, "train.loss_mean": "tokens"})
    split = _fit(tmp_path / "split", **{"data.batch_size": 4, "train.loss_mean": "tokens"})
    assert whole["accum_steps"] == 1 and split["accum_steps"] == 4
    assert _close(_weights(tmp_path / "whole"), _weights(tmp_path / "split")) < 1e-5
    assert split["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-5)
    # the default weighs each micro-batch's mean alike: another gradient, and a one-micro-batch step is the same
    _fit(tmp_path / "same", **{"data.batch_size": 16})
    _fit(tmp_path / "biased", **{"data.batch_size": 4})
    assert _close(_weights(tmp_path / "whole"), _weights(tmp_path / "same")) < 1e-6
    assert _close(_weights(tmp_path / "whole"), _weights(tmp_path / "biased")) > 1e-3


SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]  # this file's directory, and tests/ (warm.py)
import scaletrain
from test_loss_mean import CONFIG, Tokens, samples
scaletrain.fit(Tokens(), samples(), eval_data=samples()[:8], argv=sys.argv[1:],
               config={{**CONFIG, "data.batch_size": 4, "train.loss_mean": "tokens"}})
"""


def test_on_two_ranks_accumulating_it_is_the_one_process_batch(tmp_path: Path) -> None:
    _fit(tmp_path / "whole", **{"data.batch_size": 16, "train.loss_mean": "tokens"})
    script = tmp_path / "two.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent), root=str(Path(__file__).parents[1])))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    done = subprocess.run([*SCALETRAIN, "launch", "--nproc", "2", str(script), f"--run.dir={tmp_path / 'two'}"],
                          capture_output=True, text=True, env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["accum_steps"] == 2  # 4 per rank x 2 ranks x 2
    assert _close(_weights(tmp_path / "whole"), _weights(tmp_path / "two")) < 1e-5


def test_a_transformers_models_own_loss_is_given_the_count(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    def build() -> nn.Module:
        torch.manual_seed(3)
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=16, n_layer=1, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    data = [{"input_ids": x, "labels": torch.where(y == -100, -100, x)} for x, y in samples()]
    runs = {}
    for batch in (16, 4):
        runs[batch] = scaletrain.fit(build, data, eval_data=data[:8], config={**CONFIG, "run.dir": str(tmp_path / f"b{batch}"),
                                                         "data.batch_size": batch, "train.loss_mean": "tokens"})
    assert runs[4]["accum_steps"] == 4
    assert _close(_weights(tmp_path / "b16"), _weights(tmp_path / "b4")) < 1e-5


class OwnLossNoCount(nn.Module):
    """nanoGPT's way: forward(idx, targets) returns (logits, loss), and takes nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Tokens()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.net(idx)
        loss = None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


@pytest.mark.parametrize(("model", "data", "extra", "said"), [
    (Tokens, samples, {"loss_fn": lambda out, y: out.sum()},
     r"^train.loss_mean = 'tokens': expected micro_batch with a loss_fn of your own"),
    (lambda: nn.Linear(4, 2), lambda: [(torch.randn(4), torch.randn(2).softmax(0)) for _ in range(64)], {},
     r"^train.loss_mean = 'tokens': expected micro_batch for targets that are not class ids"),
    (OwnLossNoCount, lambda: [{"idx": x, "targets": y} for x, y in samples()], {},
     (r"^train.loss_mean = 'tokens': expected micro_batch for a OwnLossNoCount: it computes its own loss, and its "
     r"forward takes no num_items_in_batch")),
])
def test_what_it_cannot_count_is_one_line(tmp_path: Path, model, data, extra, said) -> None:
    with pytest.raises(ConfigError, match=said):
        scaletrain.fit(model, data(), eval_data=data()[:8], config={**CONFIG, "run.dir": str(tmp_path / "r"),
                                                                    "data.batch_size": 4, "train.loss_mean": "tokens"},
                       **extra)


def test_the_default_warns_when_padded_targets_are_split(tmp_path: Path, capsys) -> None:
    _fit(tmp_path / "r", **{"data.batch_size": 4, "train.max_steps": 1})
    said = " ".join(capsys.readouterr().out.split())
    assert "warning: the first sample's targets hold -100 (left out of the loss)" in said
    assert "--train.loss_mean=tokens weighs every target of the step alike" in said
