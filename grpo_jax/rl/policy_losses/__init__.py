"""Per-token policy-gradient terms, registered by name (``config.rl.loss``), each with its own
config group (``config.rl.<name>``).

A policy loss is the part of the objective that differs between PPO, GSPO, CISPO, ...: from the
log-probs of the current policy (differentiated) and of the proximal policy, and one advantage
per row, it gives the loss of every token *before* the behaviour weight. What every loss shares
(the behaviour weight pi_prox / mu, the KL and entropy terms, the aggregation over tokens and
rows, and the diagnostics) is ``grpo_jax.rl.losses.policy_loss``, which calls the selected one.

A new loss is one module here: a frozen dataclass registered in ``POLICY_LOSSES`` whose fields
are its config group (``registry.Configurable``) and whose ``per_token`` implements the
``PolicyLoss`` protocol; its preset is one line in ``grpo_jax/schema/presets.py``.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from grpo_jax import registry


class PolicyLoss(Protocol):
  """One per-token policy-gradient term (a frozen, hashable dataclass)."""

  def per_token(self, logp_NxT: jax.Array, prox_logp_NxT: jax.Array, advantages_Nx1: jax.Array,
                mask_NxT: jax.Array) -> tuple[jax.Array, dict]:
    """The loss of every token before the behaviour weight, and its diagnostics.

    Args:
      logp_NxT: float32 log pi_theta of the sampled tokens (differentiated).
      prox_logp_NxT: float32 log pi_prox' (constant): the trust region's centre.
      advantages_Nx1: float32 advantages (constant), one per row.
      mask_NxT: bool, the completion tokens that count.

    Returns:
      (per-token loss [N, T] float32, dict of scalar metrics): the metrics include
      ``clip_frac_low``, ``clip_frac_high`` and ``ratio_mean`` (masked means over tokens).
    """


POLICY_LOSSES: registry.Registry = registry.Registry("policy loss",
                                                     package="grpo_jax.rl.policy_losses")


def masked_mean(x: jax.Array, mask_NxT: jax.Array) -> jax.Array:
  """Mean of ``x`` over the tokens of ``mask_NxT`` (0 when there are none)."""
  mask = mask_NxT.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)
