"""pi_prox of replayed rows: the gathered pass (only the chunks holding replayed rows run, values
scattered to their rows) and AReaL's interpolation (alpha by hand, the update fractions, the
step's first update equal to the exact pass)."""

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

from configs import headroom as headroom_config, popo as popo_config
from grpo_jax import configuration
from grpo_jax.rl import losses, off_policy_prox as prox, policy, step as step_lib, update
from grpo_jax.rl.batch import Tokens, UpdateBatch
from grpo_jax.rl.replay import popo
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout
from tests.rl.test_popo import ALL_EFFECTIVE, ONE_INEFFECTIVE, _buffer_with
from tests.rl.test_step import G, _copy, _rollout


def _rows(n, t=3):
  """n rows whose completion ids are 10 * row + position, log mu = -ids / 100."""
  ids = (10 * jnp.arange(n)[:, None] + jnp.arange(t)[None]).astype(jnp.int32)
  z = jnp.zeros((n,), jnp.int32)
  return Rollout(prompt_ids=jnp.zeros((n, 1), jnp.int32), prompt_mask=jnp.ones((n, 1), bool),
                 completion_ids=ids, completion_mask=jnp.ones((n, t), bool),
                 behaviour_logp=-ids / 100.0, truncated=z.astype(bool), scores=z * 0.0,
                 success=z.astype(bool), prompt_id=z, version=jnp.zeros((n, t), jnp.int32))


def _fake_pass(rows):
  """A row-wise stand-in for the model: log-prob = ids / 2 - 100 (exact in float32, whether XLA
  divides or multiplies by the reciprocal)."""
  return rows.completion_ids * 0.5 - 100.0


def test_gathered_pass_runs_only_the_chunks_with_replayed_rows():
  # 8 rows in groups of 2; rows 6, 7 (group 3) and 2, 3 (group 1) replayed. The bound is 3
  # groups in replayed-first order [3, 1, 0]; 3 chunks of one group each: chunks 0 and 1 run,
  # chunk 2 (group 0, nothing replayed) is skipped, so rows 0, 1 keep log mu like every row
  # outside the bound (4, 5).
  rows = _rows(8)
  replayed = jnp.asarray([0, 0, 1, 1, 0, 0, 1, 1], bool)
  bound = jnp.asarray([6, 7, 2, 3, 0, 1], jnp.int32)
  out = jax.jit(prox.gathered, static_argnums=(3, 4, 5))(rows, replayed, bound, _fake_pass, 3, 2)
  passed = np.asarray(_fake_pass(rows))
  want = np.asarray(rows.behaviour_logp).copy()
  want[[2, 3, 6, 7]] = passed[[2, 3, 6, 7]]
  np.testing.assert_array_equal(out, want)
  # One chunk of all three groups: it holds a replayed row, so it runs over rows 0, 1 too (their
  # values are read nowhere: fresh rows' pi_prox is mu).
  one = prox.gathered(rows, replayed, bound, _fake_pass, 1, 2)
  want[[0, 1]] = passed[[0, 1]]
  np.testing.assert_array_equal(one, want)


def test_gathered_pass_pads_a_bound_that_does_not_divide_into_chunks():
  # A tail of 3 single rows (rows 5, 6, 7 of 8; 5 and 7 replayed; 3 is no multiple of G = 4,
  # so the unit is a row) in 2 chunks of 2: [5, 7] runs, [6, padding] has no replayed row and
  # is skipped, so row 6 keeps log mu; the padding reads a copy of row 7 and writes nowhere.
  rows = _rows(8)
  replayed = jnp.asarray([0, 0, 0, 0, 0, 1, 0, 1], bool)
  out = prox.gathered(rows, replayed, jnp.asarray([5, 7, 6], jnp.int32), _fake_pass, 2, 4)
  want = np.asarray(rows.behaviour_logp).copy()
  want[[5, 7]] = np.asarray(_fake_pass(rows))[[5, 7]]
  np.testing.assert_array_equal(out, want)
  # With both chunks holding a replayed row (row 6 replayed too) every row of the bound runs.
  out = prox.gathered(rows, replayed.at[6].set(True), jnp.asarray([5, 7, 6], jnp.int32),
                      _fake_pass, 2, 4)
  want[6] = np.asarray(_fake_pass(rows))[6]
  np.testing.assert_array_equal(out, want)


def _fake_count(rows):
  """(real tokens, positions computed) of a pass over ``rows``: every mask entry, 4 a row."""
  real = jnp.sum(rows.prompt_mask) + jnp.sum(rows.completion_mask)
  return real.astype(jnp.float32), jnp.float32(4 * rows.num_rows)


