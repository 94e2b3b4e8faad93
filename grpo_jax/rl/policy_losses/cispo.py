"""CISPO: REINFORCE with a clipped, stop-gradient importance weight (MiniMax-M1, arXiv
2506.13585).

  r = pi_theta / pi_prox,  c = sg(clip(r, 1 - eps_low, 1 + eps_high)),
  loss_t = -c A log pi_theta(o_t).

Unlike PPO's clip, which zeroes the gradient of a token outside the trust region, every token
keeps its gradient ``-c A``: the clip bounds the weight, never drops the token. The loss's
value depends on log pi_theta itself, not only on the ratio (its gradient is what matters).
verl's ``compute_policy_loss_cispo`` is the same formula (both sides clipped):
tests/rl/test_policy_losses.py checks golden values computed with it. Defaults: no lower bound
(clip_low 1.0: the weight is never raised) and a weight of at most 4 (clip_high 3.0, ScaleRL's and
Tinker's CISPO default); MiniMax-M1 tunes eps_high per run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax import registry
from grpo_jax.rl.policy_losses import POLICY_LOSSES, masked_mean


@POLICY_LOSSES.register("cispo")
@dataclasses.dataclass(frozen=True)
class Cispo(registry.Configurable):
  """Clipped IS-weight Policy Optimization.

  Attributes:
    clip_low: the weight is clipped below at 1 - clip_low (1.0: no lower bound).
    clip_high: and above at 1 + clip_high.
  """

  clip_low: float = 1.0
  clip_high: float = 3.0

  def __post_init__(self):
    if not 0.0 <= self.clip_low <= 1.0:
      raise ValueError(f"clip_low must be in [0, 1], got {self.clip_low}")
    if self.clip_high < 0.0:
      raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")

  def per_token(self, logp_NxT, prox_logp_NxT, advantages_Nx1, mask_NxT):
    adv = advantages_Nx1
    r = jnp.exp(jnp.clip(jax.lax.stop_gradient(logp_NxT) - prox_logp_NxT, -20.0, 20.0))
    c = jnp.clip(r, 1.0 - self.clip_low, 1.0 + self.clip_high)
    pg = -c * adv * logp_NxT
    return pg, {
        "clip_frac_low": masked_mean(r < 1.0 - self.clip_low, mask_NxT),
        "clip_frac_high": masked_mean(r > 1.0 + self.clip_high, mask_NxT),
        "ratio_mean": masked_mean(r, mask_NxT),
    }
