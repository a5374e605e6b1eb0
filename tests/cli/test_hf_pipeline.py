"""Pipeline parallelism for a Hugging Face causal LM built from its config (transformers' Llama, its head tied
to the token embedding): --parallel.pp=2 splits its own layers into stages that keep its parameter names,
trains as one process does, and writes checkpoints that resume without the pipeline. What the stages cannot
run as the model does is one line before training."""

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

from scaletrain.batch import Batch
from scaletrain.errors import ConfigError, UserError

transformers = pytest.importorskip("transformers")

BIN = Path(sys.executable).parent

SCRIPT = """import sys, torch, scaletrain
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=64, vocab_size=64, tie_word_embeddings=True))
ids = torch.randint(0, 64, (48, 16), generator=torch.Generator().manual_seed(1))
ids[:, 1::2] = (ids[:, ::2] + 1) % 64  # every other token follows from the one before: something to learn
rows = [{"input_ids": r, "labels": r} for r in ids]
scaletrain.fit(model, rows[:40], eval_data=rows[40:], argv=sys.argv[1:],
               config={"train.max_steps": 6, "log.every": 3, "optim.lr": 0.01, "schedule.decay": "constant",
                       "data.batch_size": 8, "train.progress": False})
"""


def _llama(**config: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        vocab_size=64, **config))


def test_a_transformers_llama_pipelines_as_one_process_and_resumes_without_the_pipeline(tmp_path: Path) -> None:
    """Four layers in four stages, two per rank (the interleaved schedule), the tied head copied onto the last
    stage and its gradient summed with the embedding's: the eval losses and the weights are one process's (to
    1e-5: 8e-7 measured, the sums in another order); the pp checkpoint at step 3 resumes under plain DDP and
    ends there too, its tied weight stored once, under the model's own name, as one process stores it."""
    script = tmp_path / "llama_pp.py"
    script.write_text(SCRIPT)

    def run(*argv: str, nproc: int) -> subprocess.CompletedProcess[str]:
        cmd = [*PYTHON, str(script)] if nproc == 1 else [*SCALETRAIN, "launch", "--nproc", str(nproc), str(script)]
        proc = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=300, env=script_env(), cwd=tmp_path,
                              check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    run("--run.dir=one", nproc=1)
    piped = run("--run.dir=pp", "--parallel.pp=2", "--parallel.pp_schedule=interleaved", "--checkpoint.every=3",
                "--data.batch_size=8", nproc=2)
    assert "parallel: pp 2 | pipeline interleaved x 2 stages per rank, 4 micro-batches of 2" in piped.stdout, \
        piped.stdout[-3000:]
    run("--run.dir=ddp", "--checkpoint.resume=pp/checkpoints/step-00000003", "--data.batch_size=4", nproc=2)

    summaries = {d: json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "pp", "ddp")}
    for d in ("pp", "ddp"):
        assert summaries[d]["eval"]["loss"] == pytest.approx(summaries["one"]["eval"]["loss"], rel=1e-5), d
    records = [json.loads(line) for line in (tmp_path / "pp" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.05, evals  # it learns (steps 0, 3 (a checkpoint) and 6)
    whole = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert "model.embed_tokens.weight" in whole and "lm_head.weight" not in whole  # tied: stored once
    for d in ("pp", "ddp"):
        got = load_file(str(tmp_path / d / "model.safetensors"))
        assert got.keys() == whole.keys(), d
        for name, value in whole.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5, msg=f"{d}: {name}")


def test_what_the_stages_cannot_run_is_one_line() -> None:
    from scaletrain.parallel import _check_causal_lm_split
    from scaletrain.parallel.pipeline import causal_lm_parts, pipeline_stage

    _check_causal_lm_split(_llama(), 2, 1)  # SDPA: the stages give the model's logits
    with pytest.raises(ConfigError) as err:  # eager attention needs the causal mask the stages do not build
        _check_causal_lm_split(_llama(attn_implementation="eager"), 2, 1)
    assert str(err.value).startswith("parallel.pp = 2: expected 1 for this LlamaForCausalLM: its layers run as "
                                     "pipeline stages do not give its own forward's logits (largest difference ")
    assert str(err.value).endswith("its attention ('eager') needs a causal mask, which the stages leave to SDPA; fix: "
                                   "build it with attn_implementation='sdpa', or --parallel.pp=1")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64))
    assert causal_lm_parts(gpt2) is None  # transformer.h, wte + wpe: not Llama's layout
    with pytest.raises(ValueError, match="not GPT2LMHeadModel; set --parallel.pp=1"):
        pipeline_stage(gpt2, 2, 0)
    ids = torch.zeros(2, 8, dtype=torch.long)
    assert Batch((), {"input_ids": ids, "labels": ids}, ids).pipeline_inputs() is ids
    with pytest.raises(UserError) as said:
        Batch((), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, ids).pipeline_inputs()
    assert str(said.value) == ("parallel.pp: the pipeline's first stage takes one input (token ids), and this batch "
                               "gives the model input_ids, attention_mask; fix: batches of input_ids and labels only "
                               "(a causal mask is applied; pad with labels -100 instead of an attention_mask), or "
                               "--parallel.pp=1")
