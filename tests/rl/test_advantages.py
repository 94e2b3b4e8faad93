"""Advantage estimators and the effective-group mask, with hand-worked values."""

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from grpo_jax.rl.advantages import effective_groups, group_advantages, make_estimator
from grpo_jax.rl.estimators import ESTIMATORS

R = jnp.array([[1.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1]])
EPS = 1e-6


def _grpo_ref(r):
  """float64 numpy reference: (r - mean) / (std + eps), unbiased std (ddof = 1)."""
  r = np.asarray(r, np.float64)
  mean = r.mean(-1, keepdims=True)
  return (r - mean) / (r.std(-1, ddof=1, keepdims=True) + EPS)


def _rloo_ref(r):
  """float64 leave-one-out by explicit loops: r_i - mean_{j != i} r_j."""
  r = np.asarray(r, np.float64)
  out = np.empty_like(r)
  for b in range(r.shape[0]):
    for i in range(r.shape[1]):
      out[b, i] = r[b, i] - np.delete(r[b], i).mean()
  return out


def test_grpo():
  """Hand values with ddof = 1. Fails under ddof = 0 (would give 0.999998) and under a mean
  (instead of 0) for constant groups / a NaN from 0 / 0."""
  # Group 0: mean 0.5; unbiased var = 4 * 0.5^2 / (4 - 1) = 1/3, std = 0.5773503;
  # (1 - 0.5) / (0.5773503 + 1e-6) = 0.8660239.  (ddof = 0 gave 0.5 / 0.500001 = 0.999998.)
  # Group 1: constant -> (r - mean) = 0 -> 0 / (0 + 1e-6) = 0, not NaN.
  a = group_advantages(R, "grpo")
  np.testing.assert_allclose(a[0], [0.8660239, -0.8660239, -0.8660239, 0.8660239], rtol=1e-6)
  np.testing.assert_array_equal(a[1], [0, 0, 0, 0])


def test_grpo_group_of_two_by_hand():
  """G = 2: the unbiased std of {0, 1} is 1 / sqrt(2). Mutation: ddof = 0 gives +-0.999998."""
  # mean 0.5, var = (0.25 + 0.25) / (2 - 1) = 0.5, std = 0.7071068;
  # 0.5 / (0.7071068 + 1e-6) = 0.7071058.
  a = group_advantages(jnp.array([[0.0, 1.0]]), "grpo")
  np.testing.assert_allclose(a[0], [-0.7071058, 0.7071058], rtol=1e-6)


def test_grpo_eps_added_to_std_not_to_variance():
  """Mutations: sqrt(var + eps) instead of std + eps (gives 5e-4), and ddof = 0 (gives 1/3)."""
  # rewards [0, 1e-6]: mean 5e-7, deviations -+5e-7; unbiased var = 2 * (5e-7)^2 / 1 = 5e-13,
  # std = 7.0710678e-7.
  #   std + eps:        5e-7 / (7.0710678e-7 + 1e-6) = 5e-7 / 1.7071068e-6 = 0.2928932
  #   sqrt(var + eps):  5e-7 / sqrt(5e-13 + 1e-6)    = 5e-7 / 1.00000025e-3 = 0.0005000
  #   ddof = 0:         5e-7 / (5e-7 + 1e-6)                                 = 0.3333333
  # The estimator itself: group_advantages calls a spread of 1e-6 constant (EFFECTIVE_TOL) and
  # gives it 0, which the next test checks.
  a = make_estimator("grpo")(jnp.array([[0.0, 1e-6], [1e-6, 0.0]]))
  np.testing.assert_allclose(a, [[-0.2928932, 0.2928932], [0.2928932, -0.2928932]], rtol=1e-4)


