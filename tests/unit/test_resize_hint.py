"""A resume at another world size that cannot keep the global batch says what would keep it, and what it says
is reachable: the settings it names give that global batch on the new world, or it says that none can."""

from __future__ import annotations

import re

import pytest

from scaletrain.config import load
from scaletrain.train.batching import plan_batches

HINT = re.compile(r"; ((?:--data\.batch_size=(\d+))?(?: and )?(no --train\.accum_steps)?) keeps it at (\d+) "
                  r"\(accumulation (\d+)\)$")


def _meta(world: int, global_batch: int) -> dict:
    return {"world_size": world, "global_batch": global_batch, "step": 10,
            "loader": {"epoch": 0, "cursor": 640, "end": 1408, "size": 1437, "step_samples": global_batch}}


def test_2_to_3_ranks_says_no_setting_keeps_64():
    plan = plan_batches(load("digits", {"data.batch_size": 32}), 3, 1437, _meta(2, 64))
    assert plan.global_batch == 96
    assert plan.note == ("world size 2 -> 3: the global batch changes 64 -> 96 (64 is not a multiple of "
                         "batch_size x world = 96); no setting keeps 64 on 3 ranks (64 is not a multiple "
                         "of 3)")


@pytest.mark.parametrize("was_world,world,batch,accum", [
    (2, 4, 32, 1), (2, 1, 48, 1), (4, 3, 32, 1), (2, 3, 48, 1), (6, 4, 32, 1), (2, 1, 32, 3), (8, 6, 20, 1),
    (3, 2, 7, 1)])
def test_the_hint_keeps_the_global_batch_or_says_no_setting_can(was_world, world, batch, accum):
    was = 32 * was_world
    cfg = load("digits", {"data.batch_size": batch, "train.accum_steps": accum})
    plan = plan_batches(cfg, world, 1437, _meta(was_world, was))
    assert plan.global_batch != was and plan.note.startswith(f"world size {was_world} -> {world}: ")
    if was % world:
        assert plan.note.endswith(f"no setting keeps {was} on {world} ranks ({was} is not a multiple of "
                                  f"{world})")
        return
    hint = HINT.search(plan.note)
    assert hint and hint[1] and int(hint[4]) == was, plan.note
    overrides = {"data.batch_size": int(hint[2] or batch), "train.accum_steps": 1 if hint[3] else accum}
    assert overrides["data.batch_size"] <= batch  # no larger per-rank batch than the one that fitted
    kept = plan_batches(load("digits", overrides), world, 1437, _meta(was_world, was))
    assert kept.global_batch == was and kept.accum_steps == int(hint[5]), kept.note


def test_a_resume_from_a_pipeline_counts_data_parallel_ranks_not_the_world():
    """2 pipeline ranks read one batch: resuming them as 2 DDP ranks doubles the readers, not the world (2 -> 2),
    and the note says which count changed."""
    meta = {**_meta(2, 32), "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 2}}
    plan = plan_batches(load("digits", {"data.batch_size": 16}), 2, 1437, meta)
    assert plan.note == "data-parallel ranks 1 -> 2: accumulation 1 keeps the global batch at 32"
    plain = plan_batches(load("digits", {"data.batch_size": 16}), 2, 1437, _meta(1, 32))
    assert plain.note == "world size 1 -> 2: accumulation 1 keeps the global batch at 32"
