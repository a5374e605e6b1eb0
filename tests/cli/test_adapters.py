"""Fine-tuning with adapters (LoRA-style): a Hugging Face Llama built from its config, every weight of its own
frozen and a low-rank pair added beside two projections of each layer, so FSDP's units hold frozen and trained
parameters side by side. The header and summary.json say how many train; the frozen weights come out unchanged
to the bit; a checkpoint written under DDP resumes under FSDP and ends where one process training the whole
run ends."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from spawn_ranks import script_env
from warm import PYTHON, SCALETRAIN

pytest.importorskip("transformers")

BIN = Path(sys.executable).parent

SCRIPT = """import sys, torch, scaletrain
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

class LoRA(nn.Module):
    def __init__(self, base, r=4):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(r, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, r) * 0.1)
    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, intermediate_size=64, vocab_size=64))
model.requires_grad_(False)
for layer in model.model.layers:
    layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
    layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
ids[:, 1::2] = (ids[:, ::2] + 1) % 64  # every other token follows from the one before: something to learn
scaletrain.fit(model, [{"input_ids": r, "labels": r} for r in ids], eval_data=[{"input_ids": r, "labels": r} for r in ids[:8]],
               config={"train.max_steps": 6, "log.every": 3, "optim.lr": 0.02, "schedule.decay": "constant",
                       "train.progress": False}, argv=sys.argv[1:])
"""


def test_adapters_train_under_fsdp_from_a_ddp_checkpoint_as_one_process_does(tmp_path: Path) -> None:
    script = tmp_path / "lora.py"
    script.write_text(SCRIPT)

    def run(*argv: str, nproc: int = 1) -> subprocess.CompletedProcess[str]:
        cmd = [*PYTHON, str(script)] if nproc == 1 else [*SCALETRAIN, "launch", "--nproc", str(nproc), str(script)]
        proc = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=300, env=script_env(), cwd=tmp_path,
                              check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    one = run("--run.dir=one", "--data.batch_size=8")
    # q_proj 32 -> 32 and v_proj 32 -> 16 (2 key-value heads of 8): a is 4 x 32 for both, b 32 x 4 and 16 x 4
    trainable = 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4)
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["trainable_params"] == trainable < summary["params"]
    header = next(line for line in one.stdout.splitlines() if line.startswith("model LlamaForCausalLM"))
    assert f"parameters, {trainable:,} trainable ({100 * trainable / summary['params']:.2g}%)" in header, header

    run("--run.dir=ddp", "--data.batch_size=4", "--train.max_steps=3", "--checkpoint.every=3", nproc=2)
    resumed = run("--run.dir=fsdp", "--data.batch_size=4", "--parallel.strategy=fsdp",
                  "--checkpoint.resume=ddp/checkpoints/step-00000003", nproc=2)
    assert "FSDP: 2 x LlamaDecoderLayer + root" in resumed.stdout, resumed.stdout[-3000:]

    whole, split = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "fsdp"))
    start = load_file(str(tmp_path / "ddp" / "model.safetensors"))  # step 3
    assert whole.keys() == split.keys() == start.keys()
    adapters = [k for k in whole if k.endswith((".a", ".b"))]
    assert len(adapters) == 8 and sum(whole[k].numel() for k in adapters) == trainable
    for name in whole:
        if name in adapters:  # trained: moved since step 3, and to where one process took them (fp32 sums)
            assert not torch.equal(split[name], start[name]), name
            torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)  # 1e-7 apart, 0.05 moved
        else:  # frozen: the initial weights, bit for bit, in every run
            assert torch.equal(split[name], whole[name]) and torch.equal(start[name], whole[name]), name
    assert json.loads((tmp_path / "fsdp" / "summary.json").read_text())["eval"]["loss"] == pytest.approx(
        json.loads((tmp_path / "one" / "summary.json").read_text())["eval"]["loss"], rel=1e-4)
