"""A loop of one's own drawing from random number generators of its own, seeded apart on each rank (noise from
a torch.Generator, coin flips from numpy's default_rng, a jitter from random.Random): each rank's generators are
checkpointed with the run, found among the loop's variables without a word from it, and a run stopped at step 5
and resumed is the straight run bit for bit on every rank. Before, the resumed run drew them as seeded again and
diverged at its first step (verify-resume: 'diverged at step 6 on rank 0: weights, loss differ')."""

from __future__ import annotations

import contextlib
import io
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from spawn_ranks import run_ranks


def _noisy(rank: int, where: str, steps: int, explicit: dict[str, str]) -> tuple[dict[str, torch.Tensor], list, str]:
    """``steps`` steps of a classifier on noisy inputs; ``explicit``: variable -> the name= st.track() is given
    ('' for its default). Returns the weights, each generator's next numbers and what rank 0 printed."""
    import scaletrain

    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    cfg = {"run.dir": where, "train.max_steps": steps, "data.batch_size": 16, "checkpoint.every": 5,
           "log.every": 5, "train.progress": False}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), scaletrain.session(cfg) as st:
        model, opt = st.setup(torch.nn.Linear(8, 2), lambda p: torch.optim.SGD(p, lr=0.1))
        noise = torch.Generator().manual_seed(1000 + rank)
        flips = np.random.default_rng(2000 + rank)
        jitter = random.Random(3000 + rank)
        for variable, name in explicit.items():
            st.track(locals()[variable], name=name)
        loader = st.loader((x, y))
        while not st.done:
            for xb, yb in loader:
                with st.step():
                    xb = xb + 0.1 * torch.randn(xb.shape, generator=noise)
                    xb = -xb if flips.random() < 0.5 else xb
                    loss = torch.nn.functional.cross_entropy(model(xb * jitter.uniform(0.9, 1.1)), yb)
                    st.backward(loss)
                    opt.step()
                    opt.zero_grad()
                if st.done:
                    break
    after = [torch.rand(2, generator=noise).tolist(), flips.random(2).tolist(), jitter.random()]
    return {k: v.clone() for k, v in model.state_dict().items()}, after, printed.getvalue()


def _runs(rank: int, world: int, where: str) -> dict[str, object]:
    from scaletrain.errors import CheckpointError

    straight = _noisy(rank, f"{where}/straight", 12, {})
    _noisy(rank, f"{where}/parts", 5, {})
    Path(f"{where}/parts/summary.json").unlink(missing_ok=True)  # finished at 5: a longer run goes on from it
    resumed = _noisy(rank, f"{where}/parts", 12, {"noise": "", "flips": ""})  # st.track() now: the same names
    Path(f"{where}/parts/summary.json").unlink(missing_ok=True)
    with pytest.raises(CheckpointError, match=r"rank \d's state holds the generators \['flips', 'jitter', 'noise'\], "
                                              r"not 'other'"):
        _noisy(rank, f"{where}/parts", 14, {"noise": "other"})
    return {"straight": straight, "resumed": resumed}


def test_a_loops_own_generators_resume_on_every_rank_bit_for_bit(tmp_path: Path) -> None:
    ranks = run_ranks(_runs, 2, str(tmp_path))
    for rank in ranks:
        (weights, after, said), (weights_again, after_again, _) = rank["straight"], rank["resumed"]
        assert weights.keys() == weights_again.keys()
        assert all(torch.equal(weights[k], weights_again[k]) for k in weights)
        assert after == after_again  # each generator goes on from where the straight run's was
    assert ranks[0]["straight"][1] != ranks[1]["straight"][1]  # seeded apart: each rank's own state came back
    assert ("checkpointed with the run: the loop's own random generators noise (Generator), flips (Generator), "
            "jitter (Random), each rank's") in ranks[0]["straight"][2]
