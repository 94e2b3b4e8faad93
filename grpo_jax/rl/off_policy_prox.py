"""pi_prox of off-policy rows: the policy at the start of the step, exactly or interpolated.

The decoupled objective (Hilton, Cobbe, Schulman, arXiv 2110.00641) clips pi_theta / pi_prox
and weighs by pi_prox / mu, where pi_prox is the policy at the start of the step. Fresh rows
need no pass: pi_prox = mu for them (same numerics). Off-policy rows do, and only they: rows
replayed from a buffer, and under partial rollouts (``rollout.partial``) the continued rows,
whose earlier tokens were drawn by earlier parameters (``types.Rollout.version``):

* ``gathered``: the exact no-grad pass over only the rows a method may replay (its static bound
  ``Composition.prox_rows``, e.g. POPO's ``slots`` groups), gathered replayed-first into
  ``prox_chunks`` fixed-size chunks; a chunk without a replayed row is skipped at run time
  (``lax.cond``), so the pass costs what is replayed, rounded up to a chunk, in fixed shapes.
  Under partial rollouts any row of the batch may be continued: the bound is the whole batch,
  off-policy rows first (``off_policy_first``), so the pass costs the continued and replayed
  rows, rounded up to a chunk.
  NeMo-RL skips the pass for fresh rows in the same way. The values are those of the pass over
  the whole batch up to float rounding (a matmul of fewer rows may sum in another order).
* ``interpolated``: no pass at all. AReaL's version-aware approximation (inclusionAI/AReaL,
  docs/algorithms/prox_approx.md, "loglinear"):
      log pi_prox ~ log mu + alpha (log pi_theta - log mu),
      alpha = (v_prox - v_mu) / (v_theta - v_mu),
  with pi_theta the loss pass's own log-probs (no gradient through the estimate). Here
  v_mu is the token's version (the parameters that drew it; a synchronous row's tokens all
  carry the step that generated it, a continued row's span versions), v_prox the current step
  s, and v_theta counts the updates made so far inside the step: s + u / U after u of the
  step's U = epochs x minibatches updates. So alpha = age / (age + u / U) per token: exactly 1
  in the step's first update (where pi_theta *is* pi_prox), falling towards age / (age + 1) as
  the step's updates move pi_theta away, and 0 on a token of the current version (pi_prox =
  mu). AReaL counts in whole versions (v_theta = v_prox + 1, alpha = age / (age + 1)
  throughout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.types import Rollout


def gathered(rollout: Rollout, replayed_N: jax.Array, rows_M: jax.Array, logp_fn,
             chunks: int, group_size: int, count_fn=None):
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
    count_fn: optional, Rollout of n rows -> (real tokens, positions computed) of ``logp_fn``'s
      pass over them (``policy.pass_tokens``); the padding rows of the last chunk count as
      computed, never as real.

  Returns:
    [N, T] float32: the pass's log-probs at the rows of the chunks that ran, the rollout's
    behaviour log-probs elsewhere (what a fresh row's pi_prox is). With ``count_fn``:
    (that, float32 real tokens, float32 positions computed) summed over the chunks that ran.
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
    if count_fn is None:
      return jax.lax.cond(jnp.any(need_X), logp_fn, skip, rows)
    pad = (idx_X >= n)[:, None]
    off = lambda x: jnp.where(pad, jnp.zeros_like(x), x)
    real_rows = rows.replace(prompt_mask=off(rows.prompt_mask),
                             completion_mask=off(rows.completion_mask))
    zero = jnp.float32(0)
    return jax.lax.cond(
        jnp.any(need_X),
        lambda r: (logp_fn(r), count_fn(real_rows)[0], count_fn(r)[1]),
        lambda r: (skip(r), zero, zero), rows)

  out = jax.lax.map(chunk, (idx, need))
  logp = out if count_fn is None else out[0]
  t = rollout.completion_ids.shape[1]
  full = rollout.behaviour_logp.astype(jnp.float32).at[idx.reshape(-1)].set(
      logp.reshape(-1, t), mode="drop")
  if count_fn is None:
    return full
  return full, jnp.sum(out[1]), jnp.sum(out[2])


def interpolated(mu_UxT: jax.Array, logp_UxT: jax.Array, age_UxT: jax.Array,
                 update_fraction: jax.Array) -> jax.Array:
  """AReaL's log-linear estimate of log pi_prox (module docstring), no gradient.

  Args:
    mu_UxT: float32 [U, T] log mu of the rows' tokens.
    logp_UxT: float32 [U, T] log pi_theta from the loss pass (its gradient is stopped here).
    age_UxT: float32 [U, T] (or [U, 1]) updates since each token was drawn (step - its
      version; 0 on fresh tokens).
    update_fraction: float32 scalar u / U, the updates of this step made before this one.

  Returns:
    [U, T] float32 log pi_prox: mu on tokens of age 0, the interpolation elsewhere.
  """
  old = age_UxT > 0
  alpha = jnp.where(old, age_UxT / jnp.where(old, age_UxT + update_fraction, 1.0), 0.0)
  theta = jax.lax.stop_gradient(logp_UxT)
  return mu_UxT + alpha * (theta - mu_UxT)


def continued_rows(rollout: Rollout, step: jax.Array) -> jax.Array:
  """bool [N]: rows holding a real token drawn before ``step`` (a partial rollout continued
  across updates, or any row older than the step).

  Args:
    rollout: N rows with per-token versions ([N, T] ``version``).
    step: int32 the version being trained.
  """
  return jnp.any(rollout.completion_mask & (rollout.version < step), axis=-1)


def off_policy_first(off_policy_N: jax.Array, group_size: int) -> jax.Array:
  """int32 [N] every row of the batch, the off-policy ones first: ``gathered``'s bound when
  any row may need the pass (partial rollouts). Whole groups of G in the batch's order (a
  group with any off-policy row first) when N is a multiple of G, so each chunk of the pass
  runs the shared-prompt pass; else single rows.

  Args:
    off_policy_N: bool [N] the rows that need pi_prox.
    group_size: G.
  """
  n, g = off_policy_N.shape[0], group_size
  if n % g:
    return jnp.argsort(~off_policy_N, stable=True).astype(jnp.int32)
  order_B = jnp.argsort(~jnp.any(off_policy_N.reshape(n // g, g), axis=-1), stable=True)
  return (order_B[:, None] * g + jnp.arange(g)[None]).reshape(n).astype(jnp.int32)
