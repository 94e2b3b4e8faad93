"""Policy loss: hand-worked cases and a float64 reference on random inputs."""

import hypothesis
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from grpo_jax.rl import replay_objectives
from grpo_jax.rl.losses import LossConfig, aggregate, kl_penalty, policy_loss
from grpo_jax.rl.policy_losses.ppo import Ppo
from grpo_jax.rl.replay import method as replay_method

LOG = np.log


def _cfg(clip_low=0.2, clip_high=0.2, dual_clip=0.0, **kw):
  """A LossConfig with the PPO term (its clip range and dual clip) and the shared switches."""
  return LossConfig(policy=Ppo(clip_low, clip_high, dual_clip), **kw)


def _one(logp, prox, beh, adv, **kw):
  """Loss and aux for a single token of a single sequence."""
  a = lambda x: jnp.array([[x]], jnp.float32)
  return policy_loss(a(logp), a(prox), a(beh), jnp.array([adv], jnp.float32),
                     jnp.ones((1, 1), bool), _cfg(**kw))


def test_fresh_data_has_behaviour_weight_exactly_one():
  rng = np.random.RandomState(0)
  logp = jnp.asarray(rng.randn(4, 5), jnp.float32)
  old = jnp.asarray(rng.randn(4, 5), jnp.float32)
  _, aux = policy_loss(logp, old, old, jnp.ones(4), jnp.ones((4, 5), bool), _cfg())
  assert float(aux["is_weight_mean"]) == 1.0 and float(aux["is_weight_max"]) == 1.0
  assert float(aux["is_capped_frac"]) == 0.0


def test_clip_high_positive_advantage():
  # A = 1, rho = 1.5, eps_high = 0.2: max(-1.5, -1.2) = -1.2; gradient through the clip is 0.
  loss, aux = _one(LOG(1.5), 0.0, 0.0, 1.0, clip_high=0.2)
  assert float(loss) == pytest.approx(-1.2, abs=1e-6)
  assert float(aux["clip_frac_high"]) == 1.0 and float(aux["clip_frac_low"]) == 0.0
  g = jax.grad(lambda lp: policy_loss(lp, jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.ones(1),
                                      jnp.ones((1, 1), bool), _cfg())[0])(
                                          jnp.full((1, 1), LOG(1.5), jnp.float32))
  assert float(g[0, 0]) == 0.0


def test_clip_higher_lets_the_ratio_go_further():
  # rho = 1.25: clipped at 1.2 with eps_high 0.2 (loss -1.2), not with 0.28 (loss -1.25).
  assert float(_one(LOG(1.25), 0.0, 0.0, 1.0, clip_high=0.2)[0]) == pytest.approx(-1.2, abs=1e-6)
  assert float(_one(LOG(1.25), 0.0, 0.0, 1.0, clip_high=0.28)[0]) == pytest.approx(-1.25, abs=1e-6)


def test_clip_low_negative_advantage():
  # A = -1, rho = 0.5, eps_low = 0.2: max(0.5, 0.8) = 0.8.
  loss, aux = _one(LOG(0.5), 0.0, 0.0, -1.0)
  assert float(loss) == pytest.approx(0.8, abs=1e-6)
  assert float(aux["clip_frac_low"]) == 1.0


def test_dual_clip_bounds_negative_advantage_loss():
  # A = -1, rho = 5: max(5, 1.2) = 5; dual clip c = 3 bounds it at -A c = 3.
  assert float(_one(LOG(5.0), 0.0, 0.0, -1.0)[0]) == pytest.approx(5.0, rel=1e-6)
  loss, aux = _one(LOG(5.0), 0.0, 0.0, -1.0, dual_clip=3.0)
  assert float(loss) == pytest.approx(3.0, rel=1e-6) and float(aux["dual_clip_frac"]) == 1.0


