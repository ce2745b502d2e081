"""Cost model: per-segment quadratic cost, NNLS fit recovery, R^2."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mindspeed_flow.packing import CostModel, r_squared
from mindspeed_flow.packing.nnls import nnls


def test_cost_is_quadratic_per_segment_not_per_pack():
    model = CostModel(linear=1.0, quadratic=0.5, constant=2.0)
    assert model.cost([4, 4]) == pytest.approx(2 + 8 + 0.5 * 32)
    assert model.cost([8]) == pytest.approx(2 + 8 + 0.5 * 64)
    assert model.cost([8]) > model.cost([2, 2, 2, 2])


def test_encoder_cost_from_patch_counts():
    model = CostModel(encoder_linear=0.1, encoder_quadratic=0.01)
    assert model.cost([], image_patches=[10, 20]) == pytest.approx(0.1 * 30 + 0.01 * 500)


def test_negative_coefficients_are_rejected():
    with pytest.raises(ValueError, match="quadratic"):
        CostModel(quadratic=-1e-9)


def test_fit_recovers_known_coefficients_from_noisy_timings():
    rng = np.random.default_rng(0)
    truth = CostModel(linear=3e-6, quadratic=4e-10, constant=2e-3)
    observations = []
    for _ in range(200):
        segments = rng.integers(16, 4096, rng.integers(1, 12)).tolist()
        observations.append((segments, truth.cost(segments) * (1 + 0.01 * rng.standard_normal())))
    fitted = CostModel.fit(observations)
    assert fitted.linear == pytest.approx(truth.linear, rel=0.03)
    assert fitted.quadratic == pytest.approx(truth.quadratic, rel=0.03)
    assert fitted.constant == pytest.approx(truth.constant, rel=0.2)
    assert r_squared(fitted, observations) > 0.99


def test_fit_is_exact_on_exact_data_and_fits_the_encoder():
    truth = CostModel(linear=2.0, quadratic=0.01, constant=5.0, encoder_linear=0.3, encoder_quadratic=0.002)
    packs = [[10], [10, 20], [50, 1, 7], [80], [3, 3, 3, 3], [40, 40]]
    images = [[64], [256, 16], [1024], [4, 4, 4], [100, 900]]
    fitted = CostModel.fit(
        [(s, truth.cost(s)) for s in packs], images=[(p, truth.cost([], p) - truth.constant) for p in images]
    )
    for name in ("linear", "quadratic", "constant", "encoder_linear", "encoder_quadratic"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert r_squared(fitted, [(s, truth.cost(s)) for s in packs]) == pytest.approx(1.0)


def test_fit_clamps_a_coefficient_that_least_squares_would_make_negative():
    # Timings that fall with sum(l^2) at fixed tokens: plain least squares gives quadratic < 0.
    observations = [([100], 1.0), ([50, 50], 1.1), ([25] * 4, 1.2), ([200], 2.0), ([100, 100], 2.1)]
    unconstrained = np.linalg.lstsq(
        np.array([[sum(s), sum(x * x for x in s), 1.0] for s, _ in observations]),
        np.array([t for _, t in observations]),
        rcond=None,
    )[0]
    assert unconstrained[1] < 0
    fitted = CostModel.fit(observations)
    assert fitted.quadratic == 0.0 and fitted.linear > 0


def test_fit_needs_enough_observations():
    with pytest.raises(ValueError, match="at least 3"):
        CostModel.fit([([1], 1.0)])


def brute_force_nnls(a, b):
    best, best_x = np.inf, np.zeros(a.shape[1])
    for k in range(a.shape[1] + 1):
        for subset in itertools.combinations(range(a.shape[1]), k):
            x = np.zeros(a.shape[1])
            if subset:
                x[list(subset)] = np.linalg.lstsq(a[:, subset], b, rcond=None)[0]
            if x.min() >= 0 and np.linalg.norm(a @ x - b) < best:
                best, best_x = np.linalg.norm(a @ x - b), x
    return best_x


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.integers(0, 6))
def test_nnls_matches_brute_force_over_active_sets(seed, n, extra_rows):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((n + extra_rows + 1, n)) * rng.uniform(0.1, 10, n)
    b = rng.standard_normal(n + extra_rows + 1)
    x = nnls(a, b)
    assert x.min() >= 0
    assert np.linalg.norm(a @ x - b) <= np.linalg.norm(a @ brute_force_nnls(a, b) - b) + 1e-9
