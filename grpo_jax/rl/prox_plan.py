"""How a train step gets pi_prox, decided once: the static plan every stage of the step reads.

pi_prox, the policy at the start of the step, is the trust region's centre and the behaviour
weight's numerator of the decoupled objective (Hilton, Cobbe, Schulman, arXiv 2110.00641).
Fresh rows have it for free (pi_prox = mu, same numerics); off-policy rows (replayed from a
buffer; under partial rollouts, continued from earlier steps) need a no-grad pass at the
start-of-step parameters, or its interpolation (``prox.interpolated``), or the replay method's
own pass over its candidates (``Composition.prox_logp``: POPO-KL's divergence pass,
Headroom's candidate pass). Which of these runs, over which rows, depends only on static
facts: the step's config (``prox_pass``, ``prox_estimate``, ``prox_chunks``, ``continued``:
the run config's one ``prox`` group, ``rows``, ``estimate``, ``chunks`` and ``continued``; and
the objective), whether the method replays, and whether it measured or bounded its rows.
``plan`` turns those facts into a ``ProxPlan`` once; ``proximal_pass`` runs the pass it names,
and the step's sampler mismatch metric and update batch read the same plan instead of
re-deriving the decision.

The decision, in order (the first that applies):

========================================  ======================================  =========
facts                                     the pass (``rows``)                     loss
========================================  ======================================  =========
``prox_pass="all"``                       every row (bfloat16's sampler/trainer   exact
                                          mismatch: fresh rows too)
no off-policy row, or an objective        none                                    mu
without pi_prox (``align_mu``)
``prox_estimate="interpolate"``           none                                    interp.
continued rows, ``prox_chunks`` > 0       the rows that need it, off-policy       exact
                                          first, in chunks (``needed``)
continued rows                            the whole batch (``batch``)             exact
the method measured its rows              none (the method's values)              exact
``prox_chunks`` > 0 and a bound           the method's bound, in chunks           exact
                                          (``method``)
otherwise                                 the whole batch (``batch``)             exact
========================================  ======================================  =========

With continued rows a method's own values cover only the rows it replayed: the pass covers
the others and the method's values replace the pass's on the rows it measured (``merge``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from grpo_jax.rl import replay_objectives
from grpo_jax.rl import off_policy_prox as prox_lib

# Which rows the no-grad pass at the start-of-step parameters computes.
ROWS = ("none", "every", "batch", "method", "needed")


@dataclasses.dataclass(frozen=True)
class ProxPlan:
  """The step's pi_prox decision (static; built by ``plan``).

  Attributes:
    rows: which rows the pass computes: "none" (no pass), "every" (every row, fresh ones
      included: ``prox_pass="all"``), "batch" (the whole batch in one pass, for the
      off-policy rows), "method" (the rows the method may replay, ``Composition.prox_rows``,
      replayed first, in ``chunks`` chunks: ``prox.gathered``), "needed" (the rows that need
      it, off-policy first, in ``chunks`` chunks: ``prox.off_policy_first``).
    chunks: the gathered pass's chunks (``prox_chunks``).
    replaying: the method can replay (its buffer has capacity).
    corrects: any row may be off-policy in the loss (replaying, or continued rows).
    measured: the method measured pi_prox of the rows it replayed (``Composition.prox_logp``).
    merge: the method's values replace the pass's on the rows it measured (continued rows
      beside a measuring method: its values cover only the replayed rows).
    interpolate: the loss interpolates pi_prox of the off-policy rows it has no value for, per
      token from its age (``prox.interpolated``), in each update.
    denominators: the objective's denominators replace mu / pi_prox on the off-policy rows
      whose values are known when the batch is built (``replay_objectives.py``).
    prox_from: where those denominators' pi_prox comes from: "pass", "method", or None (the
      objective needs none).
  """

  rows: str
  chunks: int
  replaying: bool
  corrects: bool
  measured: bool
  merge: bool
  interpolate: bool
  denominators: bool
  prox_from: str | None

  @property
  def every_row(self) -> bool:
    """The pass covers the fresh rows too: their pi_prox is the trainer's, not the sampler's
    mu (the loss's ratio starts at 1 exactly, and the behaviour weight corrects the
    mismatch)."""
    return self.rows == "every"

  def measured_rows(self, replayed_N: jax.Array) -> jax.Array:
    """bool [N]: the rows whose pi_prox the method measured (its replayed rows, or none)."""
    return replayed_N if self.measured else jnp.zeros_like(replayed_N)


def plan(config, replaying: bool, measured: bool, bounded: bool) -> ProxPlan:
  """The step's pi_prox plan from its static facts (module docstring's table).

  Args:
    config: StepConfig (``prox_pass``, ``prox_estimate``, ``prox_chunks``, ``continued``, the
      replay method's objective).
    replaying: the method can replay (``ReplayMethod.replays``).
    measured: the method's composition carries its own pi_prox of the replayed rows
      (``Composition.prox_logp`` is not None).
    bounded: the composition bounds the rows it may replay (``Composition.prox_rows`` is not
      None).

  Returns:
    The ProxPlan.
  """
  corrects = replaying or config.continued
  objective_uses_prox = replay_objectives.OBJECTIVES[config.replay.objective].uses_prox
  uses_prox = corrects and objective_uses_prox
  if config.prox_pass == "all":
    rows = "every"
  elif not uses_prox or config.prox_estimate == "interpolate":
    rows = "none"
  elif config.continued:
    rows = "needed" if config.prox_chunks else "batch"
  elif measured:
    rows = "none"
  elif config.prox_chunks and bounded:
    rows = "method"
  else:
    rows = "batch"
  interpolate = (uses_prox and config.prox_estimate == "interpolate" and rows == "none"
                 and (not measured or config.continued))
  return ProxPlan(
      rows=rows, chunks=config.prox_chunks, replaying=replaying, corrects=corrects,
      measured=measured,
      merge=config.continued and measured and rows in ("batch", "needed"),
      interpolate=interpolate,
      denominators=corrects and (not objective_uses_prox or rows != "none" or measured),
      prox_from=None if not objective_uses_prox else "pass" if rows != "none" else "method")


def proximal_pass(plan: ProxPlan, comp, off_policy_N: jax.Array, start_pass,
                  group_size: int) -> tuple[jax.Array | None, tuple | None]:
  """The no-grad pass at the start-of-step parameters over the rows ``plan.rows`` names.

  Args:
    plan: the step's ProxPlan.
    comp: the ``replay.method.Composition`` of N + R rows.
    off_policy_N: bool [N + R] the rows the objective corrects (replayed, and continued ones).
    start_pass: the start-of-step pass (``replay.method.PolicyPass``: n rows -> [n, T] log
      pi_prox, and ``count`` of its tokens).
    group_size: G.

  Returns:
    ([N + R, T] float32 log pi_prox (exact on every off-policy row; mu or the pass on the
    others), or None when the plan runs no pass; the gathered pass's (real tokens, positions
    computed) over its chunks that ran, or None when no gathered pass ran).
  """
  if plan.rows == "none":
    return None, None
  counts = None
  if plan.rows in ("every", "batch"):
    full_NxT = start_pass(comp.rollout)
  else:
    if plan.rows == "method":  # the method's bound, its replayed rows first
      need_N, rows_M = comp.replayed, comp.prox_rows
    else:  # "needed": any row may be continued; the ones the method did not measure
      need_N = off_policy_N & ~plan.measured_rows(comp.replayed)
      rows_M = prox_lib.off_policy_first(need_N, group_size)
    full_NxT, real, computed = prox_lib.gathered(comp.rollout, need_N, rows_M, start_pass,
                                                 plan.chunks, group_size, start_pass.count)
    counts = (real, computed)
  if plan.merge:
    full_NxT = jnp.where(plan.measured_rows(comp.replayed)[:, None], comp.prox_logp, full_NxT)
  return full_NxT, counts


def pass_metrics(counts) -> dict:
  """``prox_pass_useful_fraction``: the gathered pass's real tokens over the positions its
  chunks that ran computed (``prox.gathered``), when such a pass ran; else nothing."""
  if counts is None:
    return {}
  real, computed = counts
  return {"prox_pass_useful_fraction": real / jnp.maximum(computed, 1.0)}
