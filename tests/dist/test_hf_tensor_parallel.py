"""Tensor parallelism for a Hugging Face transformers model of one's own: its config's base_model_tp_plan (what
transformers' own tensor parallelism reads) applied through torch's parallelize_module, the rest of its parameters
Replicate DTensors (a tied head stays tied): a session loop at tp 2 computes what one process does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawn_ranks import run_ranks

transformers = pytest.importorskip("transformers")

from scaletrain.errors import ConfigError  # noqa: E402
from scaletrain.parallel.tensor import check_tp  # noqa: E402


def _llama(tied: bool, heads: int = 4, kv: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, max_position_embeddings=16, use_cache=False, tie_word_embeddings=tied))


def _loop(rank: int, world: int, where: str, tp: int, tied: bool) -> dict:
    """4 AdamW steps (clipped) of a small Llama on token windows, a session loop of one's own: the losses, the
    final weights, and whether the head is still the embedding's parameter."""
    import scaletrain

    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
    cfg = {"run.dir": str(Path(where) / f"tp{tp}-{tied}"), "train.max_steps": 4, "log.every": 2,
           "data.batch_size": 8, "parallel.tp": tp, "checkpoint.every": 100, "optim.grad_clip": 1.0,
           "train.progress": False}
    losses = []
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(_llama(tied), lambda p: torch.optim.AdamW(p, lr=1e-2))
        loader = st.loader([{"input_ids": row, "labels": row} for row in ids])
        while not st.done:
            for batch in loader:
                with st.step():
                    loss = model(**batch).loss
                    st.backward(loss)
                    st.optimizer_step(opt)
                    opt.zero_grad()
                    losses.append(float(loss.detach()))
                if st.done:
                    break
        inner = model.module if hasattr(model, "module") else model
        same = inner.lm_head.weight is inner.model.embed_tokens.weight
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                   for k, v in inner.state_dict().items()}
    return {"losses": losses, "weights": weights, "tied": same}


def _both(rank: int, world: int, where: str, tied: bool) -> dict:
    return _loop(rank, world, where, 2, tied)


@pytest.mark.parametrize("tied", [False, True])
def test_a_transformers_llama_at_tp_2_computes_what_one_process_does(tmp_path, tied):
    one = _loop(0, 1, str(tmp_path), 1, tied)
    split = run_ranks(_both, 2, str(tmp_path), tied)
    for got in split:
        assert got["losses"] == pytest.approx(one["losses"], abs=1e-5)
        assert sorted(got["weights"]) == sorted(one["weights"])
        assert max((got["weights"][k] - one["weights"][k]).abs().max().item() for k in one["weights"]) < 1e-5
        assert got["tied"] == tied


def test_what_a_transformers_model_cannot_split_is_one_line():
    with pytest.raises(ConfigError) as err:
        check_tp(_llama(False, heads=4, kv=2), 4)
    assert str(err.value) == ("parallel.tp = 4: expected a divisor of the LlamaForCausalLM's num_key_value_heads = 2 "
                              "(each rank takes whole heads); fix: --parallel.tp=2")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                                                n_head=2))
    with pytest.raises(ConfigError) as err:
        check_tp(gpt2, 2)
    assert "base_model_tp_plan" in str(err.value) and "fix: --parallel.tp=1" in str(err.value)
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=2))
    styles = sorted({s for s in mixtral.config.base_model_tp_plan.values() if s not in ("colwise", "rowwise")})
    with pytest.raises(ConfigError) as err:
        check_tp(mixtral, 2)
    assert str(err.value).startswith(f"parallel.tp = 2: expected 1 for a MixtralForCausalLM: its config's "
                                     f"base_model_tp_plan splits modules as {' and '.join(styles)}, and scaletrain "
                                     "splits a Hugging Face model's matrices by colwise and rowwise only"), err.value