def test_behaviour_weight_truncate_and_mask():
  # prox / mu = 4 with cap 2; A = 1, rho = 1: pg = -1.
  # truncate: w = min(4, 2) = 2 -> loss -2; mask: w = 0 -> loss 0; none: w = 1 -> loss -1.
  for mode, expected in (("truncate", -2.0), ("mask", 0.0), ("none", -1.0)):
    loss, aux = _one(LOG(4.0), LOG(4.0), 0.0, 1.0, is_mode=mode, is_cap=2.0)
    assert float(loss) == pytest.approx(expected, abs=1e-5), mode
    assert float(aux["is_capped_frac"]) == 1.0
  # Under the cap the weight passes through: prox / mu = 1.5 -> loss -1.5.
  loss, _ = _one(LOG(1.5), LOG(1.5), 0.0, 1.0, is_mode="mask", is_cap=2.0)
  assert float(loss) == pytest.approx(-1.5, abs=1e-5)


def test_aggregations_by_hand():
  values = jnp.array([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0]], bool)
  # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
  assert float(aggregate(values, mask, "token-mean")) == pytest.approx(2.5)
  # seq-mean-token-mean: (6 / 3 + 4 / 1) / 2 = 3
  assert float(aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
  # seq-mean-token-sum-norm, constant 3 (= T): 10 / (2 * 3) = 1.6667; constant 5: 10 / 10 = 1
  assert float(aggregate(values, mask, "seq-mean-token-sum-norm")) == pytest.approx(10 / 6)
  assert float(aggregate(values, mask, "seq-mean-token-sum-norm", 5.0)) == pytest.approx(1.0)


def test_kl_estimators_by_hand():
  # log r = log pi_ref - log pi = log 2.
  logp, ref = jnp.array(0.0), jnp.array(LOG(2.0))
  assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(-LOG(2.0))
  assert float(kl_penalty(logp, ref, "k2")) == pytest.approx(0.5 * LOG(2.0) ** 2)  # 0.240227
  assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(1.0 - LOG(2.0))  # 0.306853


def test_all_masked_rows_zero_advantages_and_extreme_ratios_are_finite():
  logp = jnp.array([[80.0, -80.0], [0.0, 0.0]])
  prox = jnp.array([[-80.0, 80.0], [0.0, 0.0]])
  mask = jnp.array([[True, True], [False, False]])
  cfg = _cfg(kl_coef=0.1, dual_clip=3.0)
  for adv in (jnp.array([1.0, -1.0]), jnp.zeros(2)):
    loss, aux = policy_loss(logp, prox, prox - 200.0, adv, mask, cfg, ref_logp_NxT=prox)
    grads = jax.grad(lambda lp: policy_loss(lp, prox, prox, adv, mask, cfg,
                                            ref_logp_NxT=prox)[0])(logp)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grads)))
    assert all(np.isfinite(float(v)) for v in aux.values())
  # Zero advantages and no KL: the loss is exactly zero.
  loss, _ = policy_loss(logp, prox, prox, jnp.zeros(2), mask, _cfg())
  assert float(loss) == 0.0


def _np_aggregate(values, mask, mode, norm_constant=0.0):
  """float64 numpy aggregation: the sequence-level modes count only rows with a token."""
  m = mask.astype(np.float64)
  total = values * m
  tokens = m.sum(1)
  rows = int((tokens > 0).sum())
  if mode == "token-mean":
    return total.sum() / max(tokens.sum(), 1.0)
  if rows == 0:
    return 0.0
  if mode == "seq-mean-token-mean":
    return sum(total[i].sum() / tokens[i] for i in range(len(m)) if tokens[i] > 0) / rows
  assert mode == "seq-mean-token-sum-norm"
  norm = norm_constant if norm_constant > 0 else values.shape[-1]
  return total.sum() / (rows * norm)


