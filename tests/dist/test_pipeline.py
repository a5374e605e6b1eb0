"""Pipeline parallelism computes what one process computes.

Tiny Llama and GPT (4 blocks, width 32, fp32), AdamW with weight decay, gradients clipped by the whole model's
norm, the same global batch of 8 sequences everywhere: one process with all 8; 2 stages on 2 ranks under GPipe
and 1F1B; on 4 ranks GPT as 2 stages x 2 data-parallel replicas (4 rows each, 1F1B) and as 4 stages (GPipe;
the tied weight's gradient then summed in a group of the first and last rank only). Each micro-batch's mean
loss is averaged over the micro-batches, so only float summation order differs (gradients accumulated over
micro-batches, summed between ranks), and parameters after 5 steps agree to 1e-5. GPT's head is tied to its
embedding: under pp the last stage holds a copy whose gradient is summed with the embedding's, so the two
copies must end bitwise equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from spawn_ranks import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from scaletrain.models import GPT, Llama
from scaletrain.parallel.pipeline import (
    PipelineRunner,
    bubble_fraction,
    clip_grad_norm,
    pipeline_stage,
    resolve_microbatches,
    split_stages,
    stage_layers,
)

V, T, C, LAYERS, GLOBAL, STEPS, CLIP, LR = 64, 16, 32, 4, 8, 5, 0.5, 1e-3
EVAL_AT = 3  # the held-out loss is taken before this step: training goes on after an eval pass


def _model(name: str, layers: int = LAYERS) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(V, T, layers, 2, C)
    return Llama(V, T, layers, 2, 1, C)  # grouped-query attention: 1 key/value head for 2 query heads


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def _data() -> torch.Tensor:
    return torch.randint(0, V, (STEPS + 1, GLOBAL, T + 1), generator=torch.Generator().manual_seed(3))


def _one_process(name: str) -> dict:
    """5 steps on the whole batch, and the loss on a held-out batch (the data's last) before step EVAL_AT."""
    model, data = _model(name), _data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    norms, losses = [], []
    for step in range(STEPS):
        if step == EVAL_AT:
            with torch.no_grad():
                held_out = _loss(model(data[STEPS, :, :-1]), data[STEPS, :, 1:]).item()
        loss = _loss(model(data[step, :, :-1]), data[step, :, 1:])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms,
            "losses": losses, "eval": held_out}


def _pipelined(mesh, name: str, schedule: str, microbatches: int) -> dict:
    """The same 5 steps with this rank's stage and this data-parallel rank's rows; a "tp" axis splits the stage
    as the trainer does (apply_tp, the logits gathered for _loss) and its ranks read the same rows."""
    from torch.distributed.tensor import DTensor

    from scaletrain.parallel.tensor import apply_tp

    names = mesh.mesh_dim_names
    stage = pipeline_stage(_model(name), mesh.size(names.index("pp")), mesh.get_local_rank("pp"))
    if "tp" in names:
        apply_tp(stage, mesh["tp"])
    runner = PipelineRunner(stage, mesh, device=torch.device("cpu"), microbatches=microbatches,
                            schedule=schedule, loss_fn=_loss)
    dp = mesh.size(names.index("dp_replicate")) if "dp_replicate" in names else 1
    lo, n = (mesh.get_local_rank("dp_replicate") if dp > 1 else 0) * GLOBAL // dp, GLOBAL // dp
    data = _data()[:, lo:lo + n]
    opt = torch.optim.AdamW(stage.parameters(), lr=LR, weight_decay=0.1)
    norms, losses, times = [], [], []
    for step in range(STEPS):
        if step == EVAL_AT:
            stage.eval()
            with torch.no_grad():
                held_out = runner.eval_step(data[STEPS, :, :-1], data[STEPS, :, 1:])
            stage.train()
        loss = runner.step(data[step, :, :-1], data[step, :, 1:])
        norms.append(float(clip_grad_norm(stage, CLIP, runner.pp_group)))
        losses.append(None if loss is None else float(loss))
        times.append(runner.times)
        opt.step()
        opt.zero_grad()
    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
              for k, v in stage.state_dict().items()}
    return {"params": params, "norms": norms, "losses": losses, "times": times,
            "eval": None if held_out is None else float(held_out)}


