"""Dr. GRPO's advantage: the reward minus its group's mean, no std division (Liu et al.,
"Understanding R1-Zero-Like Training", arXiv 2503.20783)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from grpo_jax import registry
from grpo_jax.rl.estimators import ESTIMATORS


@ESTIMATORS.register("drgrpo")
@dataclasses.dataclass(frozen=True)
class DrGrpo(registry.Configurable):
  """r - mean within each group."""

  def __call__(self, rewards_BxG):
    return rewards_BxG - jnp.mean(rewards_BxG, axis=-1, keepdims=True)