def _reference(logp, prox, beh, adv, mask, cfg, ref=None):
  """float64 numpy transcription of the documented formula."""
  rho = np.exp(logp - prox)
  a = adv[:, None]
  pg = -np.minimum(rho * a, np.clip(rho, 1 - cfg.policy.clip_low, 1 + cfg.policy.clip_high) * a)
  if cfg.policy.dual_clip:
    pg = np.where(a < 0, np.minimum(pg, -a * cfg.policy.dual_clip), pg)
  raw_w = np.exp(prox - beh)
  if cfg.is_mode == "truncate":
    w = np.minimum(raw_w, cfg.is_cap)
  elif cfg.is_mode == "mask":
    w = np.where(raw_w <= cfg.is_cap, raw_w, 0.0)
  else:
    w = np.ones_like(raw_w)
  per = w * pg
  if cfg.kl_coef > 0:
    log_r = ref - logp
    per = per + cfg.kl_coef * (np.exp(log_r) - 1 - log_r)
  return _np_aggregate(per, mask, cfg.aggregation, cfg.norm_constant)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_reference(seed):
  """Row 0 is all-masked: the reference counts only the other rows (mean over 5, not 6)."""
  rng = np.random.RandomState(seed)
  n, t = 6, 7
  logp = rng.randn(n, t) * 0.3 - 2
  prox = logp + rng.randn(n, t) * 0.3
  beh = prox + rng.randn(n, t) * 0.5
  ref = logp + rng.randn(n, t) * 0.2
  adv = rng.randn(n)
  mask = rng.rand(n, t) > 0.3
  mask[0] = False  # an all-masked row
  cfg = _cfg(clip_low=0.2, clip_high=0.28, dual_clip=3.0, is_cap=2.0, kl_coef=0.04)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  loss, _ = policy_loss(f32(logp), f32(prox), f32(beh), f32(adv), jnp.asarray(mask), cfg,
                        ref_logp_NxT=f32(ref))
  assert float(loss) == pytest.approx(_reference(logp, prox, beh, adv, mask, cfg, ref),
                                      rel=1e-5, abs=1e-6)


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="aggregation"):
    _cfg(aggregation="sum")
  with pytest.raises(ValueError, match="dual_clip"):
    _cfg(dual_clip=0.5)
  with pytest.raises(ValueError, match="is_mode"):
    _cfg(is_mode="clip")


# ---------------------------------------------------------------------------------------------
# Entropy bonus.


def test_entropy_bonus_lowers_the_loss_by_coef_times_aggregated_entropy():
  """Mutations: + alpha H instead of - alpha H (loss 0.65); aux["entropy"] over all tokens
  including masked ones (6.5); entropy ignored in the loss (0.5)."""
  # logp = prox = mu: rho = 1, w = 1, pg = -A. A = [1, -2], mask [[1, 1, 0], [1, 0, 0]].
  # seq-mean-token-mean of pg: row 0 (-1 - 1) / 2 = -1, row 1 2 / 1 = 2 -> (-1 + 2) / 2 = 0.5.
  # entropy [[0.5, 1.5, 9], [2, 9, 9]]: rows (0.5 + 1.5) / 2 = 1, 2 / 1 = 2 -> 1.5;
  # with alpha = 0.1: 0.5 - 0.1 * 1.5 = 0.35. aux entropy = (0.5 + 1.5 + 2) / 3 = 4/3
  # (unmasked mean: (0.5 + 1.5 + 9 + 2 + 9 + 9) / 6 = 5.1667).
  # token-mean: pg (-1 - 1 + 2) / 3 = 0, entropy 4/3 -> 0 - 0.1 * 4/3 = -0.13333.
  z = jnp.zeros((2, 3))
  adv = jnp.array([1.0, -2.0])
  mask = jnp.array([[1, 1, 0], [1, 0, 0]], bool)
  ent = jnp.array([[0.5, 1.5, 9.0], [2.0, 9.0, 9.0]])
  for agg, base, agg_ent in (("seq-mean-token-mean", 0.5, 1.5), ("token-mean", 0.0, 4 / 3)):
    l0, aux0 = policy_loss(z, z, z, adv, mask, _cfg(aggregation=agg), entropy_NxT=ent)
    l1, aux1 = policy_loss(z, z, z, adv, mask, _cfg(aggregation=agg, entropy_coef=0.1),
                           entropy_NxT=ent)
    assert float(l0) == pytest.approx(base, abs=1e-6), agg
    assert float(l1) == pytest.approx(base - 0.1 * agg_ent, abs=1e-6), agg
    assert float(l1) - float(l0) == pytest.approx(-0.1 * agg_ent, abs=1e-6), agg
    assert float(aux0["entropy"]) == pytest.approx(4 / 3, abs=1e-6)
    assert float(aux1["entropy"]) == pytest.approx(4 / 3, abs=1e-6)


