"""A built-in model built on the meta device and split before it gets memory (the trainer does this under FSDP,
tensor and pipeline parallelism: train/job.py, Session.setup): each rank allocates only its part, and its part
holds exactly (bitwise) the values of one process's model built in memory with the same seed."""

from __future__ import annotations

import pytest
import torch
from spawn_ranks import run_ranks
from torch.distributed.tensor import DTensor

from scaletrain import runtime
from scaletrain.config import DistConfig, MemoryConfig, ParallelConfig
from scaletrain.layout import resolve_layout
from scaletrain.models import GPT, Llama
from scaletrain.models.init import is_meta, materialize
from scaletrain.parallel import parallelize

V, T = 97, 16


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(V, T, 4, 4, 2, 32, ffn_hidden=64) if name == "llama" else GPT(V, T, 4, 4, 32)


def _run(rank: int, world: int, name: str, strategy: str, tp: int, pp: int) -> dict:
    runtime.init(DistConfig(device="cpu"))
    cfg = ParallelConfig(strategy=strategy, tp=tp, pp=pp)
    layout = resolve_layout(cfg, MemoryConfig(), world)
    with torch.device("meta"):
        model = _model(name)
    part = parallelize(model, torch.device("cpu"), world, cfg, compile=False, layout=layout)
    assert is_meta(part)
    materialize(part, torch.device("cpu"))
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in part.parameters())
    aliases = getattr(part, "tied_aliases", {})
    values = {aliases.get(k, k): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
              for k, v in part.state_dict().items()}
    rope = {k: getattr(part, k).clone() for k in ("rope_cos", "rope_sin") if hasattr(part, k)}
    return {"values": values, "local": local, "rope": rope}


@pytest.mark.parametrize("name, strategy, tp, pp", [("llama", "ddp", 1, 2), ("gpt", "ddp", 1, 2),
                                                    ("gpt", "fsdp", 1, 1), ("llama", "ddp", 2, 1)])
def test_each_rank_fills_only_its_part_with_one_process_values(name, strategy, tp, pp):
    ref = _model(name)
    want = ref.state_dict()
    whole = sum(p.numel() for p in ref.parameters())
    ranks = run_ranks(_run, 2, name, strategy, tp, pp)
    seen = set()
    for r in ranks:
        for key, value in r["values"].items():
            assert torch.equal(value, want[key]), key
            seen.add(key)
        for key, value in r["rope"].items():
            assert torch.equal(value, getattr(ref, key)), key
    tied = {"head.weight"} if name == "gpt" else set()  # GPT's head is tok_emb.weight (its stage copy, checked as it)
    assert seen | tied == set(want)  # together the ranks hold every parameter
    # each rank allocated its part: under 3/4 of the model (its stage or its shards; the embedding and, for GPT's
    # tied head, its copy on the last stage keep it above a half), and together at least all of it
    assert all(r["local"] < 0.75 * whole for r in ranks), ([r["local"] for r in ranks], whole)
    assert sum(r["local"] for r in ranks) >= whole
