"""The train step's metrics: float32 scalars the host fetches one step late.

Averages are over what is real: the fresh rows (and groups) with at least one completion token
(an allocator's empty groups are padding), and the update batch's rows that count in the loss
(masked replay slots, dropped groups and padding do not).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.rl.batch import UpdateBatch
from grpo_jax.types import Rollout


def mean_over(x: jax.Array, where: jax.Array) -> jax.Array:
  """Mean of ``x`` over the entries where ``where`` (0 when there are none), float32."""
  w = where.astype(jnp.float32)
  return jnp.sum(x.astype(jnp.float32) * w) / jnp.maximum(jnp.sum(w), 1.0)


def update_metrics(per_update: dict, replaying: bool) -> dict:
  """The update scan's metrics over its E x M updates.

  Args:
    per_update: name -> [E, M] per-update values (``update.update_scan``); ``_sum/`` and
      ``_max/`` keys are the replay drift's partial sums (``replay_drift_sums``), ``_tokens/``
      the loss pass's real tokens and positions computed (``policy.pass_tokens``).
    replaying: the method can replay (static), so the drift sums are there.

  Returns:
    Means of the per-update metrics, ``grad_norm_max``, ``update_useful_fraction`` (the loss
    pass's real tokens over its positions computed), the last update's ``learning_rate``
    (when the optimiser exposes it) and, when replaying, the replay drift metrics.
  """
  metrics = {k: jnp.mean(v) for k, v in per_update.items() if not k.startswith("_")}
  if replaying:
    metrics.update(_replay_drift_metrics(per_update))
  if "_tokens/computed" in per_update:
    # The loss pass's real tokens over the positions it computed, over every update.
    metrics["update_useful_fraction"] = (jnp.sum(per_update["_tokens/real"])
                                         / jnp.maximum(jnp.sum(per_update["_tokens/computed"]),
                                                       1.0))
  metrics["grad_norm_max"] = jnp.max(per_update["grad_norm"])
  if "learning_rate" in per_update:
    metrics["learning_rate"] = per_update["learning_rate"][-1, -1]
  return metrics


def batch_metrics(rollout: Rollout, adv_BxG: jax.Array, effective_B: jax.Array,
                  batch: UpdateBatch) -> dict:
  """Rewards, effectiveness, advantages and lengths of the step's rows.

  Args:
    rollout: the fresh Rollout, N = B * G rows.
    adv_BxG: [B, G] float32 advantages of the fresh groups.
    effective_B: [B] bool, the effective fresh groups.
    batch: the UpdateBatch, N + R rows.

  Returns:
    reward_mean, success_mean, completion_length_mean over the fresh rows; effective_fraction
    over the fresh groups; advantage_abs_mean, nonzero_advantage_fraction and loss_rows over
    the rows that count in the loss.
  """
  b, g = adv_BxG.shape
  fresh_row_N = jnp.any(rollout.completion_mask, axis=-1)
  fresh_group_B = jnp.any(fresh_row_N.reshape(b, g), axis=-1)
  loss_row_N = jnp.any(batch.loss_mask, axis=-1)
  lengths_N = jnp.sum(rollout.completion_mask, axis=-1).astype(jnp.float32)
  adv_N = batch.advantages
  return dict(
      reward_mean=mean_over(rollout.scores, fresh_row_N),
      success_mean=mean_over(rollout.success, fresh_row_N),
      effective_fraction=mean_over(effective_B, fresh_group_B),
      advantage_abs_mean=mean_over(jnp.abs(adv_N), loss_row_N),
      completion_length_mean=mean_over(lengths_N, fresh_row_N),
      # Fraction of the loss's rows whose advantage is non-zero: the rows that teach.
      nonzero_advantage_fraction=mean_over(jnp.abs(adv_N) > 1e-8, loss_row_N),
      loss_rows=jnp.sum(loss_row_N.astype(jnp.float32)),
  )


def effective_disagreement(adv_BxG: jax.Array, effective_B: jax.Array) -> jax.Array:
  """Groups whose advantages teach ([B, G] not all ~0) but that are not effective on the
  effective signal, or the other way round (when the two signals differ)."""
  teaches_B = jnp.any(jnp.abs(adv_BxG) > 1e-6, axis=-1)
  return jnp.sum((teaches_B != effective_B).astype(jnp.float32))


def replay_age_metrics(mask_NxT: jax.Array, replayed_N: jax.Array, version_N: jax.Array,
                       step: jax.Array) -> dict:
  """Rows replayed in the loss and their age in train steps (step - version).

  Args:
    mask_NxT: [N + R, T] bool loss mask.
    replayed_N: [N + R] bool, the row comes from the buffer.
    version_N: [N + R] int32 policy step that generated the row.
    step: int32 policy step of this train step.
  """
  used_N = replayed_N & jnp.any(mask_NxT, axis=-1)
  age_N = (step - version_N).astype(jnp.float32)
  return {"replay_rows": jnp.sum(used_N.astype(jnp.float32)),
          "replay_age_mean": mean_over(age_N, used_N),
          "replay_age_max": jnp.max(jnp.where(used_N, age_N, 0.0))}


def replay_drift_sums(logp_UxT: jax.Array, mb: UpdateBatch, is_cap: float) -> dict:
  """Per-update sums over the minibatch's replayed tokens of the policy's divergence from each
  row's pi_gen, from the loss pass's own log pi_theta (whatever the objective sets pi_prox and
  mu to): ``_sum/`` keys are summed and ``_max/`` keys maxed over the updates, then divided by
  ``_replay_drift_metrics``.

  Args:
    logp_UxT: [U, T] log pi_theta of the minibatch's tokens.
    mb: the minibatch, U rows (``replayed`` and ``gen_logp`` set).
    is_cap: the behaviour weight's cap (LossConfig.is_cap).
  """
  tok = mb.loss_mask & mb.replayed[:, None]
  tok_f = tok.astype(jnp.float32)
  log_r = jax.lax.stop_gradient(logp_UxT.astype(jnp.float32)) - mb.gen_logp
  r = jnp.exp(jnp.clip(log_r, -20.0, 20.0))
  return {"_sum/replay_tokens": jnp.sum(tok_f),
          "_sum/replay_sq_log_ratio": jnp.sum(jnp.square(log_r) * tok_f),
          "_sum/replay_ratio": jnp.sum(r * tok_f),
          "_sum/replay_over_cap": jnp.sum((r > is_cap) * tok_f),
          "_max/replay_ratio": jnp.max(jnp.where(tok, r, 0.0))}


def _replay_drift_metrics(per_update: dict) -> dict:
  """Replay diagnostics over every update's replayed tokens (``replay_drift_sums``):
  replay_drift = mean (log pi_theta - log pi_gen)^2; replay_is_weight_mean / max = pi_theta /
  pi_gen, the importance weight of the policy being trained against the one that generated
  the row (pi_gen = mu in float32); replay_is_capped_frac = share of those above ``is_cap``."""
  tokens = jnp.maximum(jnp.sum(per_update["_sum/replay_tokens"]), 1.0)
  total = lambda name: jnp.sum(per_update[f"_sum/{name}"]) / tokens
  return {"replay_drift": total("replay_sq_log_ratio"),
          "replay_is_weight_mean": total("replay_ratio"),
          "replay_is_weight_max": jnp.max(per_update["_max/replay_ratio"]),
          "replay_is_capped_frac": total("replay_over_cap")}
