"""What a session counts as training: tokens of padded batches of any width, and none of the batches a held-out
loader hands out inside st.evaluating()."""

from __future__ import annotations

import json

import torch
from torch import nn

import scaletrain


class Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids).mean(1))


def _samples(widths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.ones(w, dtype=torch.long), torch.tensor(i % 2)) for i, w in enumerate(widths)]


def _pad(samples):
    width = max(len(ids) for ids, _ in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    for row, (one, _) in enumerate(samples):
        ids[row, :len(one)] = one
    return ids, torch.stack([target for _, target in samples])


def test_tokens_are_each_batchs_own_and_held_out_batches_are_not_training(tmp_path):
    run = tmp_path / "run"
    # batches of 2, in order: padded widths 3, 5, 7, 9 (the first batch's width, 3, was taken for every batch)
    train = _samples([3, 2, 5, 4, 7, 6, 9, 8])
    held_out = _samples([4] * 6)
    cfg = {"run.dir": str(run), "dist.device": "cpu", "train.max_steps": 4, "log.every": 4, "data.batch_size": 2,
           "data.shuffle": False, "train.progress": False}
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(Tokens(), lambda params: torch.optim.SGD(params, lr=0.1))
        loader = st.loader(train, collate_fn=_pad)
        val = st.loader(held_out, collate_fn=_pad, shuffle=False)
        for ids, target in loader:
            with st.step():
                loss = nn.functional.cross_entropy(model(ids), target)
                st.backward(loss)
                opt.step()
                opt.zero_grad()
            if st.steps == 2:
                with st.evaluating(), torch.no_grad():
                    seen = sum(len(ids) for ids, _ in val)  # 6 held-out samples, read between steps
            if st.done:
                break
    assert seen == 6
    record = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line).get("kind") == "train")
    samples = record["samples_per_s"] * record["step_time_s"] * 4
    assert round(samples, 6) == 8  # 4 steps x 2: the 6 held-out samples are not in it (14 before)
    assert round(record["tokens_per_s"] / record["samples_per_s"], 6) == 6.0  # (3 + 5 + 7 + 9) / 4 (3.43 before)
    summary = json.loads((run / "summary.json").read_text())
    assert round(summary["tokens_per_s"] / summary["samples_per_s"], 6) == 6.0


def _accumulating(run, steps: int) -> None:
    """A loop accumulating over 2 batches of 4 it draws itself each step, from a loader made without accum=."""
    cfg = {"run.dir": str(run), "dist.device": "cpu", "train.max_steps": steps, "checkpoint.every": 3,
           "log.every": 3, "data.batch_size": 4, "train.progress": False}
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        batches = iter(st.loader((x, (x[:, 0] > 0).long())))
        while not st.done:
            with st.step():
                for _ in range(2):
                    xb, yb = next(batches)
                    st.backward(nn.functional.cross_entropy(model(xb), yb) / 2)
                opt.step()
                opt.zero_grad()


def test_samples_are_the_batches_a_loop_drew_however_it_accumulates(tmp_path):
    """The summary's samples were steps x the loader's step (its accum=1): 24 for 6 steps of 2 batches of 4. Now
    the batches drawn for steps, 48, and a resumed run goes on from the count its checkpoint saved."""
    _accumulating(tmp_path / "whole", 6)
    assert json.loads((tmp_path / "whole/summary.json").read_text())["samples"] == 48
    _accumulating(tmp_path / "parts", 3)
    assert json.loads((tmp_path / "parts/summary.json").read_text())["samples"] == 24
    (tmp_path / "parts/summary.json").unlink()  # unfinished again: the same directory resumes from step 3
    _accumulating(tmp_path / "parts", 6)
    assert json.loads((tmp_path / "parts/summary.json").read_text())["samples"] == 48
    # the checkpoints' batch per step (checkpoint inspect's, a resume's at another world size): 8 in 2 batches,
    # not the loader's 4 in 1; the one made by the resumed attempt too
    for step in (3, 6):
        meta = json.loads((tmp_path / f"parts/checkpoints/step-{step:08d}/manifest.json").read_text())["meta"]
        assert (meta["global_batch"], meta["accum_steps"]) == (8, 2), meta



def test_a_loop_with_no_break_ends_at_the_last_step(tmp_path):
    """`for epoch in range(3): for xb, yb in loader:` with no `if st.done: break`: it trained on past
    train.max_steps (the progress line read "step 31/20"); the loader now ends its epoch once the session is done,
    drawing nothing more, and the run is the 5 steps it was asked for."""
    cfg = {"run.dir": str(tmp_path / "run"), "dist.device": "cpu", "train.max_steps": 5, "data.batch_size": 4,
           "train.progress": False}
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))  # 4 batches an epoch
    steps_seen = []
    with scaletrain.session(cfg) as st:
        model, opt = st.setup(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1))
        loader = st.loader((x, (x[:, 0] > 0).long()))
        for _ in range(3):
            for xb, yb in loader:
                with st.step():
                    st.backward(nn.functional.cross_entropy(model(xb), yb))
                    opt.step()
                    opt.zero_grad()
                steps_seen.append(st.steps)
        assert loader.epoch == 1  # one batch into the second epoch; no third epoch was begun
    assert steps_seen == [1, 2, 3, 4, 5]
    assert json.loads((tmp_path / "run/summary.json").read_text())["samples"] == 20