def test_entropy_coef_needs_the_entropy():
  z = jnp.zeros((1, 2))
  with pytest.raises(ValueError, match="entropy"):
    policy_loss(z, z, z, jnp.ones(1), jnp.ones((1, 2), bool), _cfg(entropy_coef=0.1))


# ---------------------------------------------------------------------------------------------
# Clip fractions count only tokens whose clip is active (the side that matters for the sign of A).


def test_clip_fracs_count_only_active_clips():
  """Mutations: clip_frac_low without `A < 0` (gives 2/4), clip_frac_high without `A > 0`
  (gives 2/4); either fraction over masked tokens too (denominator 8 or extra counts)."""
  # eps_low = eps_high = 0.2. Rows (one unmasked token each, token 1 masked):
  #   row 0: rho 0.5 < 0.8, A = +1 -> pg max(-0.5, -0.8) = -0.5: lower clip inactive, no count
  #   row 1: rho 0.5 < 0.8, A = -1 -> pg max(0.5, 0.8) = 0.8: lower clip active, counts low
  #   row 2: rho 1.5 > 1.2, A = +1 -> pg max(-1.5, -1.2) = -1.2: upper clip active, counts high
  #   row 3: rho 1.5 > 1.2, A = -1 -> pg max(1.5, 1.2) = 1.5: upper clip inactive, no count
  # clip_frac_low = 1/4, clip_frac_high = 1/4. Masked token 1 of every row has rho 0.5 with
  # rows 1's A < 0 (and rho 1.5 in row 2), which would count if the mask were ignored.
  rho = np.array([[0.5, 0.5], [0.5, 0.5], [1.5, 1.5], [1.5, 1.5]])
  logp = jnp.asarray(LOG(rho), jnp.float32)
  z = jnp.zeros((4, 2))
  mask = jnp.array([[1, 0]] * 4, bool)
  loss, aux = policy_loss(logp, z, z, jnp.array([1.0, -1.0, 1.0, -1.0]), mask,
                          _cfg(clip_low=0.2, clip_high=0.2))
  assert float(aux["clip_frac_low"]) == pytest.approx(0.25)
  assert float(aux["clip_frac_high"]) == pytest.approx(0.25)
  # seq-mean-token-mean of pg: (-0.5 + 0.8 - 1.2 + 1.5) / 4 = 0.15.
  assert float(loss) == pytest.approx(0.15, abs=1e-6)


# ---------------------------------------------------------------------------------------------
# Aggregation: rows without any unmasked token do not count.


