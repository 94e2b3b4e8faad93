"""Advantage estimators and the effective-group mask, with hand-worked values."""

import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.advantages import ADVANTAGE_ESTIMATORS, effective_groups, group_advantages

R = jnp.array([[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1]])


def test_grpo():
  # Group 0: mean 0.5, population std 0.5 -> (1 - 0.5) / (0.5 + 1e-6) = 0.999998.
  # Group 1: constant -> (r - mean) = 0 -> 0 / (0 + 1e-6) = 0, not NaN.
  a = group_advantages(R, "grpo")
  np.testing.assert_allclose(a[0], [0.999998, -0.999998, -0.999998, 0.999998], rtol=1e-6)
  np.testing.assert_array_equal(a[1], [0, 0, 0, 0])


def test_drgrpo():
  np.testing.assert_allclose(group_advantages(R, "drgrpo")[0], [0.5, -0.5, -0.5, 0.5])


def test_rloo():
  # r=1: others (1 + 0 + 0) / 3 = 1/3 -> 2/3; r=0: others (1 + 0 + 1) / 3 = 2/3 -> -2/3.
  np.testing.assert_allclose(group_advantages(R, "rloo")[0], [2 / 3, -2 / 3, -2 / 3, 2 / 3],
                             rtol=1e-6)
  # Identity: rloo = G / (G - 1) * drgrpo.
  rng = np.random.RandomState(0)
  r = jnp.asarray(rng.rand(5, 6))
  np.testing.assert_allclose(group_advantages(r, "rloo"), 6 / 5 * group_advantages(r, "drgrpo"),
                             rtol=1e-5, atol=1e-6)


def test_registry_and_errors():
  assert set(ADVANTAGE_ESTIMATORS) == {"grpo", "drgrpo", "rloo"}
  with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*grpo, drgrpo, rloo"):
    group_advantages(R, "ppo")
  with pytest.raises(ValueError, match="group size must be >= 2"):
    group_advantages(R[:, :1], "grpo")


def test_effective_groups():
  success = jnp.array([[True, True], [False, False], [True, False]])
  np.testing.assert_array_equal(effective_groups(success), [False, False, True])
  # Continuous scores: a 1e-9 spread is constant under the tolerance, 0.1 vs 0 is not.
  scores = jnp.array([[0.1, 0.1 + 1e-9], [0.0, 0.1]])
  np.testing.assert_array_equal(effective_groups(scores), [False, True])
