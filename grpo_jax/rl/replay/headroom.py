"""Headroom-Drift replay (Park & Chang, arXiv 2609.03941).

The buffer holds whole *mixed-outcome* groups (E = G), immutable once stored, each with its
generation-time log-probs pi_gen, frozen advantages and a cached headroom. Per step:

1. The top-M stored groups by cached headroom H (M static) are the candidates
   (``order="fifo"``, the drift-only ablation: the M oldest instead).
2. One teacher-forced pass over the M candidates at the start-of-step policy gives each its
   drift D = mean (log pi_theta - log pi_gen)^2 and a fresh H; the cache is refreshed with both.
   pi_gen is the trainer's log-probs at generation (``buffer.ReplayState.gen_logp``), so
   under bfloat16 D measures the policy's movement, not the sampler/trainer mismatch.
3. Walking the candidates in order, a group is admitted while D <= tau, until K_rep groups
   (``gate=False``, the headroom-only ablation: the first K_rep, no gate). With
   ``candidate_chunks`` = n > 1 the pass of step 2 walks with it, M / n candidates at a time,
   and stops once K_rep are admitted: the admitted groups are the same, and the candidates
   after them keep their last measured H and D, as every entry outside the top M does (the
   ranking of step 1 is always by the last measured H). The pass then costs what the walk
   reads, which is little when most candidates pass.
4. The update runs on the fresh groups plus the admitted ones (K_rep * G extra rows, masked
   where fewer were admitted); a replayed group's ratio denominator is pi_gen (objective
   "align_mu", the paper's L_mix), or pi_prox from the same pass ("decoupled": no extra pass).
5. Only after the update this step's mixed-outcome groups are appended, so a group is never
   replayed in the step that produced it.

Headroom uses only the sign of the advantage: h = 1 - pi(o_t) where A > 0, pi(o_t) where A < 0
(the sign-only form beat the advantage-weighted one in the paper). Proposition 2 of the paper:
a group that passes the gate has |H_now - H_stored| <= sqrt(tau).

Choices the paper leaves open, as config fields: K_rep (``slots``, default 8 of 32 groups),
M (``candidates``, default 2 * K_rep: one pass over 16 groups, half a batch), ``capacity``
(configs), and what H a new group starts with (its headroom under pi_gen, which is the
start-of-step policy for fresh rows).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from grpo_jax import errors, registry
from grpo_jax.rl.replay import buffer
from grpo_jax.rl.replay.buffer import ReplayState
from grpo_jax.rl.replay.method import (METHODS, Composition, LogpFn, PolicyPass, StepContext,
                                       flat_rows, fresh_anchored, no_rows, objective_field,
                                       validate_objective)

ORDERS = ("headroom", "fifo")


def group_headroom(policy_logp_GxT: jax.Array, advantages_G: jax.Array,
                   mask_GxT: jax.Array) -> jax.Array:
  """Headroom H of one group: the mean over its unmasked tokens of 1 - pi(o_t) where A > 0 and
  pi(o_t) where A < 0; tokens of rows with A = 0 count as 0 and still count in the mean.

  Reference: Headroom-Drift replay, arXiv 2609.03941 (sign-only headroom).
  """
  p = jnp.exp(policy_logp_GxT.astype(jnp.float32))
  a = advantages_G[:, None]
  h = jnp.where(a > 0, 1.0 - p, jnp.where(a < 0, p, 0.0))
  m = mask_GxT.astype(jnp.float32)
  return jnp.sum(h * m) / jnp.maximum(jnp.sum(m), 1.0)


def group_drift(policy_logp_GxT: jax.Array, behaviour_logp_GxT: jax.Array,
                mask_GxT: jax.Array) -> jax.Array:
  """Drift D of one group: the mean over unmasked tokens of (log pi_theta - log pi_gen)^2.

  Squared, so shifts of opposite sign cannot cancel (arXiv 2609.03941).
  """
  d = jnp.square(policy_logp_GxT.astype(jnp.float32) - behaviour_logp_GxT.astype(jnp.float32))
  m = mask_GxT.astype(jnp.float32)
  return jnp.sum(d * m) / jnp.maximum(jnp.sum(m), 1.0)


@METHODS.register("headroom")
@dataclasses.dataclass(frozen=True)
class HeadroomDrift(registry.Configurable):
  """Headroom-Drift replay as a replay method of the train step.

  Config group ``config.replay.headroom``: every field but ``objective``
  (``config.replay.objective``).

  Attributes:
    slots: K_rep, groups replayed per step at most (static).
    candidates: M, groups evaluated per step (static, >= slots).
    tau: drift threshold; a group is admitted only if D <= tau.
    gate: apply the drift gate (False: the headroom-only ablation).
    order: "headroom" (cached H, descending) or "fifo" (oldest first: the drift-only ablation).
    max_age: entries older than this many steps are dropped (0 = only FIFO overwrite).
    candidate_chunks: the candidates are teacher-forced in this many chunks of M / n, in walk
      order, a chunk skipped once K_rep groups are admitted (1: one pass over all M).
    objective: how replayed rows enter the loss (objectives.OBJECTIVES); "align_mu" as the paper.
  """
  # update.minibatches_are_groups: rows in whole groups of one prompt
  # (admitted groups are appended whole).
  whole_groups: ClassVar[bool] = True

  slots: int = 8
  candidates: int = 16
  tau: float = 1e-3
  gate: bool = True
  order: str = "headroom"
  max_age: int = 0
  candidate_chunks: int = 1
  objective: str = objective_field("align_mu")

  def __post_init__(self):
    validate_objective(self.objective)
    if self.order not in ORDERS:
      raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
    if self.slots < 1 or self.candidates < self.slots:
      raise ValueError(f"need 1 <= slots <= candidates, got slots={self.slots}, "
                       f"candidates={self.candidates}")
    if self.tau <= 0 or self.max_age < 0:
      raise ValueError(f"tau must be > 0 and max_age >= 0, got {self.tau}, {self.max_age}")
    if self.candidate_chunks < 1 or self.candidates % self.candidate_chunks:
      raise ValueError(f"candidate_chunks must be >= 1 and divide candidates={self.candidates}, "
                       f"got {self.candidate_chunks}")

  @classmethod
  def from_config(cls, config) -> HeadroomDrift:
    return cls.from_group(config.replay.headroom, objective=config.replay.objective)

  def check_config(self, config) -> None:
    errors.check(config.replay.capacity >= self.candidates, "replay.capacity",
                 f"{config.replay.capacity} must be >= replay.headroom.candidates="
                 f"{self.candidates} (groups evaluated per step)")

  def entry_size(self, group_size: int) -> int:
    return group_size

  def extra_rows(self, num_rows: int, group_size: int) -> int:
    del num_rows
    return self.slots * group_size

  def replays(self, replay: ReplayState) -> bool:
    return replay.capacity > 0

  def evict(self, replay: ReplayState, step: jax.Array) -> ReplayState:
    return buffer.evict(replay, step, max_age=self.max_age or None)

  def compose(self, ctx: StepContext, replay: ReplayState, logp_fn: LogpFn) -> Composition:
    """Fresh rows, then up to K_rep admitted groups (K_rep * G rows, masked when fewer)."""
    k, m = self.slots, self.candidates
    g = ctx.fresh.completion_ids.shape[1]
    if not self.replays(replay):
      return fresh_anchored(ctx, *no_rows(ctx, k * g))
    if replay.capacity < m:
      raise ValueError(f"Headroom-Drift needs a buffer of at least candidates={m} groups, "
                       f"got capacity {replay.capacity}")
    if self.order == "headroom":
      key_C = replay.headroom
    else:  # oldest first
      key_C = -replay.inserted.astype(jnp.float32)
    key_C = jnp.where(replay.valid, key_C, -jnp.inf)
    top_M, cand_M = jax.lax.top_k(key_C, m)
    ok_M = jnp.isfinite(top_M)
    cand = jax.tree.map(lambda x: x[cand_M], replay.rollouts)  # [M, G, ...]
    adv_MxG = replay.advantages[cand_M]
    gen_MxGxT = replay.gen_logp[cand_M]
    logp_MxGxT, drift_M, head_M, passes_M, scored_M, real, computed = self._walk(
        cand, adv_MxG, gen_MxGxT, ok_M, replay.drift[cand_M], replay.headroom[cand_M], logp_fn)
    counted = ({"headroom_candidate_pass_useful_fraction": real / jnp.maximum(computed, 1.0)}
               if isinstance(logp_fn, PolicyPass) else {})
    admitted_M = passes_M & (jnp.cumsum(passes_M.astype(jnp.int32)) <= k)
    # Slot j takes the j-th admitted candidate (stable order keeps the walk's order).
    order_M = jnp.argsort(~admitted_M, stable=True)
    take_K = order_M[:k]
    slot_ok_K = jnp.arange(k) < jnp.sum(admitted_M.astype(jnp.int32))
    pick = lambda x: x[take_K].reshape((k * g,) + x.shape[2:])
    num_ok = jnp.maximum(jnp.sum(scored_M.astype(jnp.float32)), 1.0)
    num_adm = jnp.sum(admitted_M.astype(jnp.float32))
    mean_over = lambda x, w: jnp.sum(jnp.where(w, x, 0.0)) / jnp.maximum(
        jnp.sum(w.astype(jnp.float32)), 1.0)
    return fresh_anchored(
        ctx, jax.tree.map(pick, cand), pick(adv_MxG), jnp.repeat(slot_ok_K, g),
        gen_logp_RxT=pick(gen_MxGxT), prox_logp_RxT=pick(logp_MxGxT),
        selection=(cand_M, scored_M, admitted_M, drift_M, head_M),
        metrics={
            "headroom_admitted": num_adm,
            "headroom_accept_rate": jnp.sum(passes_M.astype(jnp.float32)) / num_ok,
            "headroom_candidates": jnp.sum(scored_M.astype(jnp.float32)),
            "headroom_candidate_drift": mean_over(drift_M, scored_M),
            "headroom_candidate_h": mean_over(head_M, scored_M),
            "headroom_admitted_drift": mean_over(drift_M, admitted_M),
            "headroom_admitted_h": mean_over(head_M, admitted_M),
            **counted,
        })

  def _walk(self, cand, adv_MxG, gen_MxGxT, ok_M, cached_drift_M, cached_head_M, logp_fn):
    """The teacher-forced pass over the candidates in walk order (module docstring, 2-3).

    Args:
      cand: Rollout of [M, G, ...] candidate groups, in walk order.
      adv_MxG: float32 their frozen advantages.
      gen_MxGxT: float32 their pi_gen.
      ok_M: bool, the candidate is a live entry.
      cached_drift_M, cached_head_M: float32, their last measured D and H.
      logp_fn: Rollout of n rows -> [n, T] log pi_theta at the start-of-step policy (a
        ``PolicyPass`` also counts its tokens).

    Returns:
      ([M, G, T] log pi_theta (pi_gen where not scored), [M] D, [M] H (the cached values where
      not scored), [M] bool passes the gate, [M] bool scored this step, and the pass's float32
      real tokens and positions computed over the chunks that ran: 0 and 0 unless ``logp_fn``
      is a ``PolicyPass``).
    """
    m, g = adv_MxG.shape
    k, n = self.slots, self.candidate_chunks
    zero = jnp.float32(0)

    def score(cand, adv, gen, ok):
      rows = jax.tree.map(flat_rows, cand)
      logp = logp_fn(rows).reshape(gen.shape)
      drift = jax.vmap(group_drift)(logp, gen, cand.completion_mask)
      head = jax.vmap(group_headroom)(logp, adv, cand.completion_mask)
      passes = ok & (drift <= self.tau) if self.gate else ok
      real, computed = (logp_fn.count(rows) if isinstance(logp_fn, PolicyPass)
                        else (zero, zero))
      return logp, drift, head, passes, real, computed

    if n == 1:
      logp, drift, head, passes, real, computed = score(cand, adv_MxG, gen_MxGxT, ok_M)
      return logp, drift, head, passes, ok_M, real, computed
    chunked = lambda x: x.reshape((n, m // n) + x.shape[1:])
    xs = jax.tree.map(chunked, (cand, adv_MxG, gen_MxGxT, ok_M, cached_drift_M, cached_head_M))

    def chunk(passed, x):
      cand_X, adv_X, gen_X, ok_X, drift_X, head_X = x
      skip = lambda *_: (gen_X, drift_X, head_X, jnp.zeros_like(ok_X), zero, zero)
      run = passed < k  # fewer than K_rep admitted so far: the walk reads this chunk
      logp, drift, head, passes, real, computed = jax.lax.cond(run, score, skip, cand_X, adv_X,
                                                               gen_X, ok_X)
      return (passed + jnp.sum(passes.astype(jnp.int32)),
              (logp, drift, head, passes, ok_X & run, real, computed))

    _, out = jax.lax.scan(chunk, jnp.int32(0), xs)
    *per_m, real, computed = out
    return (*(x.reshape((m,) + x.shape[2:]) for x in per_m), jnp.sum(real), jnp.sum(computed))

  def after_update(self, ctx: StepContext, replay: ReplayState,
                   comp: Composition) -> tuple[ReplayState, dict]:
    """After the update: refresh the candidates' cached H and D, count uses, append this
    step's mixed-outcome groups with their headroom under pi_gen."""
    if not self.replays(replay):
      return replay, {}
    cand_M, scored_M, admitted_M, drift_M, head_M = comp.selection
    c = replay.capacity
    slot_M = jnp.where(scored_M, cand_M, c)
    replay = replay.replace(
        headroom=replay.headroom.at[slot_M].set(head_M, mode="drop"),
        drift=replay.drift.at[slot_M].set(drift_M, mode="drop"))
    replay = buffer.mark_used(replay, cand_M, admitted_M)
    fresh = ctx.fresh
    head_B = jax.vmap(group_headroom)(ctx.fresh_gen_logp, ctx.advantages,
                                      fresh.completion_mask)
    replay = buffer.insert(replay, fresh, ctx.advantages, ctx.effective,
                           headroom_M=head_B, gen_logp_MxExT=ctx.fresh_gen_logp)
    return replay, {}

