"""The registered policy losses (grpo_jax/rl/policy_losses) against verl's implementations of the
same formulas, and how each combines with the shared wrapper's behaviour weight.

Golden values: tests/data/verl_policy_losses.json, computed once in float64 with verl 0.9.1's
``core_algos.get_policy_loss_fn`` ("gspo", "cispo", "vanilla") by
tests/data/make_verl_policy_losses.py (verl is not a test dependency). Each case holds the
inputs (3 rows x 4 tokens; the masked tokens carry large log-ratios, so a leak would show), verl's
loss, its metrics and d loss / d log_prob. Here the same inputs go through our loss in float32.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import losses
from grpo_jax.rl.policy_losses import POLICY_LOSSES, cispo, gspo, ppo

GOLDEN = json.load(open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                     "data", "verl_policy_losses.json")))["cases"]
# verl's names -> ours; vanilla is PPO with verl's dual clip c (clip_ratio_c).
NAMES = {"gspo": "gspo", "cispo": "cispo", "vanilla": "ppo"}


def _ours(case):
  cfg = case["config"]
  name = NAMES[case["policy_loss_mode"]]
  kw = dict(clip_low=cfg["clip_ratio_low"], clip_high=cfg["clip_ratio_high"])
  if name == "ppo":
    kw["dual_clip"] = cfg["clip_ratio_c"]
  return POLICY_LOSSES.get(name)(**kw), cfg["loss_agg_mode"]


def _inputs(case):
  x = case["inputs"]
  f32 = lambda v: jnp.asarray(v, jnp.float32)
  return (f32(x["log_prob"]), f32(x["old_log_prob"]), f32(x["advantages"]),
          jnp.asarray(x["response_mask"], bool))


@pytest.mark.parametrize("name", sorted(c for c in GOLDEN if "rollout_is" not in c))
def test_each_loss_equals_verls_value_metrics_and_gradient(name):
  case = GOLDEN[name]
  loss_fn, agg = _ours(case)
  logp, old, adv, mask = _inputs(case)

  def total(lp):
    pg, aux = loss_fn.per_token(lp, old, adv, mask)
    return losses.aggregate(pg, mask, agg), aux

  (value, aux), grad = jax.value_and_grad(total, has_aux=True)(logp)
  out = case["outputs"]
  np.testing.assert_allclose(value, out["loss"], rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(grad, out["grad_log_prob"], rtol=2e-5, atol=1e-6)
  # verl's pg_clipfrac counts the tokens whose clip binds (either side; PPO's dual clip apart):
  # ours splits them by side.
  np.testing.assert_allclose(aux["clip_frac_low"] + aux["clip_frac_high"],
                             out["metrics"]["actor/pg_clipfrac"], rtol=1e-6, atol=1e-6)
  if name == "vanilla_basic":  # verl's pg_clipfrac_lower is the dual clip's share
    np.testing.assert_allclose(aux["dual_clip_frac"], out["metrics"]["actor/pg_clipfrac_lower"],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["gspo_rollout_is_weights", "cispo_rollout_is_weights"])
def test_the_behaviour_weight_multiplies_each_token_as_verls_rollout_weights(name):
  """verl multiplies its per-token rollout IS weights into the loss before aggregation; ours is
  the behaviour weight w = pi_prox / mu (truncated at is_cap): with mu = pi_prox - log w, the
  weighted loss and its gradient are verl's (GSPO's advantages are one per row, so its case
  also goes through the whole wrapper, ``losses.policy_loss``)."""
  case = GOLDEN[name]
  loss_fn, agg = _ours(case)
  logp, old, adv, mask = _inputs(case)
  mu = old - jnp.log(jnp.asarray(case["inputs"]["rollout_is_weights"], jnp.float32))
  config = losses.LossConfig(policy=loss_fn, aggregation=agg, is_mode="truncate", is_cap=10.0)
  w, _ = losses.behaviour_weight(old, mu, config)

  def weighted(lp):
    return losses.aggregate(w * loss_fn.per_token(lp, old, adv, mask)[0], mask, agg)

  def wrapper(lp):
    return losses.policy_loss(lp, old, mu, adv[:, 0], mask, config)[0]

  out = case["outputs"]
  for fn in (weighted, wrapper) if name.startswith("gspo") else (weighted,):
    value, grad = jax.value_and_grad(fn)(logp)
    np.testing.assert_allclose(value, out["loss"], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, out["grad_log_prob"], rtol=2e-5, atol=1e-6)


def test_gspo_clips_a_whole_row_by_its_geometric_mean_ratio():
  """Row 0: log-ratios 0.3, -0.1 (mean 0.1, s = e^0.1 = 1.10517), A = +1, clip 0.2 / 0.05:
  s > 1.05, so every token of the row is clipped (loss -1.05 each, gradient 0), though the
  second token's own ratio (e^-0.1 = 0.905) is inside the range. Row 1: log-ratios 0.02, 0.0,
  -0.02 (s = 1), A = -1, unclipped: loss s = 1 per token, gradient -A s / 3 = 1/3 under
  seq-mean-token-mean (the mean over its 3 tokens), halved by the mean over the 2 rows."""
  loss_fn = gspo.Gspo(clip_low=0.2, clip_high=0.05)
  logp = jnp.array([[0.3, -0.1, 0.0], [0.02, 0.0, -0.02]]) - 1.0
  prox = jnp.full((2, 3), -1.0)
  mask = jnp.array([[True, True, False], [True, True, True]])
  adv = jnp.array([[1.0], [-1.0]])
  pg, aux = loss_fn.per_token(logp, prox, adv, mask)
  np.testing.assert_allclose(pg[0, :2], [-1.05, -1.05], rtol=1e-6)
  np.testing.assert_allclose(pg[1], [1.0, 1.0, 1.0], rtol=1e-6)
  grad = jax.grad(lambda lp: losses.aggregate(loss_fn.per_token(lp, prox, adv, mask)[0], mask,
                                              "seq-mean-token-mean"))(logp)
  np.testing.assert_allclose(grad, [[0, 0, 0], [1 / 6, 1 / 6, 1 / 6]], atol=1e-6)
  # Tokens: 2 of row 0 clipped high (A > 0), none low; 2 + 3 = 5 tokens.
  np.testing.assert_allclose([aux["clip_frac_high"], aux["clip_frac_low"]], [2 / 5, 0.0],
                             atol=1e-7)


def test_cispo_keeps_the_gradient_of_a_clipped_token():
  """r = e^1 = 2.718 > 1 + 0.28 and A = +2: PPO's clip zeroes this token's gradient, CISPO's
  weight is capped at 1.28 and the gradient is -1.28 * 2 = -2.56 (token-mean of one token)."""
  logp, prox = jnp.array([[0.0]]), jnp.array([[-1.0]])
  adv, mask = jnp.array([[2.0]]), jnp.array([[True]])
  grad = lambda loss_fn: jax.grad(lambda lp: losses.aggregate(
      loss_fn.per_token(lp, prox, adv, mask)[0], mask, "token-mean"))(logp)
  np.testing.assert_allclose(grad(cispo.Cispo(clip_low=0.2, clip_high=0.28)), [[-2.56]],
                             rtol=1e-6)
  np.testing.assert_allclose(grad(ppo.Ppo(clip_low=0.2, clip_high=0.28)), [[0.0]])


def test_each_loss_is_its_own_config_group_and_refuses_bad_values_in_one_line():
  assert set(POLICY_LOSSES.names()) >= {"ppo", "gspo", "cispo"}
  assert dict(POLICY_LOSSES.get("gspo").config_group()) == {"clip_low": 3e-4, "clip_high": 4e-4}
  for cls, bad in ((ppo.Ppo, dict(dual_clip=0.5)), (ppo.Ppo, dict(clip_low=1.0)),
                   (gspo.Gspo, dict(clip_high=-1.0)), (cispo.Cispo, dict(clip_low=1.5))):
    with pytest.raises(ValueError) as e:
      cls(**bad)
    assert "\n" not in str(e.value) and next(iter(bad)) in str(e.value)
