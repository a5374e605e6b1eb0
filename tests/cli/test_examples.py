"""The examples are documentation that runs: examples/nanogpt_lm.py (nanoGPT's GPT in a loop of its own) and
examples/hf_model.py (a transformers Llama built from a config) train on 2 Gloo ranks through `scaletrain
launch` and their loss drops; nanogpt_lm resumes bit for bit (verify-resume); scaletrain finds both models'
blocks (what activation checkpointing and compile wrap)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from warm import SCALETRAIN

from scaletrain.parallel.units import find_units

REPO = Path(__file__).resolve().parents[2]
NANOGPT = REPO / "examples" / "nanogpt_lm.py"
HF_MODEL = REPO / "examples" / "hf_model.py"
BIN = Path(sys.executable).parent
# 16 steps logged every 4, warmup 2 (the examples' 20 would be all of it), a checkpoint mid-run.
SHORT = ["--train.max_steps=16", "--log.every=4", "--schedule.warmup_steps=2", "--checkpoint.every=8"]
UNIFORM = math.log(256)  # nats per byte of a model that has learnt nothing: where both start
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (pip install -e '.[dev]')")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _scaletrain(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCALETRAIN, *args], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=240, check=False)


def _trained(script: Path, run_dir: Path) -> tuple[dict[int, float], dict, str]:
    """Run ``script`` on 2 ranks for 16 steps: (logged loss per step, summary.json, stdout)."""
    proc = _scaletrain("launch", "--nproc", "2", str(script), f"--run.dir={run_dir}", *SHORT,
                       cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    assert sorted(losses) == [4, 8, 12, 16], losses
    assert (run_dir / "checkpoints" / "step-00000016").is_dir()  # the run's end is a checkpoint, as is step 8
    return losses, json.loads((run_dir / "summary.json").read_text()), proc.stdout


def test_nanogpt_model_keeps_nanogpts_conventions() -> None:
    example = runpy.run_path(str(NANOGPT))  # its classes and functions; main() does not run
    torch.manual_seed(0)
    gpt = example["GPT"](example["GPTConfig"]())
    assert gpt.transformer.wte.weight is gpt.lm_head.weight  # tied
    idx, targets = torch.randint(0, 256, (2, 2, 64), generator=torch.Generator().manual_seed(0))
    logits, loss = gpt(idx, targets)
    assert logits.shape == (2, 64, 256) and loss.item() == pytest.approx(UNIFORM, abs=0.1)
    logits, loss = gpt(idx)  # no targets: the last position only, no loss
    assert logits.shape == (2, 1, 256) and loss is None
    units = find_units(gpt)  # nanoGPT's transformer.h, by the "repeated" rule
    assert units.rule == "repeated" and units.describe() == "2 x Block" and not units.left_to_root
    lrs = [example["get_lr"](it, 1.0, 10, 100, 0.1) for it in (0, 9, 10, 55, 100, 200)]
    assert lrs == pytest.approx([1 / 11, 10 / 11, 1.0, 0.55, 0.1, 0.1])


@needs_transformers
def test_hf_model_learns_on_two_ranks(tmp_path: Path) -> None:
    losses, summary, stdout = _trained(HF_MODEL, tmp_path / "run")
    assert losses[4] < UNIFORM + 0.1 and losses[16] < losses[4] - 1.0, losses  # measured: 5.37 -> 3.66
    assert summary["steps"] == 16 and summary["world_size"] == 2 and summary["models"] == ["llama"]
    [last] = [line for line in stdout.splitlines() if line.startswith("hf_model:")]
    assert re.fullmatch(r"hf_model: LlamaForCausalLM \(0\.\d+M parameters\), 16 steps, train loss [\d.]+",
                        last), last


def test_scaletrain_finds_the_hf_models_decoder_layers() -> None:
    pytest.importorskip("transformers")
    llama = runpy.run_path(str(HF_MODEL))["build_model"](n_layer=3, n_head=4, n_embd=32, seq_len=16)
    units = find_units(llama)  # transformers' _no_split_modules names them
    assert units.rule == "_no_split_modules" and units.describe() == "3 x LlamaDecoderLayer"
    assert units.names == ("model.layers.0", "model.layers.1", "model.layers.2") and not units.left_to_root


def test_hf_model_without_transformers_is_one_line_and_exit_2(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # `from transformers import` fails as if absent
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(HF_MODEL), run_name="__main__")
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("fix: pip install transformers"), lines
