"""verify-resume's comparison on synthetic traces: every part of the state is told apart, the earliest
difference wins, and a job that is not reproducible at all is reported as such."""

from __future__ import annotations

import copy
import json

import pytest

from scaletrain.train.verify import compare

FIELDS = ("indices", "data", "lr", "rng", "weights", "optimizer", "scheduler", "loader", "loss")


def _trace(steps: int, ranks: int = 2) -> dict[int, list[dict]]:
    return {r: [{"step": s, **{f: f"{f}-{r}-{s}" for f in FIELDS}} for s in range(1, steps + 1)] for r in range(ranks)}


def _runs(steps: int = 10, at: int = 4):
    straight = _trace(steps)
    first = {r: [x for x in recs if x["step"] <= at] for r, recs in copy.deepcopy(straight).items()}
    resumed = {}
    for r, recs in copy.deepcopy(straight).items():
        state = {f: recs[at - 1][f] for f in ("weights", "optimizer", "rng", "scheduler", "loader")}
        resumed[r] = [{"step": at, "event": "resume", **state}] + [x for x in recs if x["step"] > at]
    return straight, first, resumed


def test_identical_traces_are_identical():
    verdict = compare(*_runs(), steps=10, at=4)
    assert verdict.identical and "bit for bit at every one of 10 steps on all 2 rank(s)" in verdict.text()


@pytest.mark.parametrize(("field", "part"), [("weights", "weights"), ("optimizer", "optimizer"), ("rng", "RNG"),
                                             ("scheduler", "LR schedule"), ("loader", "data order")])
def test_a_part_not_restored_is_named_at_resume(field, part):
    straight, first, resumed = _runs()
    resumed[1][0][field] = "other"
    verdict = compare(straight, first, resumed, steps=10, at=4)
    assert not verdict.identical and verdict.phase == "at resume" and verdict.rank == 1
    assert verdict.parts == [part]
    assert verdict.text() == f"diverged right after loading the checkpoint of step 4 on rank 1: {part} differs"


@pytest.mark.parametrize(("field", "part"), [("indices", "data order"), ("lr", "LR schedule"), ("loss", "loss")])
def test_the_first_step_that_differs_after_resume_is_named(field, part):
    straight, first, resumed = _runs()
    resumed[0][3][field] = "other"  # step 7
    resumed[1][5][field] = "other"  # step 9: later, not reported
    verdict = compare(straight, first, resumed, steps=10, at=4)
    assert (verdict.phase, verdict.step, verdict.rank, verdict.parts) == ("after resume", 7, 0, [part])


def test_a_job_that_differs_before_any_interruption_is_not_reproducible():
    straight, first, resumed = _runs()
    first[0][1]["loss"] = "other"  # step 2 of run B already differs from run A
    resumed[0][0]["weights"] = "other"  # would also differ at resume: the earlier finding wins
    verdict = compare(straight, first, resumed, steps=10, at=4)
    assert verdict.phase == "before the interruption" and verdict.step == 2
    assert "not reproducible" in verdict.text()


def test_a_loop_that_reads_no_session_loader_is_told_why_its_data_differ():
    """A loop of one's own reading its own DataLoader: no batch comes through st.loader, so the traces hold no
    indices, and a difference after the resume names the likely cause (its DataLoader started its epoch again)."""
    straight, first, resumed = _runs()
    for run in (straight, first, resumed):
        for records in run.values():
            for record in records:
                record["indices"] = []
    resumed[0][3]["weights"] = "other"  # step 7
    said = compare(straight, first, resumed, steps=10, at=4).text()
    assert said.startswith("diverged at step 7 on rank 0: weights differs; the likely cause: this loop reads no "
                           "st.loader") and said.endswith("fix: read them through st.loader(dataset)")
    straight, first, resumed = _runs()
    resumed[0][3]["weights"] = "other"
    assert "st.loader" not in compare(straight, first, resumed, steps=10, at=4).text()


def test_a_step_after_resume_that_differs_with_all_restored_alike_names_state_of_the_loops_own():
    """Weights, optimizer, RNG, data order and schedule equal after loading, yet the first step after the resume
    differs (a generator of the loop's own, out of the session's reach): the text names that cause; a later
    divergence, or one in a restored part, does not."""
    straight, first, resumed = _runs()
    for field in ("weights", "loss"):
        resumed[1][1][field] = "other"  # step 5, the first after the resume at 4 (record 0 is the resume)
    said = compare(straight, first, resumed, steps=10, at=4).text()
    assert said.startswith("diverged at step 5 on rank 1: weights, loss differ; the likely cause: state of the "
                           "loop's own that no checkpoint holds") and "fix: give it to st.track()" in said
    for record, field in ((2, "weights"), (1, "rng")):  # step 6; step 5 with an RNG that differs
        straight, first, resumed = _runs()
        resumed[1][record][field] = "other"
        assert "the likely cause" not in compare(straight, first, resumed, steps=10, at=4).text()