def _two_ranks(rank: int, world: int) -> dict:
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    out = {f"{name}-{schedule}": _pipelined(mesh, name, schedule, 4)
           for name in ("llama", "gpt") for schedule in ("gpipe", "1f1b")}
    runner = PipelineRunner(pipeline_stage(_model("llama"), 2, rank), mesh, device=torch.device("cpu"),
                            microbatches=4, schedule="1f1b", loss_fn=_loss)
    with pytest.raises(ValueError) as err:  # raised before any communication, on every rank alike
        runner.step(_data()[0, :7, :-1], _data()[0, :7, 1:])
    out["uneven"] = str(err.value)
    return out


def _four_ranks(rank: int, world: int) -> dict:
    torch.distributed.init_process_group("gloo")
    pp_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_replicate"))
    pp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    return {"gpt-pp2-dp2": _pipelined(pp_dp, "gpt", "1f1b", 2), "gpt-pp4": _pipelined(pp4, "gpt", "gpipe", 4)}


def _pp_x_tp(rank: int, world: int, name: str) -> dict:
    """2 stages x tensor parallelism 2 (4 ranks, one data-parallel rank: every rank reads all 8 rows); the
    stage split by apply_tp as the trainer splits it, the logits gathered for _loss. GPT: the last stage's head
    copy is split by the same vocabulary rows as the first stage's embedding, and their shards summed rank by rank."""
    torch.distributed.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    return {name: _pipelined(mesh, name, "1f1b", 4)}


@pytest.mark.parametrize("name", ["gpt"])  # the Llama's pp x tp: tests/cli/test_pipeline_cli.py (8 ranks, FSDP too)
def test_two_stages_by_tensor_parallelism_2_equal_one_process(name):
    ranks = run_ranks(_pp_x_tp, 4, name)
    if name == "gpt":  # stage 1's head copy, whole, equals stage 0's embedding (the tie kept)
        assert torch.equal(ranks[2][name]["params"]["head.weight"], ranks[0][name]["params"]["tok_emb.weight"])
    _check(ranks, name, _one_process(name), last=[2, 3])


