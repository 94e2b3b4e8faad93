"""Policy loss: hand-worked cases and a float64 reference on random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.losses import LossConfig, aggregate, kl_penalty, policy_loss

LOG = np.log


def _one(logp, prox, beh, adv, **kw):
  """Loss and aux for a single token of a single sequence."""
  a = lambda x: jnp.array([[x]], jnp.float32)
  return policy_loss(a(logp), a(prox), a(beh), jnp.array([adv], jnp.float32),
                     jnp.ones((1, 1), bool), LossConfig(**kw))


def test_fresh_data_has_behaviour_weight_exactly_one():
  rng = np.random.RandomState(0)
  logp = jnp.asarray(rng.randn(4, 5), jnp.float32)
  old = jnp.asarray(rng.randn(4, 5), jnp.float32)
  _, aux = policy_loss(logp, old, old, jnp.ones(4), jnp.ones((4, 5), bool), LossConfig())
  assert float(aux["is_weight_mean"]) == 1.0 and float(aux["is_weight_max"]) == 1.0
  assert float(aux["is_capped_frac"]) == 0.0


def test_clip_high_positive_advantage():
  # A = 1, rho = 1.5, eps_high = 0.2: max(-1.5, -1.2) = -1.2; gradient through the clip is 0.
  loss, aux = _one(LOG(1.5), 0.0, 0.0, 1.0, clip_high=0.2)
  assert float(loss) == pytest.approx(-1.2, abs=1e-6)
  assert float(aux["clip_frac_high"]) == 1.0 and float(aux["clip_frac_low"]) == 0.0
  g = jax.grad(lambda lp: policy_loss(lp, jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.ones(1),
                                      jnp.ones((1, 1), bool), LossConfig())[0])(
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
  cfg = LossConfig(kl_coef=0.1, dual_clip=3.0)
  for adv in (jnp.array([1.0, -1.0]), jnp.zeros(2)):
    loss, aux = policy_loss(logp, prox, prox - 200.0, adv, mask, cfg, ref_logp_NxT=prox)
    grads = jax.grad(lambda lp: policy_loss(lp, prox, prox, adv, mask, cfg,
                                            ref_logp_NxT=prox)[0])(logp)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(grads)))
    assert all(np.isfinite(float(v)) for v in aux.values())
  # Zero advantages and no KL: the loss is exactly zero.
  loss, _ = policy_loss(logp, prox, prox, jnp.zeros(2), mask, LossConfig())
  assert float(loss) == 0.0


def _reference(logp, prox, beh, adv, mask, cfg, ref):
  """float64 numpy transcription of the documented formula."""
  rho = np.exp(logp - prox)
  a = adv[:, None]
  pg = np.maximum(-a * rho, -a * np.clip(rho, 1 - cfg.clip_low, 1 + cfg.clip_high))
  if cfg.dual_clip:
    pg = np.where(a < 0, np.minimum(pg, -a * cfg.dual_clip), pg)
  w = np.minimum(np.exp(prox - beh), cfg.is_cap)
  log_r = ref - logp
  per = w * pg + cfg.kl_coef * (np.exp(log_r) - 1 - log_r)
  m = mask.astype(np.float64)
  return np.mean((per * m).sum(1) / np.maximum(m.sum(1), 1))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_reference(seed):
  rng = np.random.RandomState(seed)
  n, t = 6, 7
  logp = rng.randn(n, t) * 0.3 - 2
  prox = logp + rng.randn(n, t) * 0.3
  beh = prox + rng.randn(n, t) * 0.5
  ref = logp + rng.randn(n, t) * 0.2
  adv = rng.randn(n)
  mask = rng.rand(n, t) > 0.3
  mask[0] = False  # an all-masked row
  cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, is_cap=2.0, kl_coef=0.04)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  loss, _ = policy_loss(f32(logp), f32(prox), f32(beh), f32(adv), jnp.asarray(mask), cfg,
                        ref_logp_NxT=f32(ref))
  assert float(loss) == pytest.approx(_reference(logp, prox, beh, adv, mask, cfg, ref),
                                      rel=1e-5, abs=1e-6)


def test_config_validation_names_the_field():
  with pytest.raises(ValueError, match="aggregation"):
    LossConfig(aggregation="sum")
  with pytest.raises(ValueError, match="dual_clip"):
    LossConfig(dual_clip=0.5)
  with pytest.raises(ValueError, match="is_mode"):
    LossConfig(is_mode="clip")
