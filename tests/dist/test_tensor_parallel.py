"""Tensor parallelism computes what one process computes, alone and under FSDP, on the built-in GPT and Llama
(test_fsdp.py's 5 steps: its data, AdamW and clipping).

A small Llama (grouped-query attention: 4 query heads, 2 key/value heads; SwiGLU; untied head; sequence-parallel
norms) and a small GPT (fused query/key/value split part by part, biases, the head tied to the embedding, norms
whole on every rank), fp32, AdamW with weight decay and gradient clipping, the same global batch of 8
sequences: one process with all 8; TP=2
on 2 ranks (both ranks read all 8: one data-parallel rank); FSDP=2 x TP=2 on 4 ranks (each TP group reads its
4). Only the order of floating-point sums differs (the row-parallel matmuls sum their halves across ranks),
so the parameters after 5 steps agree to 1e-5. Everything goes through parallelize(), as the trainer does.
"""

from __future__ import annotations

import pytest
import torch
from spawn_ranks import run_ranks
from test_fsdp import CLIP, T, V, _fit, _full, _max_diff
from torch.distributed.tensor import DTensor

from scaletrain import runtime
from scaletrain.config import DistConfig, MemoryConfig, ModelConfig, ParallelConfig
from scaletrain.errors import ConfigError
from scaletrain.layout import Layout, check_layout, resolve_layout
from scaletrain.models import GPT, Llama
from scaletrain.parallel import parallelize
from scaletrain.plan.parallel import stage_params, structure


def _model(name: str = "llama") -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(V, T, 2, 4, 2, 32, ffn_hidden=64) if name == "llama" else GPT(V, T, 2, 4, 32)


def _run(rank: int, world: int, strategy: str, tp: int, name: str = "llama") -> dict:
    runtime.init(DistConfig(device="cpu"))
    cfg = ParallelConfig(strategy=strategy, tp=tp)
    layout = resolve_layout(cfg, MemoryConfig(), world)
    model = _model(name)
    parallelize(model, torch.device("cpu"), world, cfg, compile=False, layout=layout)
    state, norms = _fit(model, model, layout.dp_rank(rank), layout.dp_size)  # test_fsdp's 5 AdamW steps
    wq = model.layers[0].attention.wq.weight if name == "llama" else model.blocks[0].attn.qkv.weight
    out = {"params": _full(model), "norms": norms, "dp_rank": layout.dp_rank(rank),
           "wq_local": tuple(wq.to_local().shape), "wq_placements": str(wq.placements),
           "held": sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()),
           "params_bytes": state.params_bytes, "grads_bytes": state.grads_bytes}
    if name == "gpt" and layout.dp_size == 1:
        out["tied"] = model.head.weight is model.tok_emb.weight
        # this rank's rows of the fused matrix: its halves of q, k and v (rows 0-15 of each 32 on rank 0)
        whole = model.blocks[0].attn.qkv.weight.full_tensor()
        rows = torch.cat([torch.arange(p * 32 + rank * 16, p * 32 + rank * 16 + 16) for p in range(3)])
        out["qkv_rows"] = torch.equal(wq.to_local(), whole[rows])
    return out


def _one_process(name: str = "llama") -> dict:
    model = _model(name)
    _, norms = _fit(model, model, 0, 1)
    return {"params": _full(model), "norms": norms}


@pytest.mark.parametrize("name, local", [("llama", (16, 32)), ("gpt", (48, 32))])
def test_tp2_equals_one_process(name, local):
    ref = _one_process(name)
    assert min(ref["norms"]) > CLIP  # clipping was active on every step: the global norm over shards is tested
    ranks = run_ranks(_run, 2, "ddp", 2, name)
    with torch.device("meta"):  # the planner's count of what a rank holds (plan/parallel.py stage_params)
        planned = stage_params(structure(_model(name), T), 2, 1, 0)
    for r in ranks:
        assert r["dp_rank"] == 0  # both ranks of the TP group read the same rows
        # the GPT's position table is whole on every rank and its column-split biases split: planned -9% before
        assert r["held"] == planned, (r["held"], planned)
        # every gradient split as its parameter: the Llama's embedding's was its whole vocabulary, replicated
        assert r["grads_bytes"] == r["params_bytes"], r
        # Llama: 2 of the 4 query heads (8 wide each) per rank; GPT: 2 of 4 heads of each of q, k, v
        assert r["wq_local"] == local
        assert _max_diff(r["params"], ref["params"]) < 1e-5
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
        if name == "gpt":
            assert r["tied"] and r["qkv_rows"]


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_fsdp2_x_tp2_on_four_ranks_equals_one_process(name):
    ref = _one_process(name)
    ranks = run_ranks(_run, 4, "fsdp", 2, name)
    assert [r["dp_rank"] for r in ranks] == [0, 0, 1, 1]  # mesh (dp_shard 2, tp 2): tp ranks are neighbours
    for r in ranks:
        # TP shards dim 0 over tp first, FSDP then over dp_shard: FSDP2 marks its part strided
        if name == "llama":
            assert r["wq_placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
        else:  # the fused q, k, v split part by part over tp, so FSDP takes the other dim (and _full gathers it)
            assert r["wq_placements"] == "(Shard(dim=1), _StridedShard(dim=0, sf=3))"
        assert _max_diff(r["params"], ref["params"]) < 1e-5
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)


def test_layout_places_tp_innermost_and_pp_outermost():
    lay = Layout("fsdp", 16, 2, 1, 2, tp=4, pp=2)
    assert lay.dp_size == 2
    assert [lay.dp_rank(r) for r in range(16)] == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4
    assert lay.coordinates(13) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "tp": 1}


