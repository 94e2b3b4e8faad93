"""RLOO's advantage: the reward minus the mean of the group's other G - 1 rewards (Ahmadian et
al., arXiv 2402.14740), = G / (G - 1) (r - mean)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from grpo_jax import registry
from grpo_jax.rl.estimators import ESTIMATORS


@ESTIMATORS.register("rloo")
@dataclasses.dataclass(frozen=True)
class Rloo(registry.Configurable):
  """r_i - mean_{j != i} r_j (leave-one-out baseline)."""

  def __call__(self, rewards_BxG):
    g = rewards_BxG.shape[-1]
    others = (jnp.sum(rewards_BxG, axis=-1, keepdims=True) - rewards_BxG) / (g - 1)
    return rewards_BxG - others
