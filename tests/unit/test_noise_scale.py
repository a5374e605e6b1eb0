"""The gradient noise scale estimator (observe/noise_scale.py, McCandlish et al. 2018 appendix A) on a synthetic
problem whose gradient covariance is known: per-sample gradients G + e, e ~ N(0, Sigma), so B_noise =
tr(Sigma) / |G|^2 exactly. Ranks see B_small samples each; their gradients' norms before the average and the
average's after are all the estimator gets, as it would from DDP."""

from __future__ import annotations

import math

import pytest
import torch

from scaletrain.observe.noise_scale import NoiseScale, unbiased


def _run(b_noise: float, *, ranks: int, b_small: int, steps: int, seed: int = 0) -> NoiseScale:
    gen = torch.Generator().manual_seed(seed)
    d = 64
    true_g = torch.randn(d, generator=gen, dtype=torch.float64)
    true_g *= 1.0 / true_g.norm()  # |G|^2 = 1
    sigma = torch.rand(d, generator=gen, dtype=torch.float64) + 0.5
    sigma *= b_noise / sigma.sum()  # tr(Sigma) = b_noise
    est = NoiseScale(decay=0.99)
    for _ in range(steps):
        per_sample = true_g + torch.randn(ranks, b_small, d, generator=gen, dtype=torch.float64) * sigma.sqrt()
        small = per_sample.mean(1)  # each rank's gradient, before the all-reduce
        big = small.mean(0)  # after it
        est.update(float((small ** 2).sum(1).mean()), float((big ** 2).sum()), b_small, b_small * ranks)
    return est


@pytest.mark.parametrize("b_noise, ranks, b_small", [(64.0, 2, 16), (256.0, 4, 32), (1000.0, 8, 64)])
def test_b_simple_recovers_a_known_noise_scale_within_20_percent(b_noise, ranks, b_small):
    est = _run(b_noise, ranks=ranks, b_small=b_small, steps=2000)
    assert est.b_simple == pytest.approx(b_noise, rel=0.20)
    assert est.g2 == pytest.approx(1.0, rel=0.20) and est.trace == pytest.approx(b_noise, rel=0.20)


def test_the_two_batch_identities_are_exact_on_their_expectations():
    """E|G_B|^2 = |G|^2 + tr(Sigma)/B: feeding the expectations returns |G|^2 and tr(Sigma) exactly."""
    g2, trace = 2.5, 40.0
    small, big = g2 + trace / 8, g2 + trace / 32
    assert unbiased(small, big, 8, 32) == pytest.approx((g2, trace), rel=1e-12)


def test_before_any_update_or_without_signal_it_is_nan_and_bad_batches_are_refused():
    assert math.isnan(NoiseScale().b_simple)
    est = NoiseScale()
    est.update(1.0, 1.0, 8, 16)  # no noise seen and |G|^2 = 1: B_simple 0
    assert est.b_simple == 0.0
    est = NoiseScale()
    est.update(1.0, 0.1, 8, 16)  # |G|^2 estimated negative: all noise, no signal yet
    assert math.isnan(est.b_simple)
    with pytest.raises(ValueError, match="b_small < b_big"):
        unbiased(1.0, 1.0, 16, 16)