@pytest.mark.parametrize("g", [2, 3, 5, 8])
def test_estimators_match_float64_references_on_fixed_random_groups(g):
  """grpo / drgrpo / rloo against numpy float64 on a fixed random set, G = 2 included.
  Mutations: ddof = 0 in grpo; a wrong mean (e.g. over the batch axis) in drgrpo; g instead
  of g - 1 in rloo's leave-one-out mean."""
  rng = np.random.RandomState(g)
  r = rng.rand(6, g)
  np.testing.assert_allclose(group_advantages(jnp.asarray(r), "grpo"), _grpo_ref(r),
                             rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(group_advantages(jnp.asarray(r), "drgrpo"),
                             r - r.mean(-1, keepdims=True), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(group_advantages(jnp.asarray(r), "rloo"), _rloo_ref(r),
                             rtol=1e-5, atol=1e-6)


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(st.integers(1, 4).flatmap(lambda b: st.integers(2, 8).flatmap(
    lambda g: st.lists(st.lists(st.integers(-8, 8), min_size=g, max_size=g),
                       min_size=b, max_size=b))))
def test_grpo_matches_float64_reference_property(quarters):
  """Random groups of multiples of 0.25 (exact in float32). Mutations: ddof = 0; eps outside
  the denominator; NaN on constant groups. Constant groups are only checked for finiteness
  here; their exact zero is test_grpo_constant_groups_are_exactly_zero's job."""
  r = np.asarray(quarters, np.float64) * 0.25
  a = np.asarray(group_advantages(jnp.asarray(r, jnp.float32), "grpo"))
  assert np.all(np.isfinite(a))
  varying = r.max(-1) > r.min(-1)
  np.testing.assert_allclose(a[varying], _grpo_ref(r)[varying], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("g", [3, 7, 8, 16])
@pytest.mark.parametrize("value", [0.1, 0.7, 1.75, 1.0])
def test_grpo_constant_groups_are_exactly_zero(g, value):
  """A constant group has r - mean = 0, so (r - mean) / (0 + 1e-6) = 0 for every member.
  Defect this catches (present today): the float32 mean of G equal values can be one ulp off
  (e.g. 0.7 * 8 / 8 -> 0.7 - 6e-8), and 1 / eps = 1e6 amplifies that to advantages of 0.06
  (G = 8, 0.7) or -0.11 (G = 7, 1.75) for a group that carries no signal."""
  a = np.asarray(group_advantages(jnp.full((1, g), value, jnp.float32), "grpo"))
  np.testing.assert_allclose(a, 0.0, atol=1e-4)


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
  assert set(ESTIMATORS.names()) == {"grpo", "drgrpo", "rloo"}
  with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; known: drgrpo, grpo, rloo"):
    group_advantages(R, "ppo")
  with pytest.raises(ValueError, match="group size must be >= 2"):
    group_advantages(R[:, :1], "grpo")


def test_effective_groups():
  success = jnp.array([[True, True], [False, False], [True, False]])
  np.testing.assert_array_equal(effective_groups(success), [False, False, True])
  # Continuous scores: a 1e-9 spread is constant under the tolerance, 0.1 vs 0 is not.
  scores = jnp.array([[0.1, 0.1 + 1e-9], [0.0, 0.1]])
  np.testing.assert_array_equal(effective_groups(scores), [False, True])


def test_effective_groups_uses_the_tolerance():
  """0 vs 1e-7 (distinct in float32, unlike 0.1 vs 0.1 + 1e-9) is constant under tol = 1e-6;
  0 vs 0.1 is effective. Mutation: exact comparison (max != min) marks the first effective;
  a tolerance >= 0.1 marks the second constant."""
  # spreads: 1e-7 - 0 = 1e-7 <= 1e-6 -> False; 0.1 - 0 = 0.1 > 1e-6 -> True;
  # 0.3 - 0.3 = 0 -> False.
  scores = jnp.array([[0.0, 1e-7, 0.0], [0.0, 0.1, 0.05], [0.3, 0.3, 0.3]])
  assert float(scores[0, 1]) != 0.0
  np.testing.assert_array_equal(effective_groups(scores), [False, True, False])
  # An explicit tolerance above the 0.1 spread makes the second group constant too.
  np.testing.assert_array_equal(effective_groups(scores, tol=0.2), [False, False, False])


def test_one_definition_of_effective_on_host_and_device():
  """Scores 0 and 1e-9 (distinct in float32) are one constant group on the device (the train
  step's mask), on the host (the allocators' ``rounds.is_effective``) and in the advantages (all
  0); a 0.1 spread is effective everywhere. Mutation: the host's old exact comparison
  (``values != values[0]``) calls the first group effective."""
  from grpo_jax.allocation import rounds  # pylint: disable=g-import-not-at-top
  scores = np.array([[0.0, 1e-9, 0.0, 1e-9], [0.0, 0.1, 0.0, 0.0]], np.float32)
  assert scores[0, 1] != scores[0, 0]
  device = np.asarray(jax.jit(effective_groups)(jnp.asarray(scores)))
  from grpo_jax.types import Rollout  # pylint: disable=g-import-not-at-top
  host = [rounds.is_effective(rounds.Rows(rollout=Rollout(
      prompt_ids=np.zeros((4, 1), np.int32), prompt_mask=np.ones((4, 1), bool),
      completion_ids=np.zeros((4, 1), np.int32), completion_mask=np.ones((4, 1), bool),
      behaviour_logp=np.zeros((4, 1), np.float32), truncated=np.zeros(4, bool), scores=row,
      success=row >= 1.0, prompt_id=np.full(4, -1, np.int32), version=np.zeros((4, 1), np.int32)),
      errors=np.zeros(4, bool), texts=[""] * 4), "score") for row in scores]
  assert device.tolist() == host == [False, True]
  assert effective_groups(scores).tolist() == [False, True]  # numpy in, numpy out
  adv = np.asarray(group_advantages(jnp.asarray(scores), "grpo"))
  # Group 0 is constant: 0 everywhere (with exact equality it would be (1e-9 - 5e-10) /
  # (5.8e-10 + 1e-6) ~ 5e-4 per row). Group 1: mean 0.025, unbiased std 0.05 -> 1.5 / -0.5.
  np.testing.assert_array_equal(adv[0], 0.0)
  np.testing.assert_allclose(adv[1], [-0.5, 1.5, -0.5, -0.5], rtol=1e-4)
