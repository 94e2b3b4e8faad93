"""PPO's clipped surrogate per token, with clip-higher and the dual clip.

  rho = pi_theta / pi_prox                                      (PPO, arXiv 1707.06347)
  loss_t = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))  clip-higher: DAPO (2503.14476)
  loss_t = min(loss_t, -A c) where A < 0                         dual clip (Ye et al. 1912.09729)

log rho is clamped to [-20, 20] only to keep exp finite.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax import registry
from grpo_jax.rl.policy_losses import POLICY_LOSSES, masked_mean


@POLICY_LOSSES.register("ppo")
@dataclasses.dataclass(frozen=True)
class Ppo(registry.Configurable):
  """Clipped PPO (the GRPO / DAPO loss).

  Attributes:
    clip_low: eps_low; rho is clipped below at 1 - clip_low.
    clip_high: eps_high; rho is clipped above at 1 + clip_high (> clip_low: clip-higher).
    dual_clip: c > 1 bounds the loss of negative-advantage tokens at -A c; 0 disables it.
  """

  clip_low: float = 0.2
  clip_high: float = 0.2
  dual_clip: float = 0.0

  def __post_init__(self):
    if not 0.0 <= self.clip_low < 1.0:
      raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
    if self.clip_high < 0.0:
      raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
    if self.dual_clip != 0 and self.dual_clip <= 1.0:
      raise ValueError(f"dual_clip must be > 1 (or 0: off), got {self.dual_clip}")

  def per_token(self, logp_NxT, prox_logp_NxT, advantages_Nx1, mask_NxT):
    adv = advantages_Nx1
    rho = jnp.exp(jnp.clip(logp_NxT - prox_logp_NxT, -20.0, 20.0))
    pg = jnp.maximum(-adv * rho, -adv * jnp.clip(rho, 1.0 - self.clip_low, 1.0 + self.clip_high))
    dual_active = jnp.zeros_like(mask_NxT)
    if self.dual_clip:
      bound = -adv * self.dual_clip
      dual_active = (adv < 0) & (pg > bound)
      pg = jnp.where(adv < 0, jnp.minimum(pg, bound), pg)
    return pg, {
        "clip_frac_low": masked_mean((rho < 1.0 - self.clip_low) & (adv < 0), mask_NxT),
        "clip_frac_high": masked_mean((rho > 1.0 + self.clip_high) & (adv > 0), mask_NxT),
        "dual_clip_frac": masked_mean(dual_active, mask_NxT),
        "ratio_mean": masked_mean(jax.lax.stop_gradient(rho), mask_NxT),
    }
