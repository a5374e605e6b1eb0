"""Random number generators of a loop's own (st.track(), or found among the loop's variables): their state
as a checkpoint tree holds it, back bit for bit, and refused for another kind of generator."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from scaletrain.checkpoint import rng
from scaletrain.checkpoint.tree import decode, encode

KINDS = {
    "torch": lambda: torch.Generator().manual_seed(3),
    "python": lambda: random.Random(4),
    "RandomState": lambda: np.random.RandomState(5),
    "default_rng": lambda: np.random.default_rng(6),
    "MT19937": lambda: np.random.Generator(np.random.MT19937(7)),
    "Philox": lambda: np.random.Generator(np.random.Philox(8)),  # uint64 arrays and a buffer
    "SFC64 bits": lambda: np.random.SFC64(9),
}


def _draw(gen) -> list[float]:
    """Numbers of several kinds (a normal's cached second value included, where the generator keeps one)."""
    if isinstance(gen, torch.Generator):
        return torch.rand(3, generator=gen).tolist() + torch.randn(3, generator=gen).tolist()
    if isinstance(gen, random.Random):
        return [gen.random(), gen.gauss(0, 1)]
    if isinstance(gen, np.random.BitGenerator):
        gen = np.random.Generator(gen)
    if isinstance(gen, np.random.RandomState):
        return [*gen.random_sample(3).tolist(), gen.standard_normal()]
    return [*gen.random(3).tolist(), gen.standard_normal(), float(gen.integers(0, 2**40))]


@pytest.mark.parametrize("kind", KINDS)
def test_a_generators_state_round_trips_through_a_checkpoint_tree(kind):
    gen = KINDS[kind]()
    _draw(gen)  # mid-stream: a normal's spare value pending in random.Random and RandomState
    saved, _ = decode(encode(rng.generator_state(gen)), "rank-00000.safetensors")  # nothing pickled
    after = _draw(gen)
    fresh = KINDS[kind]()  # a new run's generator, as seeded
    rng.set_generator_state(fresh, saved)
    assert _draw(fresh) == after


def test_another_kinds_state_is_refused():
    with pytest.raises(ValueError, match="holds a python generator's state, not a torch one's"):
        rng.set_generator_state(torch.Generator(), rng.generator_state(random.Random(0)))
    with pytest.raises(ValueError, match="PCG64"):  # numpy's own check: another bit generator
        rng.set_generator_state(np.random.default_rng(0), rng.generator_state(np.random.SFC64(0)))


def test_the_loops_generators_are_found_by_name_and_one_attribute_deep_not_the_global_ones():
    noise = torch.Generator().manual_seed(1)
    trainer = types.SimpleNamespace(rng=np.random.default_rng(0), nested=types.SimpleNamespace(g=random.Random(1)))
    found = rng.named_generators({"noise": noise, "again": noise, "trainer": trainer, "random": random,
                                  "system": random.SystemRandom(), "inst": random._inst,
                                  "np_global": np.random.mtrand._rand, "torch_global": torch.default_generator,
                                  "loader": torch.utils.data.DataLoader([1], generator=torch.Generator())})
    # once each; SystemRandom has no state; two deep is not looked in, nor a DataLoader (its generator is its own)
    assert list(found) == ["noise", "trainer.rng"]
    assert found["noise"] is noise and found["trainer.rng"] is trainer.rng
