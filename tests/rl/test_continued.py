"""Continued rows (partial rollouts) in the train step: the rows holding tokens drawn by
earlier parameters are off-policy, and the objective corrects them as it does replayed rows
(``StepConfig.continued``); ``correction=naive`` leaves them to the clipped pi_theta / mu."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.rl import losses, off_policy_prox as prox, prox_plan, step as step_lib
from grpo_jax.rl.replay import headroom, init_replay, popo
from grpo_jax.rl.replay import method as replay_method
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout
from tests.rl.test_step import G, MIXED, P, T, _copy, _rollout

STEP = 3
# Group 1 (rows 4..7) was admitted two updates ago and continued: its tokens 0..2 carry
# version 1, the rest version 3 (this step's). Group 0 is fresh.
STALE_TOKENS = 3
SHIFT = 0.5  # the stale tokens' log mu sit 0.5 below the start-of-step policy's


def _continued_rollout(split):
  """MIXED rows with group 1 continued: log mu of its stale tokens shifted by -SHIFT (the
  earlier parameters drew them with lower probability than the current ones give)."""
  rollout = _rollout(split, MIXED)
  n = rollout.num_rows
  stale = np.zeros((n, T), bool)
  stale[G:, :STALE_TOKENS] = True
  stale &= np.asarray(rollout.completion_mask)
  version = np.where(stale, STEP - 2, STEP).astype(np.int32)
  mu = np.asarray(rollout.behaviour_logp) - SHIFT * stale
  return rollout.replace(version=jnp.asarray(version), behaviour_logp=jnp.asarray(mu)), stale


def _step(split, rollout, **kw):
  graphdef, params = split
  tx = optax.sgd(1.0)  # parameters move by the gradient itself: comparing them compares it
  config = StepConfig(num_minibatches=1,
                      group_size=G, loss=losses.LossConfig(is_cap=2.0), prox_chunks=2, **kw)
  fn = step_lib.make_train_step(graphdef, tx, config)
  state = step_lib.init_train_state(_copy(params), tx).replace(step=jnp.int32(STEP))
  return fn(state, init_replay(0, G, P, T), rollout, None, jax.random.key(0))


@pytest.fixture(scope="module")
def runs(split):
  rollout, stale = _continued_rollout(split)
  assert stale[G:].any() and not stale[:G].any()
  return {
      "exact": _step(split, rollout, continued=True),
      "interpolate": _step(split, rollout, continued=True, prox_estimate="interpolate"),
      "all": _step(split, rollout, prox_pass="all"),
      "naive": _step(split, rollout),
  }


def test_continued_rows_by_their_tokens_versions():
  # Row 0: every real token of version 3 (fresh); row 1: token 1 of version 2 (continued);
  # row 2: a version-1 value only past its end (padding, not a token): fresh.
  version = jnp.asarray([[3, 3, 3], [3, 2, 3], [3, 3, 1]], jnp.int32)
  mask = jnp.asarray([[1, 1, 1], [1, 1, 1], [1, 1, 0]], bool)
  z = jnp.zeros((3,), jnp.int32)
  rows = Rollout(prompt_ids=z[:, None], prompt_mask=mask[:, :1], completion_ids=version,
                 completion_mask=mask, behaviour_logp=version * 0.0, truncated=z > 0,
                 scores=z * 0.0, success=z > 0, prompt_id=z, version=version)
  np.testing.assert_array_equal(prox.continued_rows(rows, jnp.int32(3)), [False, True, False])


def test_off_policy_rows_first_in_whole_groups():
  # 4 groups of 2: groups 1 and 3 hold an off-policy row (rows 3 and 6) -> groups [1, 3, 0, 2].
  need = jnp.asarray([0, 0, 0, 1, 0, 0, 1, 0], bool)
  np.testing.assert_array_equal(prox.off_policy_first(need, 2), [2, 3, 6, 7, 0, 1, 4, 5])
  # 7 rows are no multiple of G = 2: single rows, off-policy first, in order.
  np.testing.assert_array_equal(prox.off_policy_first(need[:7], 2), [3, 6, 0, 1, 2, 4, 5])


def test_interpolated_prox_per_token():
  # Row 0 fresh; row 1 continued: token 0 drawn 2 updates ago, token 1 this step's.
  # u / U = 0.5: alpha = 2 / 2.5 = 0.8 on token (1, 0): -1 + 0.8 * (-2 - -1) = -1.8; alpha = 0
  # on the age-0 tokens: pi_prox = mu = -1.
  mu, theta = jnp.full((2, 2), -1.0), jnp.full((2, 2), -2.0)
  age = jnp.asarray([[0.0, 0.0], [2.0, 0.0]])
  np.testing.assert_allclose(prox.interpolated(mu, theta, age, jnp.float32(0.5)),
                             [[-1, -1], [-1.8, -1]], rtol=1e-6)


def test_the_decoupled_correction_reaches_continued_rows(runs):
  # Exact: pi_prox of group 1 from the pass (group 0's chunk skipped: its pi_prox is mu), so the
  # stale tokens carry w = pi_prox / mu = e^0.5 = 1.6487 (under the cap 2) and the others 1.
  (_, _, exact), (_, _, naive) = runs["exact"], runs["naive"]
  assert float(exact["is_weight_max"]) == pytest.approx(np.exp(SHIFT), rel=1e-4)
  assert float(exact["continued_rows"]) == G
  # Naive: pi_prox = mu on every row, w = 1, the stale tokens' ratio pi_theta / mu.
  assert float(naive["is_weight_max"]) == pytest.approx(1.0, abs=1e-6)
  assert "continued_rows" not in naive
  assert abs(float(exact["loss"]) - float(naive["loss"])) > 1e-3


def test_exact_pass_over_continued_rows_equals_the_pass_over_every_row(runs):
  # prox_pass=all computes pi_prox of every row, so fresh tokens get pi_prox = pass ~ mu: the
  # same loss and gradient as the pass over the continued rows only, up to float32 rounding.
  (exact_state, _, exact), (all_state, _, every) = runs["exact"], runs["all"]
  assert float(exact["loss"]) == pytest.approx(float(every["loss"]), rel=1e-5, abs=1e-7)
  for a, b in zip(jax.tree.leaves(exact_state.params), jax.tree.leaves(all_state.params)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_interpolated_continued_rows_in_the_steps_only_update_equal_the_exact_pass(runs, split):
  # One update: alpha = 1 on the stale tokens (pi_prox = pi_theta, the pass's value) and 0 on
  # this step's tokens (pi_prox = mu, the pass's value up to rounding): the same gradient.
  (exact_state, _, exact), (interp_state, _, interp) = runs["exact"], runs["interpolate"]
  assert float(interp["is_weight_max"]) == pytest.approx(np.exp(SHIFT), rel=1e-4)
  assert float(interp["loss"]) == pytest.approx(float(exact["loss"]), rel=1e-5)
  moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(split[1]),
                                                          jax.tree.leaves(exact_state.params)))
  assert moved > 1e-3
  for a, b in zip(jax.tree.leaves(exact_state.params), jax.tree.leaves(interp_state.params)):
    np.testing.assert_allclose(a, b, atol=1e-5 * moved)


def test_interpolation_ages_each_token_from_its_own_version(split):
  # Group 1's stale tokens are 3 - 1 = 2 updates old; its tokens of this step and group 0's
  # are 0 (pi_prox = mu on them); a per-row age (from the row's oldest token) would give 2 to
  # every real token of group 1.
  rollout, stale = _continued_rollout(split)
  config = StepConfig(num_minibatches=1, group_size=G, continued=True, prox_estimate="interpolate")
  ctx = step_lib._context(config, rollout, jnp.int32(STEP), jax.random.key(0))
  comp = config.replay.compose(ctx, None, None)
  off = step_lib._off_policy_rows(config, comp, jnp.int32(STEP))
  plan = prox_plan.plan(config, False, measured=False, bounded=False)
  assert plan.interpolate and plan.rows == "none"
  batch = step_lib._update_batch(split[0], plan, config, comp, off, None, None,
                                 jnp.int32(STEP))
  np.testing.assert_array_equal(batch.age, np.where(stale, 2.0, 0.0))
  np.testing.assert_array_equal(batch.behaviour_logp, rollout.behaviour_logp)  # mu, for now


# Methods that measure pi_prox of their replay candidates themselves (``Composition.prox_logp``:
# POPO-KL's divergence pass, Headroom's candidate pass with the decoupled objective), each with
# an empty buffer of 2 entries so that the method replays (and makes its own pass); POPO's
# recency priority makes none and is the control.
MEASURING = {
    "popo_recency": popo.Popo(priority="recency"),
    "popo_lowest_kl": popo.Popo(priority="lowest_kl"),
    "headroom_decoupled": headroom.HeadroomDrift(slots=1, candidates=2, objective="decoupled"),
}


def _log_weights(split, rollout, method):
  """[N, T] log w = log pi_prox' - log mu' of the UpdateBatch the train step builds (its own
  stages: compose, the off-policy rows, the pi_prox pass, the batch), and the continued rows it
  counts; forward passes only (no update is compiled)."""
  graphdef, params = split
  config = StepConfig(num_minibatches=1, group_size=G, continued=True, prox_chunks=2, replay=method)
  step = jnp.int32(STEP)

  @jax.jit
  def run(params, rollout):
    replay = init_replay(2, G, P, T)
    replaying = config.replay.replays(replay)
    start_pass = replay_method.PolicyPass(
        functools.partial(step_lib._start_logp, graphdef, params, config),  # pylint: disable=W0212
        functools.partial(step_lib._start_count, config))  # pylint: disable=protected-access
    ctx = step_lib._context(config, rollout, step, jax.random.key(0))  # pylint: disable=W0212
    _, comp, _ = step_lib._compose(config, ctx, replay, start_pass, replaying)  # pylint: disable=W0212
    off = step_lib._off_policy_rows(config, comp, step)  # pylint: disable=protected-access
    plan = prox_plan.plan(config, replaying, measured=comp.prox_logp is not None,
                          bounded=comp.prox_rows is not None)
    full, _ = prox_plan.proximal_pass(plan, comp, off, start_pass, G)
    batch = step_lib._update_batch(graphdef, plan, config, comp, off, full, None, step)  # pylint: disable=W0212
    used = step_lib._continued_metrics(config, comp, off)["continued_rows"]  # pylint: disable=W0212
    return batch.prox_logp - batch.behaviour_logp, used

  return run(params, rollout)


@pytest.mark.parametrize("name", sorted(MEASURING))
def test_continued_rows_get_the_pass_when_the_method_measures_its_own_candidates(split, name):
  # The same continued rows as above, now beside a replay method. Nothing is replayed (the
  # buffer is empty), so every continued row's pi_prox must come from the step's pass: its
  # stale tokens carry log w = log pi_prox - log mu = 0.5 (w = e^0.5), the others 0 (up to the
  # pass's rounding against the sampler's mu). A method's own pi_prox array holds mu on the
  # rows it did not replay; taking it for the continued rows gives them log w = 0, the naive
  # correction (the defect this guards: is_weight_max 1.0 for POPO-KL and Headroom).
  rollout, stale = _continued_rollout(split)
  log_w, continued = _log_weights(split, rollout, MEASURING[name])
  assert float(continued) == G
  log_w = np.asarray(log_w)[:rollout.num_rows]  # the fresh rows (Headroom appends its slots)
  np.testing.assert_allclose(log_w[stale], SHIFT, atol=1e-4)
  np.testing.assert_allclose(log_w[~stale & np.asarray(rollout.completion_mask)], 0.0, atol=1e-4)
