"""GRPO's advantage: the reward standardised within its group (DeepSeekMath, arXiv 2402.03300).

  A_i = (r_i - mean(r)) / (std(r) + eps),

with the unbiased std (ddof = 1) of the group, as ``torch.std`` gives it in verl and TRL.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from grpo_jax import registry
from grpo_jax.rl.estimators import ESTIMATORS


@ESTIMATORS.register("grpo")
@dataclasses.dataclass(frozen=True)
class Grpo(registry.Configurable):
  """(r - mean) / (std + eps) within each group.

  Attributes:
    eps: added to the std (1e-6, as DeepSeekMath, verl and TRL).
  """

  eps: float = 1e-6

  def __post_init__(self):
    if not self.eps > 0:
      raise ValueError(f"eps must be > 0, got {self.eps}")

  def __call__(self, rewards_BxG):
    mean = jnp.mean(rewards_BxG, axis=-1, keepdims=True)
    std = jnp.std(rewards_BxG, axis=-1, keepdims=True, ddof=1)
    return (rewards_BxG - mean) / (std + self.eps)
