"""Group-relative advantage estimators, registered by name (``config.rl.estimator``), each with
its own config group (``config.rl.<name>``).

An estimator maps the rewards of B groups of G rollouts, float32 [B, G], to one advantage per
rollout, [B, G]. ``grpo_jax.rl.advantages.group_advantages`` calls the selected one and zeroes
the groups whose signal is constant. A new estimator is one module here: a frozen dataclass
registered in ``ESTIMATORS`` (its fields are its config group, ``registry.Configurable``) with a
``__call__`` implementing ``Estimator``.
"""

from __future__ import annotations

from typing import Protocol

import jax

from grpo_jax import registry


class Estimator(Protocol):
  """One advantage estimator (a frozen, hashable dataclass)."""

  def __call__(self, rewards_BxG: jax.Array) -> jax.Array:
    """Advantages [B, G] float32 from float32 rewards [B, G] (G >= 2)."""


ESTIMATORS: registry.Registry = registry.Registry("advantage estimator",
                                                  package="grpo_jax.rl.estimators")
