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
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv, max_position_embeddings=16, use_cache=False, tie_word_embeddings=tied))


SHAPE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 16, "use_cache": False}
# Each plan's styles: colwise and rowwise (Llama, a tied head too); the per-head query and key norms whose
# gradients are summed (Qwen3: replicated_with_grad_allreduce); fused matrices gathered and split again (Phi3:
# colwise_gather_output, rowwise_split_input); the embedding split by rows and a per-head fused QKV (GPT-NeoX).
MODELS = {
    "llama": lambda: _llama(False),
    "llama-tied": lambda: _llama(True),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, num_key_value_heads=2,
                                                                            head_dim=8)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**SHAPE, num_key_value_heads=2,
                                                                         pad_token_id=0)),
    "gpt-neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**SHAPE)),
}


def _loop(where: str, tp: int, name: str) -> dict:
    """4 SGD steps (clipped) of MODELS[name] on token windows, a session loop of one's own: the losses, the
    final weights, and whether a tied head is still the embedding's parameter."""
    import scaletrain

    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
    cfg = {"run.dir": str(Path(where) / f"tp{tp}-{name}"), "train.max_steps": 4, "log.every": 2,
           "data.batch_size": 8, "parallel.tp": tp, "checkpoint.every": 100, "optim.grad_clip": 1.0,
           "train.progress": False}
    losses = []
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(MODELS[name](), lambda p: torch.optim.SGD(p, lr=0.5))
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
        head, embedding = inner.get_output_embeddings(), inner.get_input_embeddings()
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                   for k, v in inner.state_dict().items()}
    return {"losses": losses, "weights": weights, "tied": head.weight is embedding.weight}


def _every(rank: int, world: int, where: str) -> dict:
    return {name: _loop(where, 2, name) for name in MODELS}


def test_transformers_models_at_tp_2_compute_what_one_process_does(tmp_path):
    one = {name: _loop(str(tmp_path), 1, name) for name in MODELS}
    split = run_ranks(_every, 2, str(tmp_path))
    for name in MODELS:
        for rank, got in enumerate(split):
            want = one[name]
            assert got[name]["losses"] == pytest.approx(want["losses"], abs=1e-5), (name, rank)
            assert sorted(got[name]["weights"]) == sorted(want["weights"])
            worst = max((got[name]["weights"][k] - want["weights"][k]).abs().max().item() for k in want["weights"])
            # SGD: linear in the gradients, so float order stays at rounding (AdamW's normalized step magnified it
            # to 1e-4 on a weight of near-zero gradient); without Qwen3's norms' gradient sum its losses part at once
            assert worst < 1e-5, (name, rank, worst)
            assert got[name]["tied"] == want["tied"], name
    assert one["llama-tied"]["tied"] and not one["llama"]["tied"]


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
    if not any("expert" in pattern for pattern in mixtral.config.base_model_tp_plan):
        with pytest.raises(ConfigError) as err:  # transformers 5: the attention split, the experts left whole
            check_tp(mixtral, 2)
        assert str(err.value) == (
            "parallel.tp = 2: expected 1 for a MixtralForCausalLM: its config's base_model_tp_plan splits none of "
            "its 2 experts, and a mixture of experts left whole routes its tokens by value, which a tensor-parallel "
            "model cannot; fix: --parallel.tp=1, and --parallel.strategy=fsdp for a model that does not fit one "
            "device")
    # The experts as transformers 4.x planned them (local styles, gathered after): 5.x plans the attention only,
    # so the plan is set here, as any model's config may carry styles scaletrain does not know
    mixtral.config.base_model_tp_plan = {**mixtral.config.base_model_tp_plan,
                                         "layers.*.block_sparse_moe.experts.*.w1": "local_colwise",
                                         "layers.*.block_sparse_moe.experts.*.w2": "local_rowwise",
                                         "layers.*.block_sparse_moe": "gather"}
    with pytest.raises(ConfigError) as err:
        check_tp(mixtral, 2)
    assert str(err.value).startswith("parallel.tp = 2: expected 1 for a MixtralForCausalLM: its config's "
                                     "base_model_tp_plan splits modules as gather, local_colwise and local_rowwise, "
                                     "which scaletrain does not apply (it applies colwise, rowwise, "), err.value


def _fit(rank: int, world: int, where: str) -> tuple[float, list[torch.Tensor], str]:
    """fit() of a Llama with an optimizer built on it before the split (rebound to its DTensors), at tp = world."""
    import contextlib
    import io

    import scaletrain

    torch.manual_seed(0)
    model = _llama(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # SGD: float order stays at rounding (AdamW divides by it)
    ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        summary = scaletrain.fit(model, [{"input_ids": row, "labels": row} for row in ids], optimizer=opt, config={
            "run.dir": f"{where}/fit-tp{world}", "train.max_steps": 4, "data.batch_size": 8, "parallel.tp": world,
            "train.progress": False, "train.eval_batches": 1})
    weights = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    return summary["train_loss"], weights, said.getvalue()


def test_fit_with_an_optimizer_of_ones_own_at_tp_2_computes_what_one_process_does(tmp_path):
    """The optimizer given to fit() steps the tensor-parallel DTensors; the summary plans no split it does not
    plan (plan vs actual for a model of one's own at tp > 1 warned that fake tensors could not build it)."""
    loss, weights, _ = _fit(0, 1, str(tmp_path))
    ranks = run_ranks(_fit, 2, str(tmp_path))
    assert abs(ranks[0][0] - loss) < 1e-5
    for a, b in zip(weights, ranks[0][1]):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert "warning" not in ranks[0][2], ranks[0][2]
