"""GSPO: the trust region on a sequence-level ratio (Zheng et al., arXiv 2507.18071).

The ratio of a row is the geometric mean of its tokens' ratios to pi_prox,

  s_i = exp( (1 / |o_i|) sum_t (log pi_theta - log pi_prox) ),

and every token of the row is clipped by it, with the gradient of GSPO-token (the paper's
section 4.3): the value s_i at every token, the gradient of token t that of
sg(s_i) pi_theta(o_t) / sg(pi_theta(o_t)), i.e. ``-A s_i d log pi_theta(o_t)`` where unclipped:

  loss_t = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high)),
  s_it = exp(min(sg(log s_i) + log pi_theta(o_t) - sg(log pi_theta(o_t)), 10)).

Under the default aggregation (``seq-mean-token-mean``) the 1 / |o_i| of the sequence gradient
comes from the mean over the row's tokens. verl's ``compute_policy_loss_gspo`` is the same
formula (the cap of the log-ratio at 10 included): tests/rl/test_policy_losses.py checks golden
values computed with it. The clip ranges of a sequence ratio are small: the paper's 3e-4 / 4e-4
are this group's defaults.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax import registry
from grpo_jax.rl.policy_losses import POLICY_LOSSES, masked_mean

# The largest log sequence ratio; above it the ratio is held there and its gradient is 0.
MAX_LOG_RATIO = 10.0


@POLICY_LOSSES.register("gspo")
@dataclasses.dataclass(frozen=True)
class Gspo(registry.Configurable):
  """Group Sequence Policy Optimization (GSPO-token).

  Attributes:
    clip_low: the sequence ratio is clipped below at 1 - clip_low.
    clip_high: and above at 1 + clip_high.
  """

  clip_low: float = 3e-4
  clip_high: float = 4e-4

  def __post_init__(self):
    if not 0.0 <= self.clip_low < 1.0:
      raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
    if self.clip_high < 0.0:
      raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")

  def per_token(self, logp_NxT, prox_logp_NxT, advantages_Nx1, mask_NxT):
    adv = advantages_Nx1
    log_ratio = jnp.where(mask_NxT, logp_NxT - prox_logp_NxT, 0.0)
    tokens_Nx1 = jnp.maximum(jnp.sum(mask_NxT, axis=-1, keepdims=True), 1).astype(jnp.float32)
    seq_log_ratio_Nx1 = jnp.sum(log_ratio, axis=-1, keepdims=True) / tokens_Nx1
    token_log_ratio = (jax.lax.stop_gradient(seq_log_ratio_Nx1) + logp_NxT
                       - jax.lax.stop_gradient(logp_NxT))
    s = jnp.exp(jnp.minimum(token_log_ratio, MAX_LOG_RATIO))
    pg = jnp.maximum(-adv * s, -adv * jnp.clip(s, 1.0 - self.clip_low, 1.0 + self.clip_high))
    s_value = jax.lax.stop_gradient(s)
    return pg, {
        "clip_frac_low": masked_mean((s_value < 1.0 - self.clip_low) & (adv < 0), mask_NxT),
        "clip_frac_high": masked_mean((s_value > 1.0 + self.clip_high) & (adv > 0), mask_NxT),
        "ratio_mean": masked_mean(s_value, mask_NxT),
    }