@pytest.mark.parametrize("parallel, model, world, nnodes, message", [
    ({"tp": 3}, {}, 4, 1, "parallel.tp = 3: expected degrees whose product divides the world size 4"),
    ({"tp": 4}, {}, 4, 2, "parallel.tp = 4: expected a divisor of the 2 ranks on each machine"),
    ({"tp": 2}, {"name": "gpt", "loss": "fused"}, 2, 1, "model.loss = 'fused': expected split with parallel.tp > 1"),
    ({"tp": 2}, {"name": "mlp"}, 2, 1, "parallel.tp = 2: expected 1 with model.name = mlp"),
    ({"tp": 4}, {"name": "llama", "n_head": 4, "n_kv_head": 2}, 4, 1,
     "parallel.tp = 4: expected a divisor of model.n_kv_head = 2"),
    ({"tp": 2}, {"name": "llama", "seq_len": 63}, 2, 1,  # gloo aborted the worker on uneven sequence shards
     "data.seq_len = 63: expected a multiple of parallel.tp = 2 (sequence parallelism"),
    ({"tp": 2, "strategy": "ddp"}, {"name": "llama"}, 4, 1, "parallel.strategy = 'ddp': expected fsdp or hsdp"),
    ({"pp": 4}, {"name": "llama", "n_layer": 2}, 4, 1, "parallel.pp = 4: expected at most model.n_layer = 2"),
    ({"pp": 2}, {"name": "mlp"}, 2, 1, "parallel.pp = 2: expected 1 with model.name = mlp"),
    ({"pp": 2, "microbatches": 1}, {"name": "llama"}, 2, 1,
     "parallel.microbatches = 1: expected at least parallel.pp = 2 with parallel.pp_schedule=1f1b"),
    ({"pp": 2}, {"name": "llama", "batch_size": 6}, 2, 1,
     "data.batch_size = 6: expected a multiple of the 4 micro-batches"),
    ({"pp": 2, "pp_schedule": "interleaved", "pp_virtual": 2}, {"name": "llama", "n_layer": 3}, 2, 1,
     "parallel.pp_virtual = 2: expected at most model.n_layer / parallel.pp = 3 / 2 stages per rank"),
    ({"pp": 2, "pp_schedule": "interleaved", "pp_virtual": 1}, {"name": "llama", "n_layer": 4}, 2, 1,
     "parallel.pp_virtual = 1: expected 2 or more stages per rank with parallel.pp_schedule=interleaved"),
    ({"pp": 2, "pp_schedule": "interleaved", "microbatches": 5}, {"name": "llama", "n_layer": 4}, 2, 1,
     "parallel.microbatches = 5: expected whole rounds of parallel.pp = 2 with parallel.pp_schedule=interleaved"),
])
def test_bad_layouts_fail_in_one_line(parallel, model, world, nnodes, message):
    batch, seq_len = model.pop("batch_size", 0), model.pop("seq_len", 64)
    with pytest.raises(ConfigError) as err:
        check_layout(ParallelConfig(**parallel), MemoryConfig(), world, nnodes,
                     ModelConfig(**{"n_embd": 32, **model}), batch_size=batch, seq_len=seq_len)
    assert str(err.value).startswith(message) and "\n" not in str(err.value) and "fix: " in str(err.value)


def test_a_model_of_ones_own_named_gpt_is_not_taken_for_the_built_in_one():
    """nanoGPT's class is called GPT too: the refusal names it as the user's, not 'model.name = GPT'."""
    from scaletrain.parallel.tensor import check_tp

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = torch.nn.Linear(4, 4)

    check_tp(GPT(), 1)  # nothing to split
    with pytest.raises(ConfigError) as err:
        check_tp(GPT(), 2)
    assert str(err.value) == ("parallel.tp = 2: expected 1 for a GPT (a model of yours): tensor parallelism splits "
                              "the built-in GPT and Llama (model.name=gpt or llama) and Hugging Face models whose "
                              "config has a base_model_tp_plan; fix: --parallel.tp=1, and "
                              "--parallel.strategy=fsdp for a model that does not fit one device")


def _loss_parallel_run(rank: int, world: int, name: str) -> dict:
    """One forward and backward of the default cross-entropy, logits split by vocabulary (loss parallel) and
    gathered whole, on the same weights and batch."""
    import torch.nn.functional as F

    from scaletrain.sharded import loss_context, plain

    runtime.init(DistConfig(device="cpu"))
    torch.manual_seed(1)
    x, y = torch.randint(0, V, (4, T)), torch.randint(0, V, (4, T))
    out = {}
    for split in (True, False):
        model = _model(name)
        cfg = ParallelConfig(tp=world)
        parallelize(model, torch.device("cpu"), world, cfg, compile=False,
                    layout=resolve_layout(cfg, MemoryConfig(), world), loss_parallel=split)
        with loss_context(model):
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
        local = logits.to_local() if hasattr(logits, "to_local") else logits
        out[split] = {"loss": plain(loss.detach()).item(), "logits_local": tuple(local.shape),
                      "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}
    return out


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_loss_parallel_keeps_half_the_logits_per_rank_and_the_same_gradients(name):
    """parallel.loss_parallel: each of 2 ranks holds its half of the vocabulary's logits (torch's loss_parallel
    computes the cross-entropy on the shards), and the loss and every gradient equal the gathered logits' to
    1e-6 (the softmax's sums taken in halves)."""
    for r in run_ranks(_loss_parallel_run, 2, name):
        split, whole = r[True], r[False]
        assert split["logits_local"] == (4, T, V // 2) and whole["logits_local"] == (4, T, V)
        assert abs(split["loss"] - whole["loss"]) < 1e-6
        assert max((split["grads"][k] - whole["grads"][k]).abs().max().item() for k in whole["grads"]) < 1e-6