def test_aggregations_with_an_all_masked_row_by_hand():
  """Mutations: counting the all-masked row as a sequence (old semantics: seq-mean-token-mean
  (2 + 4 + 0) / 3 = 2, sum-norm 10 / (3 * 3) = 1.1111 and 10 / 15 = 0.6667)."""
  values = jnp.array([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
  mask = jnp.array([[1, 1, 1], [1, 0, 0], [0, 0, 0]], bool)
  # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
  assert float(aggregate(values, mask, "token-mean")) == pytest.approx(2.5)
  # seq-mean-token-mean over the 2 rows with tokens: (6 / 3 + 4 / 1) / 2 = 3
  assert float(aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx(3.0)
  # seq-mean-token-sum-norm, 2 rows with tokens: T = 3 -> 10 / (2 * 3) = 1.6667;
  # constant 5 -> 10 / (2 * 5) = 1
  assert float(aggregate(values, mask, "seq-mean-token-sum-norm")) == pytest.approx(10 / 6)
  assert float(aggregate(values, mask, "seq-mean-token-sum-norm", 5.0)) == pytest.approx(1.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_all_masked_batch_aggregates_to_zero(mode):
  """Mutation: dividing by a row count without the max(., 1) guard gives NaN (0 / 0)."""
  out = aggregate(jnp.full((2, 3), 5.0), jnp.zeros((2, 3), bool), mode)
  assert float(out) == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_appending_all_masked_rows_changes_nothing(mode):
  """aggregate and policy_loss on a batch == on the batch with 2 all-masked rows appended
  (filled with large values). Mutation: N (all rows) instead of the rows with a token in the
  sequence-level modes: e.g. seq-mean divides by 5 instead of 3."""
  rng = np.random.RandomState(3)
  n, t = 3, 4
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  logp = rng.randn(n, t) * 0.3 - 2
  prox = logp + rng.randn(n, t) * 0.3
  beh = prox + rng.randn(n, t) * 0.3
  ent = rng.rand(n, t)
  adv = rng.randn(n)
  mask = np.array([[1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 1]], bool)
  pad = lambda x, v: np.concatenate([x, np.full((2,) + x.shape[1:], v, x.dtype)])
  cfg = _cfg(aggregation=mode, entropy_coef=0.01, clip_high=0.28)
  a = aggregate(f32(logp), jnp.asarray(mask), mode)
  b = aggregate(f32(pad(logp, 50.0)), jnp.asarray(pad(mask, False)), mode)
  assert float(b) == pytest.approx(float(a), rel=1e-6, abs=1e-7)
  la, _ = policy_loss(f32(logp), f32(prox), f32(beh), f32(adv), jnp.asarray(mask), cfg,
                      entropy_NxT=f32(ent))
  lb, _ = policy_loss(f32(pad(logp, 3.0)), f32(pad(prox, -3.0)), f32(pad(beh, -9.0)),
                      f32(pad(adv, 7.0)), jnp.asarray(pad(mask, False)), cfg,
                      entropy_NxT=f32(pad(ent, 4.0)))
  assert float(lb) == pytest.approx(float(la), rel=1e-6, abs=1e-7)


# ---------------------------------------------------------------------------------------------
# KL estimator k1 is a diagnostic, not a loss term.


def test_k1_rejected_as_a_loss_term_but_kept_as_a_diagnostic():
  """Mutation: no check in LossConfig (k1 with kl_coef > 0 accepted); a check that also rejects
  kl_coef = 0 or that breaks kl_penalty(..., "k1")."""
  with pytest.raises(ValueError, match="k1"):
    _cfg(kl_coef=0.1, kl_estimator="k1")
  cfg = _cfg(kl_coef=0.0, kl_estimator="k1")  # allowed: the term is off
  z = jnp.zeros((1, 2))
  loss, _ = policy_loss(z, z, z, jnp.ones(1), jnp.ones((1, 2), bool), cfg)
  assert float(loss) == pytest.approx(-1.0)  # rho = w = 1, A = 1: pg = -1 per token
  _cfg(kl_coef=0.1, kl_estimator="k2")
  _cfg(kl_coef=0.1, kl_estimator="k3")
  # k1 = -log r = log pi - log pi_ref = 0.5 - (-0.25) = 0.75
  assert float(kl_penalty(jnp.array(0.5), jnp.array(-0.25), "k1")) == pytest.approx(0.75)


# ---------------------------------------------------------------------------------------------
# Property test against an independent float64 reference.


@st.composite
def _batches(draw):
  # Shapes from a fixed set spanning N in 1..4 and T in 1..5: every new shape costs eager JAX
  # about a second of per-op compilation, so fully random shapes would make this test slow.
  n, t = draw(st.sampled_from([(1, 1), (1, 2), (2, 3), (4, 2), (3, 4), (4, 5)]))
  f = lambda lo, hi, shape: draw(hnp.arrays(np.float32, shape, elements=st.floats(
      lo, hi, width=32)))
  prox = f(-5.0, 0.0, (n, t))
  logp = (prox + f(-1.0, 1.0, (n, t))).astype(np.float32)
  beh = (prox - f(-1.0, 1.0, (n, t))).astype(np.float32)
  adv = f(-3.0, 3.0, (n,))
  mask = draw(hnp.arrays(np.bool_, (n, t)))
  empty_rows = draw(st.lists(st.integers(0, n - 1), max_size=n))
  mask[empty_rows] = False
  cfg = _cfg(
      clip_low=draw(st.sampled_from([0.0, 0.1, 0.2])),
      clip_high=draw(st.sampled_from([0.0, 0.2, 0.28])),
      is_mode=draw(st.sampled_from(["truncate", "mask"])),
      is_cap=draw(st.sampled_from([0.8, 1.5, 2.0])),
      aggregation=draw(st.sampled_from(["token-mean", "seq-mean-token-mean",
                                        "seq-mean-token-sum-norm"])),
      norm_constant=draw(st.sampled_from([0.0, 3.0, 8.0])))
  if cfg.is_mode == "mask":  # the mask is a step at the cap: keep float32 rounding off it
    hypothesis.assume(np.all(np.abs(np.exp(prox.astype(np.float64) - beh) - cfg.is_cap) > 1e-4))
  return logp, prox, beh, adv, mask, cfg


@hypothesis.settings(max_examples=50, deadline=None)
@hypothesis.given(_batches())
def test_policy_loss_matches_float64_reference_property(batch):
  """Mutations: any change of the clip (min -> max, eps swapped), of the behaviour weight
  (truncate vs mask, no cap), or of the aggregation (all-masked rows counted) breaks the match;
  a loss that leaks through masked tokens gives them a non-zero gradient."""
  logp, prox, beh, adv, mask, cfg = batch
  f64 = lambda x: x.astype(np.float64)
  expected = _reference(f64(logp), f64(prox), f64(beh), f64(adv), mask, cfg)
  fn = lambda lp: policy_loss(lp, jnp.asarray(prox), jnp.asarray(beh), jnp.asarray(adv),
                              jnp.asarray(mask), cfg)[0]
  loss, grad = jax.value_and_grad(fn)(jnp.asarray(logp))
  np.testing.assert_allclose(float(loss), expected, rtol=1e-4, atol=1e-5)
  grad = np.asarray(grad)
  assert np.all(np.isfinite(grad))
  assert np.all(grad[~mask] == 0.0)


@pytest.mark.parametrize("name,weight,ratio", [("decoupled", "prox / mu", "prox"),
                                               ("pi_old", "1", "prox"),
                                               ("align_mu", "gen / mu", "gen")])
def test_each_objective_sets_the_behaviour_weight_and_the_ratio_denominator(name, weight, ratio):
  """Every replay objective has its denominators (replay_objectives.OBJECTIVES): through the loss, the
  behaviour weight w = pi_prox' / mu' and the ratio rho = pi_theta / pi_prox' of its row."""
  objective = replay_objectives.OBJECTIVES[name]
  logp, mu, prox, gen = (jnp.full((1, 1), v, jnp.float32) for v in (-1.0, -1.5, -1.2, -1.4))
  behaviour, denominator = objective.denominators(mu, prox if objective.uses_prox else None, gen)
  _, aux = policy_loss(logp, denominator, behaviour, jnp.ones((1,), jnp.float32),
                       jnp.ones((1, 1), bool), _cfg(is_mode="truncate", is_cap=10.0))
  e = {"prox": np.exp(-1.2), "gen": np.exp(-1.4), "mu": np.exp(-1.5)}
  expected_w = {"prox / mu": e["prox"] / e["mu"], "1": 1.0, "gen / mu": e["gen"] / e["mu"]}
  np.testing.assert_allclose(float(aux["is_weight_mean"]), expected_w[weight], rtol=1e-6)
  np.testing.assert_allclose(float(aux["ratio_mean"]), np.exp(-1.0) / e[ratio], rtol=1e-6)


def test_objectives_are_defined_once(monkeypatch):
  """replay_objectives.OBJECTIVES is the one definition of how replayed rows enter the loss: an
  objective added there is one the replay methods and the config accept, with nothing else to
  keep in step (a second table of names once disagreed with it on align_mu's weight)."""
  from configs import popo  # pylint: disable=g-import-not-at-top
  from grpo_jax import configuration  # pylint: disable=g-import-not-at-top
  added = replay_objectives.Objective(uses_prox=False, denominators=lambda mu, prox, gen: (gen, gen))
  monkeypatch.setitem(replay_objectives.OBJECTIVES, "pi_gen", added)
  replay_method.validate_objective("pi_gen")
  c = popo.get_config("smoke")
  c.replay.objective = "pi_gen"
  configuration.validate(c)
  with pytest.raises(ValueError, match="objective must be one of"):
    replay_method.validate_objective("nope")
