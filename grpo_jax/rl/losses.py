"""The policy loss every method shares: a registered per-token term, weighted, regularised and
aggregated.

Per token, with log-probs of the current policy (theta), the proximal policy (prox: the
parameters at the start of the step) and the behaviour policy (mu: the one that sampled):

  pg_t   = the selected policy loss's term (``policy_losses``: ppo, gspo, cispo), clipped
           around pi_prox
  w      = sg(pi_prox / mu), capped ("truncate") or
           zeroed above the cap ("mask")                decoupled PPO (Hilton et al. 2110.00641);
                                                        AReaL masks, verl/TIS truncates
  loss_t = w pg_t + beta KL_t(theta || ref) - alpha H_t

Fresh on-policy data has prox = mu, so w = exp(0) = 1 exactly. KL estimators (Schulman, "Approximating
KL divergence", 2020), with log r = log pi_ref - log pi_theta on tokens sampled from pi_theta:
k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r (GRPO's choice). As *loss terms* (the
sampled tokens held fixed, the gradient flowing through log pi_theta only) they are not the same
regulariser, whatever their values say:

  k1: grad = grad log pi_theta(o_t); its expectation under pi_theta is 0, so it adds noise and no
      pull towards the reference. Rejected as a loss term (kl_coef > 0); kept as a diagnostic.
  k2: grad = (log pi_theta - log pi_ref) grad log pi_theta, whose expectation under pi_theta is the
      gradient of the reverse KL(pi_theta || pi_ref): the on-policy KL gradient.
  k3: grad = (1 - pi_ref / pi_theta) grad log pi_theta, whose expectation under pi_theta is
      -E_ref[grad log pi_theta] = the gradient of the forward KL(pi_ref || pi_theta).

(On replayed rows the tokens come from mu, not pi_theta, so these expectations hold only up to
the behaviour weight.)

Aggregations: "token-mean" (DAPO: all tokens of the batch weigh the same), "seq-mean-token-mean"
(GRPO: average within each sequence, then over sequences), "seq-mean-token-sum-norm" (Dr. GRPO:
sum over tokens divided by a constant, the max completion length). The sequence-level ones count
only rows with at least one unmasked token, as verl's do: a row masked out entirely (a group
dropped by GRPO-filter, an empty replay slot) leaves the loss exactly as if it were not in the
batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from grpo_jax import registry
from grpo_jax.rl.policy_losses import POLICY_LOSSES, masked_mean
from grpo_jax.rl.policy_losses import ppo

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IS_MODES = ("none", "truncate", "mask")
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class LossConfig(registry.Configurable):
  """Static switches of ``policy_loss`` (hashable); its config group is ``config.rl.loss``.

  Attributes:
    policy: the per-token policy-gradient term, a registered ``PolicyLoss`` (``policy_losses``:
      ``Ppo()`` by default), named by ``config.rl.loss.policy`` with its own group beside it
      (``config.rl.loss.ppo.clip_high``).
    is_mode: behaviour importance weight pi_prox / mu: "none" (w = 1), "truncate"
      (min(w, cap)) or "mask" (w where w <= cap, else 0).
    is_cap: the cap of the behaviour weight.
    aggregation: one of AGGREGATIONS.
    norm_constant: divisor per sequence of "seq-mean-token-sum-norm" (tokens); 0 means the
      completion length T of the batch.
    kl_coef: beta of the KL penalty to the frozen reference (0 disables it).
    kl_estimator: "k1", "k2" or "k3".
    entropy_coef: alpha of the entropy bonus (0 disables it).
  """

  policy: Any = registry.component(POLICY_LOSSES, ppo.Ppo())
  is_mode: str = "truncate"
  is_cap: float = 2.0
  aggregation: str = "seq-mean-token-mean"
  norm_constant: float = 0.0
  kl_coef: float = 0.0
  kl_estimator: str = "k3"
  entropy_coef: float = 0.0

  def __post_init__(self):
    error = registry.GroupError
    if not hasattr(self.policy, "per_token"):
      raise error(("policy",), f"{self.policy!r} is not a registered policy loss "
                  f"({', '.join(POLICY_LOSSES.names())})")
    for name, known in (("is_mode", IS_MODES), ("aggregation", AGGREGATIONS),
                        ("kl_estimator", KL_ESTIMATORS)):
      if getattr(self, name) not in known:
        raise error((name,), f"{getattr(self, name)!r}; known: {', '.join(known)}")
    if not self.is_cap > 0:
      raise error(("is_cap",), f"{self.is_cap} must be > 0")
    for name in ("kl_coef", "entropy_coef", "norm_constant"):
      if not getattr(self, name) >= 0:
        raise error((name,), f"{getattr(self, name)} must be >= 0")
    if self.kl_coef > 0 and self.kl_estimator == "k1":
      raise error(("kl_estimator",), "'k1' has zero expected gradient as a loss term (noise "
                  "only); use 'k3' (GRPO) or 'k2' with kl_coef > 0")


def kl_penalty(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k3") -> jax.Array:
  """Per-token estimate of KL(pi_theta || pi_ref) from tokens sampled by pi_theta."""
  log_r = ref_logp - logp
  if estimator == "k1":
    return -log_r
  if estimator == "k2":
    return 0.5 * jnp.square(log_r)
  if estimator == "k3":
    # The exponent is clamped: a token the reference finds far likelier must not overflow.
    return _k3(log_r)
  raise ValueError(f"unknown KL estimator {estimator!r}; known: {KL_ESTIMATORS}")


def aggregate(values_NxT: jax.Array, mask_NxT: jax.Array, mode: str,
              norm_constant: float = 0.0) -> jax.Array:
  """Reduces per-token values to a scalar with the named aggregation (masked tokens ignored).

  Rows without any unmasked token do not count as sequences: adding such rows to a batch never
  changes the result (0 when no row has a token).
  """
  mask = mask_NxT.astype(jnp.float32)
  total = values_NxT * mask
  if mode == "token-mean":
    return jnp.sum(total) / jnp.maximum(jnp.sum(mask), 1.0)
  tokens_N = jnp.sum(mask, axis=-1)
  rows = jnp.maximum(jnp.sum((tokens_N > 0).astype(jnp.float32)), 1.0)
  if mode == "seq-mean-token-mean":
    per_seq = jnp.sum(total, axis=-1) / jnp.maximum(tokens_N, 1.0)
    return jnp.sum(per_seq) / rows
  if mode == "seq-mean-token-sum-norm":
    norm = norm_constant if norm_constant > 0 else values_NxT.shape[-1]
    return jnp.sum(total) / (rows * norm)
  raise ValueError(f"unknown aggregation {mode!r}; known: {AGGREGATIONS}")


def _k3(log_ratio):
  """(r - 1) - log r with the exponent clamped, for diagnostics that must stay finite."""
  return jnp.exp(jnp.minimum(log_ratio, 20.0)) - 1.0 - log_ratio


def behaviour_weight(prox_logp: jax.Array, behaviour_logp: jax.Array,
                     config: LossConfig) -> tuple[jax.Array, jax.Array]:
  """The behaviour importance weight pi_prox / mu per token, after the cap, and where it
  exceeded the cap: (w, capped). "none" gives 1, "truncate" min(w, cap), "mask" 0 above cap."""
  raw_w = jnp.exp(jnp.clip(prox_logp - behaviour_logp, -20.0, 20.0))
  if config.is_mode == "none":
    w = jnp.ones_like(raw_w)
  elif config.is_mode == "truncate":
    w = jnp.minimum(raw_w, config.is_cap)
  else:
    w = jnp.where(raw_w <= config.is_cap, raw_w, 0.0)
  return w, raw_w > config.is_cap


def policy_loss(logp_NxT: jax.Array, prox_logp_NxT: jax.Array, behaviour_logp_NxT: jax.Array,
                advantages_N: jax.Array, mask_NxT: jax.Array, config: LossConfig,
                ref_logp_NxT: jax.Array | None = None,
                entropy_NxT: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """The decoupled policy loss and its diagnostics (``config.policy``'s term per token).

  Args:
    logp_NxT: log pi_theta of the sampled tokens (differentiated).
    prox_logp_NxT: log pi_prox (treated as constant).
    behaviour_logp_NxT: log mu, recorded by the sampler (constant).
    advantages_N: one advantage per sequence, broadcast over its tokens.
    mask_NxT: True for completion tokens that count.
    config: LossConfig.
    ref_logp_NxT: log pi_ref, required when config.kl_coef > 0.
    entropy_NxT: per-token entropy of pi_theta, required when config.entropy_coef > 0.

  Returns:
    (loss scalar, aux dict of scalar metrics): the policy loss's own (clip_frac_low /
    clip_frac_high: fraction of tokens where the lower / upper clip is active, ratio_mean;
    PPO's dual_clip_frac), is_weight_mean,
    is_weight_max, is_capped_frac, approx_kl_behaviour (k3 of mu vs theta), approx_kl_prox,
    drift (mean squared log-ratio theta vs mu), kl_ref and entropy when computed.
  """
  c = config
  mask = mask_NxT.astype(bool)
  prox = jax.lax.stop_gradient(prox_logp_NxT.astype(jnp.float32))
  behaviour = jax.lax.stop_gradient(behaviour_logp_NxT.astype(jnp.float32))
  logp = logp_NxT.astype(jnp.float32)
  adv = jax.lax.stop_gradient(advantages_N.astype(jnp.float32))[:, None]

  pg, aux = c.policy.per_token(logp, prox, adv, mask)
  w, capped = behaviour_weight(prox, behaviour, c)

  per_token = w * pg
  if c.kl_coef > 0:
    if ref_logp_NxT is None:
      raise ValueError("kl_coef > 0 needs ref_logp_NxT")
    kl = kl_penalty(logp, jax.lax.stop_gradient(ref_logp_NxT.astype(jnp.float32)),
                    c.kl_estimator)
    per_token = per_token + c.kl_coef * kl
    aux["kl_ref"] = masked_mean(kl, mask)
  if entropy_NxT is not None:
    aux["entropy"] = masked_mean(jax.lax.stop_gradient(entropy_NxT), mask)
    if c.entropy_coef > 0:
      per_token = per_token - c.entropy_coef * entropy_NxT
  elif c.entropy_coef > 0:
    raise ValueError("entropy_coef > 0 needs entropy_NxT")
  loss = aggregate(per_token, mask, c.aggregation, c.norm_constant)

  sg_logp = jax.lax.stop_gradient(logp)
  log_theta_mu = sg_logp - behaviour
  aux.update(
      is_weight_mean=masked_mean(w, mask),
      is_weight_max=jnp.max(jnp.where(mask, w, 0.0)),
      is_capped_frac=masked_mean(capped, mask),
      approx_kl_behaviour=masked_mean(_k3(log_theta_mu), mask),
      approx_kl_prox=masked_mean(_k3(sg_logp - prox), mask),
      drift=masked_mean(jnp.square(log_theta_mu), mask),
  )
  return loss, aux
