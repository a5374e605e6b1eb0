"""FSDP2 and HSDP compute what one process computes, and hold 1/N of the model state per rank.

A small GPT, fp32, AdamW with weight decay and gradient clipping, the same global batch of 8 sequences
everywhere: one process with all 8, DDP and FSDP on 2 ranks with 4 each, and FSDP and HSDP (2 x 2) on 4 ranks
with 2 each. Only float summation order differs (gradients reduced across ranks vs within a batch), so
parameters after 5 steps agree to 1e-5. Measured worst: 3.8e-7 for DDP, FSDP, FSDP with selective activation
checkpointing and FSDP with CPU offload on 2 ranks; 1.8e-6 for FSDP with accumulation and on 4 ranks; 5.4e-7
between HSDP and FSDP. The worst elements are in the attention key bias, whose gradient is zero in exact
arithmetic (softmax ignores a shift shared by all keys): Adam turns that rounding noise into steps of up to
lr x noise / eps, which is why lr is 1e-3 here (at 1e-2 DDP itself differs from one process by 1.1e-5).
Everything goes through parallelize(), the one place the trainer composes the techniques.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from spawn_ranks import run_ranks
from torch import nn
from torch.distributed.tensor import DTensor

from scaletrain import runtime
from scaletrain.cli import main
from scaletrain.config import CheckpointConfig, DistConfig, MemoryConfig, ParallelConfig
from scaletrain.models import GPT
from scaletrain.observe.memory import MemoryBreakdown, model_state_bytes
from scaletrain.parallel import gradient_sync, is_fsdp, parallelize, resolve_strategy
from scaletrain.train.checkpointing import Checkpointer

V, T, GLOBAL, STEPS, CLIP = 64, 32, 8, 5, 0.3


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(V, T, 2, 2, 32)


def _fit(model: nn.Module, module: nn.Module, rank: int, world: int,
         accum: int = 1) -> tuple[MemoryBreakdown, list[float]]:
    """5 AdamW steps on this rank's rows of the global batch; returns the model state (counted after the last
    step, gradients still held) and the pre-clip gradient norms."""
    data = torch.randint(0, V, (STEPS, GLOBAL, T + 1), generator=torch.Generator().manual_seed(3))
    per_rank = GLOBAL // world
    # eps 1e-6, not the default 1e-8: Adam's step lr x g / (|g| + eps) turns the rounding of a gradient that
    # sums to about zero (~1e-10 in fp32 for terms of ~1e-3, in another order under sharding) into up to
    # lr x 1e-10 / eps: 1e-5 at eps 1e-8, the tolerance itself (seen: one weight of GPT's 4,096 with |g| =
    # 1.3e-9 on step 0). At 1e-6 a correct layout stays 100x inside 1e-5; a wrong one is off by far more.
    opt = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)
    norms = []
    for step in range(STEPS):
        rows = data[step, rank * per_rank:(rank + 1) * per_rank]
        for i, micro in enumerate(rows.chunk(accum)):
            with gradient_sync(model, i == accum - 1):  # accumulate locally, reduce on the last micro-step
                out = model(micro[:, :-1])
                loss = F.cross_entropy(out.reshape(-1, V), micro[:, 1:].reshape(-1)) / accum
                loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)  # global norm, also over shards
        norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        opt.step()
        state = model_state_bytes(module, opt)
        opt.zero_grad()
    return state, norms


def _full(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of the parameters (all-gathering FSDP's shards: every rank must call this)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in module.state_dict().items()}


def _run(rank: int, world: int, strategy: str, *, accum: int = 1, replicate: int = 0, **memory) -> dict:
    model = _model()
    cfg = ParallelConfig(strategy=strategy, dp_replicate=replicate)
    wrapped = parallelize(model, torch.device("cpu"), world, cfg, compile=False,
                          memory=MemoryConfig(**memory))
    assert is_fsdp(wrapped) == (strategy != "ddp")
    state, norms = _fit(wrapped, model, rank, world, accum)
    return {"params": _full(model), "norms": norms, "state": state,
            "placements": str(next(model.parameters()).placements) if strategy != "ddp" else ""}


def _auto(rank: int, world: int, capacity: int) -> tuple[bool, str]:
    """strategy=auto with the device's capacity stated: (sharded?, the reason)."""
    model = _model()
    sample = torch.randint(0, V, (T,))
    with mock.patch("scaletrain.parallel.device_capacity_bytes", return_value=capacity):
        _, reason = resolve_strategy(model, ParallelConfig(strategy="auto"), world_size=world, sample=sample,
                                     batch_size=4)
        wrapped = parallelize(model, torch.device("cpu"), world, ParallelConfig(strategy="auto"),
                              compile=False, sample=sample, batch_size=4)
    return is_fsdp(wrapped), reason


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _batchnorm_bf16(rank: int, world: int) -> dict:
    """A BatchNorm model under FSDP with bf16 parameters: batch_norm refused bf16 weights beside its fp32
    running statistics. What the norm and the layer after it are given, and 3 steps' losses."""
    torch.manual_seed(0)
    model = _ConvBN()
    wrapped = parallelize(model, torch.device("cpu"), world, ParallelConfig(strategy="fsdp"), compile=False,
                          precision="bf16-mixed", memory=MemoryConfig())
    seen: dict[str, tuple] = {}

    def look(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            seen.setdefault(name, (module.weight.dtype, args[0].dtype))
        return hook

    model.bn.register_forward_pre_hook(look("bn"))
    model.head.register_forward_pre_hook(look("head"))
    g = torch.Generator().manual_seed(0)  # the same batch on both ranks: its loss falls step by step
    x, y = torch.randn(8, 3, 6, 6, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        loss = F.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"seen": seen, "losses": losses}


def _tied_checkpoint(rt: runtime.Runtime, where: str) -> None:
    """A DCP checkpoint of a model whose head is tied to its embedding (the GPT's), sharded over the ranks."""
    model = _model()
    wrapped = parallelize(model, torch.device("cpu"), rt.world_size, ParallelConfig(strategy="fsdp"),
                          compile=False, memory=MemoryConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck = Checkpointer(CheckpointConfig(every=1, async_save=False), Path(where), rt)
    ck.save_sharded(1, wrapped, opt, {"step": 1}, {}, {"format": "dcp", "step": 1})
    ck.close()


def _two_ranks(rank: int, world: int, where: str) -> dict:
    _tied_checkpoint(runtime.init(DistConfig(device="cpu")), where)
    return {"batchnorm_bf16": _batchnorm_bf16(rank, world),
            "auto_fits": _auto(rank, world, 10**10), "auto_tight": _auto(rank, world, 1_200_000),
            "ddp": _run(rank, world, "ddp"),
            "fsdp": _run(rank, world, "fsdp"),
            "fsdp_accum": _run(rank, world, "fsdp", accum=2),
            "fsdp_selective": _run(rank, world, "fsdp", activation_checkpointing="selective"),
            "fsdp_offload": _run(rank, world, "fsdp", cpu_offload=True)}


def _four_ranks(rank: int, world: int) -> dict:
    runtime.init(DistConfig(device="cpu"))
    return {"fsdp": _run(rank, world, "fsdp"), "hsdp": _run(rank, world, "hsdp", replicate=2)}


def _max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _one_process() -> dict:
    model = _model()
    state, norms = _fit(model, model, 0, 1)
    return {"params": _full(model), "norms": norms, "state": state}


def _slack_bytes(model: nn.Module, world: int) -> int:
    """What a rank holds beyond 1/world of a replica: FSDP pads each tensor's dim 0 to a multiple of the world
    size (parameter, gradient, AdamW's two states: fp32), and AdamW's scalar step per tensor is not
    sharded."""
    return sum(4 * 4 * (-p.shape[0] % world) * p[0].numel() + 4 for p in model.parameters())


def test_fsdp_and_ddp_on_two_ranks_equal_one_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = _one_process()
    assert min(ref["norms"]) > CLIP  # clipping was active on every step, so its global norm is tested too
    ranks = run_ranks(_two_ranks, 2, str(tmp_path))
    # The DCP checkpoint's export stores the tied weight once, as model.safetensors does (its shards hold a copy
    # per name: it wrote 3 copies of T5's embedding and counted them as parameters)
    assert main(["checkpoint", "export", str(tmp_path), str(tmp_path / "w.safetensors")]) == 0
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        names, aliases = set(f.keys()), json.loads(f.metadata()["aliases"])
    assert aliases == {"head.weight": "tok_emb.weight"} and "head.weight" not in names
    assert names | set(aliases) == set(_model().state_dict())
    assert f"{sum(p.numel() for p in _model().parameters()) / 1e6:.3f}M parameters" in capsys.readouterr().out
    for r in ranks:
        # auto: a replica, 457 kB of model state + 598 kB of activations measured at batch 4, fits 80% of
        # 10 GB but not 80% of 1.2 MB (960 kB); sharded over 2 ranks (228 + 598 kB) it does
        assert not r["auto_fits"][0] and r["auto_fits"][1].startswith("auto -> ddp: a full replica")
        assert r["auto_tight"][0] and r["auto_tight"][1].startswith("auto -> fsdp: a full replica")
        assert "still over" not in r["auto_tight"][1]
        for name in ("ddp", "fsdp", "fsdp_accum", "fsdp_selective", "fsdp_offload"):
            assert _max_diff(r[name]["params"], ref["params"]) < 1e-5, name
            norms = torch.tensor(r[name]["norms"])
            torch.testing.assert_close(norms, torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
    assert ranks[0]["fsdp"]["placements"] == "(Shard(dim=0),)"
    for r in ranks:  # BatchNorm computes in fp32 in a unit of its own; the layers around it in bf16
        bn = r["batchnorm_bf16"]
        assert bn["seen"] == {"bn": (torch.float32, torch.float32), "head": (torch.bfloat16, torch.bfloat16)}, bn
        assert all(math.isfinite(v) for v in bn["losses"]) and bn["losses"][-1] < bn["losses"][0], bn["losses"]
    # model state per rank from the live tensors: 1/2 of a replica up to padding and AdamW's step scalars
    # (measured: 228,464 bytes per rank under FSDP vs 456,816 for DDP's replica)
    ddp, replica = ranks[0]["ddp"]["state"], ref["state"]
    assert ddp == replica and replica.grads_bytes == replica.params_bytes  # DDP: grads are bucket views
    slack = _slack_bytes(_model(), 2)
    for r in ranks:
        s = r["fsdp"]["state"]
        assert replica.model_state_bytes / 2 <= s.model_state_bytes <= replica.model_state_bytes / 2 + slack
        assert 0 < s.grads_bytes <= replica.grads_bytes / 2 + slack


def test_hsdp_2x2_equals_fsdp_on_four_ranks():
    ranks = run_ranks(_four_ranks, 4)
    ref = _one_process()
    for r in ranks:
        assert _max_diff(r["hsdp"]["params"], r["fsdp"]["params"]) < 1e-5
        assert _max_diff(r["fsdp"]["params"], ref["params"]) < 1e-5
    assert ranks[0]["hsdp"]["placements"] == "(Replicate(), Shard(dim=0))"  # the 2-D mesh
    replica = ref["state"].model_state_bytes
    for r in ranks:
        assert replica / 4 <= r["fsdp"]["state"].model_state_bytes <= replica / 4 + _slack_bytes(_model(), 4)
        assert replica / 2 <= r["hsdp"]["state"].model_state_bytes <= replica / 2 + _slack_bytes(_model(), 2)