def _check(ranks: list[dict], run: str, ref: dict, last: list[int]) -> None:
    """Every rank's parameters within 1e-5 of one process's, the stages together holding them all; norms and
    the loss (on the last stages: ``last``) as one process has them."""
    seen = set()
    for r in ranks:
        got = r[run]["params"]
        seen |= got.keys()
        worst = max((got[k] - ref["params"][k]).abs().max().item() for k in got)
        assert worst < 1e-5, (run, worst)
        norms = torch.tensor(r[run]["norms"])
        torch.testing.assert_close(norms, torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
    assert seen == ref["params"].keys(), run
    losses = torch.tensor([ranks[i][run]["losses"] for i in last]).mean(0)  # over data-parallel replicas
    torch.testing.assert_close(losses, torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    evals = torch.tensor([ranks[i][run]["eval"] for i in last]).mean()
    torch.testing.assert_close(evals, torch.tensor(ref["eval"]), rtol=1e-5, atol=0)
    assert all(r[run]["losses"] == [None] * STEPS for i, r in enumerate(ranks) if i not in last)


def test_two_stages_under_gpipe_and_1f1b_equal_one_process():
    ranks = run_ranks(_two_ranks, 2)
    for name in ("llama", "gpt"):
        ref = _one_process(name)
        assert min(ref["norms"]) > CLIP  # clipping was active on every step, so the global norm is tested too
        for schedule in ("gpipe", "1f1b"):
            _check(ranks, f"{name}-{schedule}", ref, last=[1])
    # the tied head: stage 1's copy took the same 5 steps as stage 0's embedding
    for run in ("gpt-gpipe", "gpt-1f1b"):
        assert torch.equal(ranks[0][run]["params"]["tok_emb.weight"], ranks[1][run]["params"]["head.weight"])
    for r in ranks:
        assert r["uneven"] == ("the batch of 7 inputs rows does not split into parallel.microbatches=4 equal "
                               "micro-batches; make the per-rank batch size a multiple of 4")
        for times in r["llama-1f1b"]["times"]:
            assert 0 < times.busy_s < times.wall_s and 0 < times.bubble < 1


def test_two_stages_by_two_replicas_and_four_stages_equal_one_process():
    ranks = run_ranks(_four_ranks, 4)
    gpt = _one_process("gpt")
    _check(ranks, "gpt-pp2-dp2", gpt, last=[2, 3])  # mesh (pp, dp): ranks 2 and 3 hold stage 1
    _check(ranks, "gpt-pp4", gpt, last=[3])
    for run, first, last in (("gpt-pp2-dp2", 0, 2), ("gpt-pp2-dp2", 1, 3), ("gpt-pp4", 0, 3)):
        emb, head = ranks[first][run]["params"]["tok_emb.weight"], ranks[last][run]["params"]["head.weight"]
        assert torch.equal(emb, head)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_stages_keep_the_models_names_and_compute_its_logits(name: str):
    model = _model(name, layers=5)
    stages = split_stages(model, 2)
    blocks = "blocks" if name == "gpt" else "layers"
    assert {k.split(".")[1] for k in stages[0].state_dict() if k.startswith(blocks)} == {"0", "1", "2"}
    assert {k.split(".")[1] for k in stages[1].state_dict() if k.startswith(blocks)} == {"3", "4"}
    whole = model.state_dict()
    union = {k: v for s in stages for k, v in s.state_dict().items()}
    assert union.keys() == whole.keys()
    assert all(torch.equal(union[k], whole[k]) for k in whole)  # GPT's head copy starts equal
    idx = torch.randint(0, V, (2, T))
    x = idx
    for s in stages:
        x = s(x)
    assert torch.equal(x, model(idx))
    fresh = _model(name, layers=5)
    nn.init.zeros_(next(fresh.parameters()))
    fresh.load_state_dict(union)  # a pp = 2 checkpoint loads into one process's model by name
    assert torch.equal(fresh(idx), model(idx))


def test_bad_splits_say_what_to_set():
    with pytest.raises(ValueError) as err:
        pipeline_stage(_model("gpt", layers=2), 3, 0)
    assert str(err.value) == ("parallel.pp=3 stages need at least 3 blocks but model.n_layer=2; "
                              "set --parallel.pp to at most 2")
    with pytest.raises(ValueError, match=r"^parallel.microbatches=2 is fewer than parallel.pp=4 stages"):
        resolve_microbatches(4, 2, "1f1b")
    with pytest.raises(ValueError, match=r"^parallel.pp=2 splits the built-in models \(model.name=gpt or llama\) and Hugging Face causal LMs laid out as Llama.s, not Sequential"):
        pipeline_stage(nn.Sequential(nn.Linear(2, 2)), 2, 0)
    assert resolve_microbatches(4, 0, "1f1b") == 8 and resolve_microbatches(4, 2, "gpipe") == 2
    assert stage_layers(7, 3) == [range(3), range(3, 5), range(5, 7)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]


def test_bubble_fraction():
    assert bubble_fraction(1, 4) == 0.0
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, virtual=2) == pytest.approx(3 / 19)
    x = (4 - 1) / 8  # the same bubble as a share of the ideal time
    assert bubble_fraction(4, 8) == pytest.approx(x / (1 + x))
    with pytest.raises(ValueError):
        bubble_fraction(0, 4)