def test_gathered_pass_counts_the_chunks_that_ran():
  # As in the test above: [5, 7] runs, [6, padding] is skipped: 2 rows x (1 + 3) = 8 real tokens
  # over 2 x 4 = 8 positions. With row 6 replayed both run: rows 5, 7, 6 are 12 real tokens;
  # the padding row (a copy of row 7) is computed, 16 positions, but counts no real token.
  rows = _rows(8)
  replayed = jnp.asarray([0, 0, 0, 0, 0, 1, 0, 1], bool)
  bound = jnp.asarray([5, 7, 6], jnp.int32)
  out, real, computed = prox.gathered(rows, replayed, bound, _fake_pass, 2, 4, _fake_count)
  np.testing.assert_array_equal(out, prox.gathered(rows, replayed, bound, _fake_pass, 2, 4))
  assert (float(real), float(computed)) == (8.0, 8.0)
  _, real, computed = prox.gathered(rows, replayed.at[6].set(True), bound, _fake_pass, 2, 4,
                                    _fake_count)
  assert (float(real), float(computed)) == (12.0, 16.0)


def test_gathered_pass_of_the_model_equals_the_whole_batch_pass(split):
  # POPO's bound on B = 2 groups with group 1 refilled: [group 1, group 0] in 2 chunks. The
  # model's log-probs of group 1 from the pass over its 4 rows equal those from the pass over
  # all 8 rows up to float32 rounding (a matmul of other size may sum in another order).
  graphdef, params = split
  rollout = _rollout(split, ONE_INEFFECTIVE)
  config = StepConfig(num_minibatches=1, group_size=G)
  logp_fn = lambda rows: policy.logprobs(graphdef, params, Tokens.of(rows), config)[0]
  replayed = jnp.repeat(jnp.asarray([False, True]), G)
  bound = jnp.concatenate([jnp.arange(G, 2 * G), jnp.arange(G)]).astype(jnp.int32)
  out = np.asarray(prox.gathered(rollout, replayed, bound, logp_fn, 2, G))
  whole = np.asarray(logp_fn(rollout))
  mask = np.asarray(rollout.completion_mask)
  np.testing.assert_allclose(out[G:] * mask[G:], whole[G:] * mask[G:], atol=2e-6)
  np.testing.assert_array_equal(out[:G], np.asarray(rollout.behaviour_logp[:G]))


def test_interpolated_prox_by_hand():
  # alpha = age / (age + u / U):
  #   fresh row (age 0): pi_prox = mu = -1;
  #   age 2 at u / U = 0.5: alpha = 2 / 2.5 = 0.8, -1 + 0.8 * (-2 - -1) = -1.8;
  #   age 1 at u / U = 0.5: alpha = 1 / 1.5 = 2/3, -1 + (2/3) * (-1) = -1.6667;
  # in the step's first update (u = 0) alpha = 1: pi_prox = pi_theta = -2.
  mu = jnp.full((3, 2), -1.0)
  theta = jnp.full((3, 2), -2.0)
  age = jnp.asarray([[0.0], [2.0], [1.0]])  # per token: [U, 1] broadcasts over T
  np.testing.assert_allclose(prox.interpolated(mu, theta, age, jnp.float32(0.5)),
                             [[-1, -1], [-1.8, -1.8], [-5 / 3, -5 / 3]], rtol=1e-6)
  np.testing.assert_array_equal(prox.interpolated(mu, theta, age, jnp.float32(0.0)),
                                [[-1, -1], [-2, -2], [-2, -2]])
  # No gradient flows through the estimate.
  grad = jax.grad(lambda t: jnp.sum(prox.interpolated(mu, t, age, jnp.float32(0.5))))(theta)
  np.testing.assert_array_equal(grad, 0.0)


def test_each_update_of_the_step_reads_its_fraction_of_the_updates():
  # E = 2 epochs of M = 4 minibatches: epoch 1's updates are the step's 4th..7th of 8, so they
  # read u / U = 4/8, 5/8, 6/8, 7/8.
  config = StepConfig(group_size=1, num_minibatches=4, num_epochs=2, shuffle="rows")
  z = jnp.zeros((8, 3))
  tokens = Tokens(prompt_ids=jnp.zeros((8, 1), jnp.int32), prompt_mask=jnp.ones((8, 1), bool),
                  completion_ids=jnp.zeros((8, 3), jnp.int32))
  batch = UpdateBatch(tokens=tokens, loss_mask=z > 0, advantages=z[:, 0], behaviour_logp=z,
                      prox_logp=z)
  record = lambda carry, xs: (carry, xs[1])  # an "update" that returns its fraction
  _, fractions = update._epoch(record, config, batch, 0, (jax.random.key(0), jnp.int32(1)))
  np.testing.assert_array_equal(fractions, [0.5, 0.625, 0.75, 0.875])


def _popo_step(split, rollout, replay, state_step, tx=None, **step_kw):
  graphdef, params = split
  tx = optax.adam(1e-2) if tx is None else tx
  config = StepConfig(num_minibatches=1, group_size=G, replay=popo.Popo(fill="replay", max_uses=1),
                               loss=losses.LossConfig(is_cap=2.0), **step_kw)
  fn = step_lib.make_train_step(graphdef, tx, config)
  state = step_lib.init_train_state(_copy(params), tx).replace(step=jnp.int32(state_step))
  return fn(state, replay, rollout, None, jax.random.key(0))


