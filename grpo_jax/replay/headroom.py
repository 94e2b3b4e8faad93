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
   (``gate=False``, the headroom-only ablation: the first K_rep, no gate).
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

import jax
import jax.numpy as jnp

from grpo_jax import errors, registry
from grpo_jax.replay import buffer
from grpo_jax.replay.buffer import ReplayState
from grpo_jax.replay.method import (METHODS, Composition, LogpFn, StepContext, flat_rows,
                                    fresh_anchored, no_rows, objective_field,
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
class HeadroomConfig(registry.Configurable):
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
    objective: how replayed rows enter the loss (method.OBJECTIVES); "align_mu" as the paper.
  """

  slots: int = 8
  candidates: int = 16
  tau: float = 1e-3
  gate: bool = True
  order: str = "headroom"
  max_age: int = 0
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

  @classmethod
  def from_config(cls, config) -> HeadroomConfig:
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
    logp_MxGxT = logp_fn(jax.tree.map(flat_rows, cand)).reshape(cand.behaviour_logp.shape)
    gen_MxGxT = replay.gen_logp[cand_M]
    drift_M = jax.vmap(group_drift)(logp_MxGxT, gen_MxGxT, cand.completion_mask)
    head_M = jax.vmap(group_headroom)(logp_MxGxT, adv_MxG, cand.completion_mask)
    passes_M = ok_M & (drift_M <= self.tau) if self.gate else ok_M
    admitted_M = passes_M & (jnp.cumsum(passes_M.astype(jnp.int32)) <= k)
    # Slot j takes the j-th admitted candidate (stable order keeps the walk's order).
    order_M = jnp.argsort(~admitted_M, stable=True)
    take_K = order_M[:k]
    slot_ok_K = jnp.arange(k) < jnp.sum(admitted_M.astype(jnp.int32))
    pick = lambda x: x[take_K].reshape((k * g,) + x.shape[2:])
    num_ok = jnp.maximum(jnp.sum(ok_M.astype(jnp.float32)), 1.0)
    num_adm = jnp.sum(admitted_M.astype(jnp.float32))
    mean_over = lambda x, w: jnp.sum(jnp.where(w, x, 0.0)) / jnp.maximum(
        jnp.sum(w.astype(jnp.float32)), 1.0)
    return fresh_anchored(
        ctx, jax.tree.map(pick, cand), pick(adv_MxG), jnp.repeat(slot_ok_K, g),
        gen_logp_RxT=pick(gen_MxGxT), prox_logp_RxT=pick(logp_MxGxT),
        selection=(cand_M, ok_M, admitted_M, drift_M, head_M),
        metrics={
            "headroom_admitted": num_adm,
            "headroom_accept_rate": jnp.sum(passes_M.astype(jnp.float32)) / num_ok,
            "headroom_candidates": jnp.sum(ok_M.astype(jnp.float32)),
            "headroom_candidate_drift": mean_over(drift_M, ok_M),
            "headroom_candidate_h": mean_over(head_M, ok_M),
            "headroom_admitted_drift": mean_over(drift_M, admitted_M),
            "headroom_admitted_h": mean_over(head_M, admitted_M),
        })

  def after_update(self, ctx: StepContext, replay: ReplayState,
                   comp: Composition) -> tuple[ReplayState, dict]:
    """After the update: refresh the candidates' cached H and D, count uses, append this
    step's mixed-outcome groups with their headroom under pi_gen."""
    if not self.replays(replay):
      return replay, {}
    cand_M, ok_M, admitted_M, drift_M, head_M = comp.selection
    c = replay.capacity
    slot_M = jnp.where(ok_M, cand_M, c)
    replay = replay.replace(
        headroom=replay.headroom.at[slot_M].set(head_M, mode="drop"),
        drift=replay.drift.at[slot_M].set(drift_M, mode="drop"))
    replay = buffer.mark_used(replay, cand_M, admitted_M)
    fresh = ctx.fresh
    head_B = jax.vmap(group_headroom)(ctx.fresh_gen_logp, ctx.advantages,
                                      fresh.completion_mask)
    replay = buffer.insert(replay, fresh, ctx.advantages, ctx.effective, ctx.step,
                           headroom_M=head_B, gen_logp_MxExT=ctx.fresh_gen_logp)
    return replay, {}

