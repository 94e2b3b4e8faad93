"""Group-relative advantage estimators and the effective-group mask.

Rewards come as [B, G]: B groups (prompts) of G rollouts each. Estimators, by name:

* ``grpo``: (r - mean) / (std + eps), with the unbiased std (ddof = 1) of the group, as
  ``torch.std`` gives it in verl and TRL; eps = 1e-6 (DeepSeekMath, arXiv 2402.03300).
* ``drgrpo``: r - mean, no std division (Dr. GRPO, arXiv 2503.20783).
* ``rloo``: r - mean of the other G - 1 rewards = G / (G - 1) * (r - mean) (RLOO,
  Ahmadian et al., arXiv 2402.14740).

A group is *effective* when its signal is not constant: neither all successes nor all failures
(POPO, arXiv 2606.01281; DAPO's dynamic-sampling filter, arXiv 2503.14476). ``effective_groups``
is the one definition, on the device (the train step) and on the host (the allocators), with
the tolerance ``EFFECTIVE_TOL`` rather than exact float equality; a group it calls constant
gets advantage 0 from every estimator, so "effective" and "has a non-zero advantage" agree.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# Spread (max - min within a group) at or below which a group's signal counts as constant.
EFFECTIVE_TOL = 1e-6


def grpo(rewards_BxG: jax.Array, eps: float = 1e-6) -> jax.Array:
  """(r - mean) / (std + eps) within each group; unbiased std (ddof = 1, as verl and TRL)."""
  r = rewards_BxG.astype(jnp.float32)
  mean = jnp.mean(r, axis=-1, keepdims=True)
  std = jnp.std(r, axis=-1, keepdims=True, ddof=1)
  return (r - mean) / (std + eps)


def drgrpo(rewards_BxG: jax.Array, eps: float = 1e-6) -> jax.Array:
  """r - mean within each group (no std normalisation)."""
  del eps
  r = rewards_BxG.astype(jnp.float32)
  return r - jnp.mean(r, axis=-1, keepdims=True)


def rloo(rewards_BxG: jax.Array, eps: float = 1e-6) -> jax.Array:
  """r_i - mean_{j != i} r_j (leave-one-out baseline); needs G >= 2."""
  del eps
  r = rewards_BxG.astype(jnp.float32)
  g = r.shape[-1]
  others = (jnp.sum(r, axis=-1, keepdims=True) - r) / (g - 1)
  return r - others


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., jax.Array]] = {
    "grpo": grpo,
    "drgrpo": drgrpo,
    "rloo": rloo,
}


def group_advantages(rewards_BxG: jax.Array, estimator: str = "grpo",
                     eps: float = 1e-6) -> jax.Array:
  """Advantages [B, G] float32 from rewards [B, G] with the named estimator.

  Raises:
    ValueError: unknown estimator name (lists the known ones).
  """
  if estimator not in ADVANTAGE_ESTIMATORS:
    raise ValueError(f"unknown advantage estimator {estimator!r}; known: "
                     f"{', '.join(ADVANTAGE_ESTIMATORS)}")
  if rewards_BxG.shape[-1] < 2:
    raise ValueError(f"group size must be >= 2 for group-relative advantages, "
                     f"got {rewards_BxG.shape[-1]}")
  adv = ADVANTAGE_ESTIMATORS[estimator](rewards_BxG, eps=eps)
  # A constant group (within EFFECTIVE_TOL) has no signal: its advantages are exactly 0.
  # Without this, the float32 mean of G equal rewards can miss them by one rounding step
  # (~6e-8), which grpo's division by std + eps = 1e-6 turns into advantages of up to ~0.1
  # (e.g. G = 8 rewards of 0.7); and a spread of 1e-7 would give advantages of ~0.05. A NaN
  # reward is not constant: its NaN advantages reach the train step's non-finite guard.
  r = jnp.asarray(rewards_BxG).astype(jnp.float32)
  constant_B = jnp.max(r, axis=-1) - jnp.min(r, axis=-1) <= EFFECTIVE_TOL
  return jnp.where(constant_B[:, None], 0.0, adv)


def effective_groups(values_BxG, tol: float = EFFECTIVE_TOL):
  """bool [B]: the group's signal varies (max - min > ``tol``), never exact float equality.

  The one definition of an effective group, used on the device and on the host: a jax array
  (or tracer) gives a jax array, a numpy array or list gives a numpy array.

  Args:
    values_BxG: bool successes or float scores, [B, G] (any leading axes; the last is G).
    tol: largest spread that still counts as constant.
  """
  xp = jnp if isinstance(values_BxG, jax.Array) else np
  s = xp.asarray(values_BxG).astype(xp.float32)
  return (xp.max(s, axis=-1) - xp.min(s, axis=-1)) > tol
