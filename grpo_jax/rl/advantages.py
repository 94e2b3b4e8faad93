"""Group-relative advantages and the effective-group mask.

Rewards come as [B, G]: B groups (prompts) of G rollouts each. The estimators are registered
components (``grpo_jax.rl.estimators``: ``grpo``, DeepSeekMath arXiv 2402.03300; ``drgrpo``,
arXiv 2503.20783; ``rloo``, arXiv 2402.14740), each with its own config group;
``group_advantages`` calls one and zeroes the groups without signal.

A group is *effective* when its signal is not constant: neither all successes nor all failures
(POPO, arXiv 2606.01281; DAPO's dynamic-sampling filter, arXiv 2503.14476). ``effective_groups``
is the one definition, on the device (the train step) and on the host (the allocators), with
the tolerance ``EFFECTIVE_TOL`` rather than exact float equality; a group it calls constant
gets advantage 0 from every estimator, so "effective" and "has a non-zero advantage" agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.rl.estimators import ESTIMATORS, Estimator

# Spread (max - min within a group) at or below which a group's signal counts as constant.
EFFECTIVE_TOL = 1e-6


def make_estimator(name: str, group=None) -> Estimator:
  """The registered estimator ``name`` from its config group (its defaults when None).

  Raises:
    KeyError: an unknown name (lists the known ones). ValueError: a value out of range.
  """
  return ESTIMATORS.get(name).from_group(group)


def group_advantages(rewards_BxG: jax.Array, estimator: str | Estimator = "grpo") -> jax.Array:
  """Advantages [B, G] float32 from rewards [B, G] with the given estimator (or its name, with
  its defaults).

  Raises:
    ValueError: an unknown estimator name (lists the known ones), or G < 2.
  """
  if isinstance(estimator, str):
    if estimator not in ESTIMATORS:
      raise ValueError(f"unknown advantage estimator {estimator!r}; known: "
                       f"{', '.join(sorted(ESTIMATORS.names()))}")
    estimator = make_estimator(estimator)
  if rewards_BxG.shape[-1] < 2:
    raise ValueError(f"group size must be >= 2 for group-relative advantages, "
                     f"got {rewards_BxG.shape[-1]}")
  r = jnp.asarray(rewards_BxG).astype(jnp.float32)
  adv = estimator(r)
  # A constant group (within EFFECTIVE_TOL) has no signal: its advantages are exactly 0.
  # Without this, the float32 mean of G equal rewards can miss them by one rounding step
  # (~6e-8), which grpo's division by std + eps = 1e-6 turns into advantages of up to ~0.1
  # (e.g. G = 8 rewards of 0.7); and a spread of 1e-7 would give advantages of ~0.05. A NaN
  # reward is not constant: its NaN advantages reach the train step's non-finite guard.
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