def test_interpolation_in_the_only_update_of_a_step_is_the_exact_pass(split):
  # One minibatch, one epoch: the update is the step's first (u = 0), alpha = 1 and the
  # interpolated pi_prox is pi_theta itself, the exact pass's value. The stored group is 3
  # steps old with log mu 0.5 below the policy's: w = pi_prox / mu = e^0.5 = 1.6487 on its
  # tokens in both (with the age lost, alpha = 0 would make pi_prox = mu and w = 1).
  rollout = _rollout(split, ONE_INEFFECTIVE)
  runs = {}
  for estimate in ("exact", "interpolate"):
    replay, _ = _buffer_with(split, ALL_EFFECTIVE, version=0, shift=-0.5)
    # SGD: the parameter change is lr * gradient, so comparing parameters compares gradients
    # (Adam's first step, lr * g / (|g| + eps), turns rounding-level differences of near-zero
    # gradient entries into lr-sized ones: seen once, 1.2e-5 on one of 8,192 entries).
    runs[estimate] = _popo_step(split, rollout, replay, 3, tx=optax.sgd(1.0),
                                prox_estimate=estimate, prox_chunks=2)
  (exact_state, _, exact_m), (interp_state, _, interp_m) = runs["exact"], runs["interpolate"]
  assert float(interp_m["replay_slots_filled"]) == 1.0
  assert float(interp_m["replay_is_weight_mean"]) == pytest.approx(np.exp(0.5), rel=1e-4)
  assert float(interp_m["loss"]) == pytest.approx(float(exact_m["loss"]), rel=1e-5)
  moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(split[1]),
                                                          jax.tree.leaves(exact_state.params)))
  assert moved > 0.1  # the step moved the parameters (measured: 0.30)...
  for a, b in zip(jax.tree.leaves(exact_state.params), jax.tree.leaves(interp_state.params)):
    # ...and both by the same gradient (measured: 1.2e-7 apart, 1 ulp of values near 1).
    np.testing.assert_allclose(a, b, atol=1e-5 * moved)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(groups=st.integers(1, 5), g=st.integers(1, 3), chunks=st.integers(1, 9),
                  data=st.data())
def test_gathered_pass_against_a_python_model(groups, g, chunks, data):
  """Any chunk count (capped at the groups of the bound): a row gets the pass's value iff its
  chunk holds a replayed row, and log mu otherwise; rows outside the bound always keep log mu."""
  n = 6 * g  # 6 groups in the batch, the bound ``groups`` of them
  order = data.draw(st.permutations(range(6)))[:groups]
  replayed_groups = data.draw(st.sets(st.sampled_from(order)))
  bound_groups = sorted(order, key=lambda q: q not in replayed_groups)  # replayed first
  bound = [q * g + j for q in bound_groups for j in range(g)]
  replayed = np.zeros(n, bool)
  for q in replayed_groups:
    replayed[q * g:(q + 1) * g] = True
  rows = _rows(n)
  out = np.asarray(prox.gathered(rows, jnp.asarray(replayed), jnp.asarray(bound, jnp.int32),
                                 _fake_pass, chunks, g))
  k = min(chunks, groups)
  per = -(-groups // k) * g  # rows per chunk
  want = np.asarray(rows.behaviour_logp).copy()
  for c in range(k):
    part = bound[c * per:(c + 1) * per]
    if any(replayed[r] for r in part):
      want[part] = np.asarray(_fake_pass(rows))[part]
  np.testing.assert_array_equal(out, want)


def test_the_config_keys_refuse_what_cannot_run():
  c = popo_config.get_config("smoke")
  c.prox.estimate = "approximate"
  with pytest.raises(configuration.ConfigError, match="prox.estimate.*exact, interpolate"):
    configuration.validate(c)
  c = popo_config.get_config("smoke,bf16,prox=interpolate")  # prox.rows auto -> "all"
  with pytest.raises(configuration.ConfigError, match="prox.estimate.*resolves to 'all'"):
    configuration.validate(c)
  for bad in (-1, True):  # (a float is refused by the ConfigDict itself)
    c = popo_config.get_config("smoke")
    c.prox.chunks = bad
    with pytest.raises(configuration.ConfigError, match="prox.chunks"):
      configuration.validate(c)
  c = headroom_config.get_config("smoke,walk=3")  # 16 candidates in 3 chunks
  with pytest.raises(configuration.ConfigError, match="candidate_chunks must be >= 1 and divide"):
    configuration.validate(c)
  for ok in ("smoke,prox=interpolate", "smoke,prox_chunks=0", "smoke,prox_chunks=7"):
    c = popo_config.get_config(ok)
    configuration.validate(c)
    step = configuration.step_config(c)
    assert (step.prox_estimate, step.prox_chunks) == (c.prox.estimate, c.prox.chunks)
