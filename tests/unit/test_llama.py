"""The built-in Llama: Meta's published parameter counts from the recipes' shapes, transformers' logits from
its weights, causal attention, rotary embeddings that see relative positions only, and training through the
trainer with FSDP finding its blocks."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.config import load
from scaletrain.errors import ConfigError
from scaletrain.models import Llama, build_model
from scaletrain.models.llama import apply_rope, ffn_hidden_for, rope_tables


@pytest.mark.parametrize(("recipe", "billions", "places"), [("llama3-8b", 8.03, 2), ("llama3-70b", 70.6, 1),
                                                            ("llama3-405b", 405.9, 1)])
def test_the_recipes_have_metas_published_parameter_counts(recipe, billions, places):
    """Llama 3.1's model cards: 8.03B, 70.6B, 405B (transformers counts 405.85B); built on the meta device."""
    cfg = load(recipe)
    with torch.device("meta"):
        model = build_model(cfg.model, "lm", {"vocab_size": 256, "seq_len": cfg.data.seq_len})
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, places) == billions
    assert ffn_hidden_for(4096) == 11008  # Llama 2 7B's MLP, by the rule the 0 default follows


def _from_transformers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = [("model.embed_tokens", "tok_embeddings"), ("model.layers", "layers"), ("model.norm", "norm"),
             ("lm_head", "output"), ("self_attn.q_proj", "attention.wq"), ("self_attn.k_proj", "attention.wk"),
             ("self_attn.v_proj", "attention.wv"), ("self_attn.o_proj", "attention.wo"),
             ("post_attention_layernorm", "ffn_norm"), ("input_layernorm", "attention_norm"),
             ("mlp.gate_proj", "feed_forward.w1"), ("mlp.up_proj", "feed_forward.w3"),
             ("mlp.down_proj", "feed_forward.w2")]
    out = {}
    for key, value in state.items():
        if "rotary" in key:
            continue
        for theirs, ours in names:
            key = key.replace(theirs, ours)
        out[key] = value
    return out


def test_transformers_llama_weights_give_its_logits():
    """A LlamaForCausalLM built from a LlamaConfig (grouped-query attention 8:2, Llama 3's rope_theta, nothing
    downloaded): its weights copied in by name, our logits equal its own within float32 rounding."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32,
                                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    ours = Llama(97, 32, n_layer=2, n_head=8, n_kv_head=2, n_embd=64, ffn_hidden=160, rope_theta=500000.0).eval()
    ours.load_state_dict(_from_transformers(theirs.state_dict()), strict=True)
    idx = torch.randint(0, 97, (3, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx).logits, rtol=1e-5, atol=1e-5)


def test_attention_is_causal_and_rope_sees_relative_positions_only():
    torch.manual_seed(0)
    model = Llama(50, 16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32).eval()
    idx = torch.randint(0, 50, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % 50
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(before[0, :10], after[0, :10], rtol=0, atol=1e-6)  # the past never sees the future
    assert not torch.allclose(before[0, 10:], after[0, 10:])
    cos, sin = rope_tables(8, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(m: int, n: int) -> float:
        return float((apply_rope(q, cos[m:m + 1], sin[m:m + 1]) * apply_rope(k, cos[n:n + 1], sin[n:n + 1])).sum())

    assert score(3, 1) == pytest.approx(score(13, 11), rel=1e-5)  # the same distance, anywhere
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)


def test_llama_tiny_learns_through_the_trainer_its_blocks_found(tmp_path, capsys):
    """60 steps of the llama-tiny recipe with activation checkpointing per block (RoPE's tables go through the
    checkpoint wrapper as arguments): it learns; FSDP would shard it per block (units_line, as the header says
    it on several ranks)."""
    from scaletrain.parallel import units_line
    from scaletrain.train.run import run

    summary = run(load("llama-tiny", {"run.dir": str(tmp_path / "run"), "train.max_steps": 60,
                                      "memory.activation_checkpointing": "full", "train.progress": False}))
    assert "blocks: 2 x Block" in capsys.readouterr().out
    model = build_model(load("llama-tiny").model, "lm", {"vocab_size": 256, "seq_len": 64})
    assert units_line(model, sharded=True, blocks=False) == "FSDP: 2 x Block + root"
    # per block: q and o 64 x 64, k and v 64 x 32 (2 heads of 16), the MLP 3 x 64 x 192, 2 norms; untied head
    block = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 192 + 2 * 64
    assert summary["steps"] == 60 and summary["params"] == 2 * block + 2 * 256 * 64 + 64
    assert summary["train_loss"] < math.log(256) - 1.5  # bytes: 5.55 nats knowing nothing


def test_bad_llama_shapes_are_one_line():
    with pytest.raises(ConfigError, match=r"model.n_kv_head = 3 .*: expected a divisor of model.n_head=8 .*; fix: "
                                          r".*model.n_kv_head.*2"):
        load(None, {"model.name": "llama", "model.n_head": 8, "model.n_embd": 64, "model.n_kv_head": 3})
    with pytest.raises(ConfigError, match=r"model.n_head = 4 .*: expected a head width n_embd / n_head that is even "
                                          r".*; fix: .*model.n_head.*3"):
        load(None, {"model.name": "llama", "model.n_head": 4, "model.n_embd": 12})