def test_runs_that_start_apart_are_told_so_before_their_first_step():
    """Every run traces the state it starts from (event "start"): two runs whose initial weights differ (a model
    built from an unseeded RNG before the run seeds it) are named so, with the fix, rather than 'not reproducible
    ... on a GPU, --train.deterministic=true' at step 1."""

    straight, first, resumed = _runs()
    for run, weights in ((straight, "init-a"), (first, "init-b")):
        for r in run:
            run[r].insert(0, {"step": 0, "event": "start", "weights": weights, "rng": "seeded"})
    first[1][3]["loss"] = "other"  # step 3 differs too: the start is earlier
    verdict = compare(straight, first, resumed, steps=10, at=4)
    assert (verdict.phase, verdict.step, verdict.rank, verdict.parts) == ("before the interruption", 0, 0, ["weights"])
    assert verdict.text().startswith("diverged before the first step on rank 0: weights differs from run to run, "
                                     "so resuming cannot be judged; the likely cause: the model is built before the "
                                     "run seeds the RNG") and "fix: torch.manual_seed(0) before building it" in verdict.text()
    for r in first:
        first[r][0]["weights"] = "init-a"
    assert compare(straight, first, resumed, steps=10, at=4).step == 3  # alike at the start: the step-3 finding


def test_verify_resume_keeps_run_bs_start_and_steps_up_to_the_interruption(tmp_path):
    from scaletrain.cli.verify_resume import _after, _first

    records = [{"step": 0, "event": "start"}, {"step": 1}, {"step": 2}, {"step": 2, "event": "resume"}, {"step": 3}]
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "rank-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert _first(tmp_path, 2) == {0: records[:3]}
    assert _after(tmp_path, 2) == {0: [records[0], records[3], records[4]]}


def test_the_same_samples_drawn_otherwise_are_batch_values_not_data_order():
    straight, first, resumed = _runs()
    resumed[0][2]["data"] = "augmented otherwise"  # step 6: the same indices
    said = compare(straight, first, resumed, steps=10, at=4).text()
    assert said.startswith("diverged at step 6 on rank 0: batch values differs; the same samples came out otherwise")
    resumed[0][2]["indices"] = "others"
    assert "came out otherwise" not in compare(straight, first, resumed, steps=10, at=4).text()


def test_gradients_a_step_began_with_in_one_run_only_are_named_with_their_models():
    """A GAN loop whose generator loss reaches the discriminator after its zero_grad(): the straight run's next
    step adds those gradients in, the resumed one starts without them (no checkpoint holds gradients)."""
    straight, first, resumed = _runs()
    for run in (straight, first, resumed):
        for records in run.values():
            for record in records:
                record["held"] = ["D"] if record["step"] > 1 else []
    resumed[1][1]["held"] = []  # step 5, the first after the resume of step 4
    resumed[1][1]["weights"] = "other"
    verdict = compare(straight, first, resumed, steps=10, at=4)
    assert (verdict.phase, verdict.step, verdict.rank, verdict.held) == ("after resume", 5, 1, ["D"])
    assert verdict.text() == (
        "diverged at step 5 on rank 1: weights differs; the likely cause: D held gradients no optimizer step used "
        "as step 5 began in the uninterrupted run only, left by a backward after its last zero_grad() (a generator's "
        "loss reaching the discriminator), which no checkpoint holds and which the next optimizer step adds in "
        "unless zeroed first; fix: zero the gradients before each backward (opt.zero_grad() first), or after the "
        "last backward reaching the model")
    resumed[1][1]["weights"] = straight[1][4]["weights"]  # zeroed before use (examples/gan.py): no divergence
    assert compare(straight, first, resumed, steps=10, at=4).identical


def test_a_traced_session_records_the_models_holding_gradients_as_each_step_begins(tmp_path):
    """debug.trace's "held": none at the first step; the discriminator from then on, when the loop zeroes its
    gradients before the generator's backward reaches it."""
    import torch
    from torch import nn

    import scaletrain

    config = {"train.max_steps": 3, "run.dir": str(tmp_path / "run"), "train.progress": False, "debug.trace": True}
    with scaletrain.session(config, argv=[]) as st:
        G, opt_g = st.setup(nn.Linear(2, 2), lambda p: torch.optim.SGD(p, lr=0.1), name="G")
        D, opt_d = st.setup(nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1), name="D")
        while not st.done:
            with st.step():
                fake = G(torch.randn(4, 2))
                st.backward(D(fake.detach()).mean())
                opt_d.step()
                opt_d.zero_grad()
                st.backward(-D(fake).mean())
                opt_g.step()
                opt_g.zero_grad()
    records = [json.loads(line) for line in (tmp_path / "run" / "trace" / "rank-00000.jsonl").read_text().splitlines()]
    assert [r["held"] for r in records if "event" not in r] == [[], ["D"], ["D"]]
