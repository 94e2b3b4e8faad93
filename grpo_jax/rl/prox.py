"""pi_prox of the replayed rows: the policy at the start of the step, exactly or interpolated.

The decoupled objective (Hilton, Cobbe, Schulman, arXiv 2110.00641) clips pi_theta / pi_prox
and weighs by pi_prox / mu, where pi_prox is the policy at the start of the step. Fresh rows
need no pass: pi_prox = mu for them (same numerics). Replayed rows do, and only they:

* ``gathered``: the exact no-grad pass over only the rows a method may replay (its static bound
  ``Composition.prox_rows``, e.g. POPO's ``slots`` groups), gathered replayed-first into
  ``prox_chunks`` fixed-size chunks; a chunk without a replayed row is skipped at run time
  (``lax.cond``), so the pass costs what is replayed, rounded up to a chunk, in fixed shapes.
  NeMo-RL skips the pass for fresh rows in the same way. The values are those of the pass over
  the whole batch up to float rounding (a matmul of fewer rows may sum in another order).
* ``interpolated``: no pass at all. AReaL's version-aware approximation (inclusionAI/AReaL,
  docs/algorithms/prox_approx.md, "loglinear"):
      log pi_prox ~ log mu + alpha (log pi_theta - log mu),
      alpha = (v_prox - v_mu) / (v_theta - v_mu),
  with pi_theta the loss pass's own log-probs (no gradient through the estimate). Here
  v_mu is the row's version stamp (the step that generated it), v_prox the current step s,
  and v_theta counts the updates made so far inside the step: s + u / U after u of the step's
  U = epochs x minibatches updates. So alpha = age / (age + u / U): exactly 1 in the step's first
  update (where pi_theta *is* pi_prox) and falling towards age / (age + 1) as the step's updates
  move pi_theta away. AReaL counts in whole versions (v_theta = v_prox + 1, alpha = age /
  (age + 1) throughout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.types import Rollout


def gathered(rollout: Rollout, replayed_N: jax.Array, rows_M: jax.Array, logp_fn,
             chunks: int, group_size: int) -> jax.Array:
  """log pi_prox of the replayed rows among ``rows_M``, by a pass over those rows only.

  Args:
    rollout: the batch's Rollout, N rows (N + R in the step).
    replayed_N: bool [N], which rows need pi_prox.
    rows_M: int32 [M] distinct row indices, a static bound holding every replayed row (the
      replayed ones first, so that the chunks past the last replayed row are skipped). Whole
      groups of ``group_size`` rows when M is a multiple of it, so the shared-prompt pass runs.
    logp_fn: Rollout of n rows -> [n, T] float32 log-probs (the start-of-step policy).
    chunks: how many chunks the M rows are dealt into (capped at the groups there are).
    group_size: G.

  Returns:
    [N, T] float32: the pass's log-probs at the rows of the chunks that ran, the rollout's
    behaviour log-probs elsewhere (what a fresh row's pi_prox is).
  """
  n, m = rollout.num_rows, rows_M.shape[0]
  unit = group_size if m % group_size == 0 else 1
  chunks = max(1, min(chunks, m // unit))
  per = -(-(m // unit) // chunks) * unit  # rows per chunk, whole groups
  # Padding past M points beyond the batch: read as a copy of the last row, written nowhere.
  idx = jnp.concatenate([rows_M.astype(jnp.int32),
                         jnp.full((chunks * per - m,), n, jnp.int32)]).reshape(chunks, per)
  need = jnp.take(replayed_N, idx, mode="fill", fill_value=False)

  def chunk(args):
    idx_X, need_X = args
    rows = jax.tree.map(lambda x: jnp.take(x, idx_X, axis=0, mode="clip"), rollout)
    skip = lambda r: r.behaviour_logp.astype(jnp.float32)  # mu: what a fresh row's pi_prox is
    return jax.lax.cond(jnp.any(need_X), logp_fn, skip, rows)

  logp = jax.lax.map(chunk, (idx, need))
  t = rollout.completion_ids.shape[1]
  return rollout.behaviour_logp.astype(jnp.float32).at[idx.reshape(-1)].set(
      logp.reshape(-1, t), mode="drop")


def interpolated(mu_UxT: jax.Array, logp_UxT: jax.Array, age_U: jax.Array,
                 update_fraction: jax.Array) -> jax.Array:
  """AReaL's log-linear estimate of log pi_prox (module docstring), no gradient.

  Args:
    mu_UxT: float32 [U, T] log mu of the rows' tokens.
    logp_UxT: float32 [U, T] log pi_theta from the loss pass (its gradient is stopped here).
    age_U: float32 [U] steps since each row was generated (0 on fresh rows).
    update_fraction: float32 scalar u / U, the updates of this step made before this one.

  Returns:
    [U, T] float32 log pi_prox: mu on rows of age 0, the interpolation elsewhere.
  """
  old = age_U > 0
  alpha_U = jnp.where(old, age_U / jnp.where(old, age_U + update_fraction, 1.0), 0.0)
  theta = jax.lax.stop_gradient(logp_UxT)
  return mu_UxT + alpha_U[:, None] * (theta - mu_UxT)
