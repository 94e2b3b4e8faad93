"""POPO: group-prioritised off-policy optimisation on the on-device replay buffer.

POPO (Mao, Qu, Wang, Zou, Ji; arXiv 2606.01281) keeps a small FIFO buffer of recent *effective*
groups (success not constant within the group). Each step the slots of the ineffective fresh
groups are filled, one by one, with the most recently stored effective groups, so the batch
shape never changes and no extra rollouts are drawn; this step's effective groups are inserted
only after selection, so a group is never replayed in the step that produced it. Replayed
groups keep the advantages and behaviour log-probs frozen at insertion; the loss is the
decoupled objective (behaviour weight pi_prox / mu, trust region on pi_theta / pi_prox; see
losses.py). The paper publishes no equations or code: the open choices (capacity, one-shot or
repeated reuse, cap of the weight) are config fields.

The update batch is the effective fresh groups plus the replayed ones: an ineffective slot
the buffer cannot fill (fewer live groups than ineffective slots, e.g. early on or on a hard
task) leaves the loss and its denominators (``unfilled="drop"``, the default), exactly as
GRPO-filter drops it, so that POPO with an empty buffer *is* GRPO-filter and the POPO vs
GRPO-filter ablation compares refilling alone. ``unfilled="keep"`` keeps such groups in the
batch with advantage 0 (counted in the seq-mean and token-mean denominators, shrinking the
useful gradient by (effective + replayed) / B), for comparison.

Variants, by config: GRPO-filter (``fill="drop"``: ineffective groups leave the loss, nothing
refills them, and they leave its denominator too: see losses.aggregate), POPO-ineff
(``insert="all"``: the buffer takes every group), POPO-stale(s)
(``priority="staleness"``), POPO-KL (``priority="lowest_kl"``: the stored groups of smallest
KL(mu || pi_theta) to the current policy, estimated each step by one teacher-forced pass over
the buffer; ``stored_kl``), and two objectives for replayed rows besides the decoupled one
(``objective``, see objectives.OBJECTIVES): POPO-pi_old ("pi_old": replayed rows are treated as if
the current policy had sampled them: no behaviour weight, trust region around pi_prox) and
"align_mu" (the coupled objective: trust region around the behaviour policy, pi_prox :=
pi_gen, mu in the trainer's numerics: the "fully aligning to the behaviour policy" the
authors compare against).

Everything is [B, G, ...] arrays and masks: the number of groups replayed is a count inside a
fixed-shape batch, never a shape.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from grpo_jax import errors, registry
from grpo_jax.rl import losses
from grpo_jax.rl.replay import buffer
from grpo_jax.rl.replay.buffer import ReplayState
from grpo_jax.rl.replay.method import (METHODS, Composition, LogpFn, StepContext, flat_rows,
                                    fresh_composition, objective_field, validate_objective)

FILL_MODES = ("replay", "drop")
INSERT_MODES = ("effective", "all")
UNFILLED_MODES = ("drop", "keep")


@METHODS.register("popo")
@dataclasses.dataclass(frozen=True)
class Popo(registry.Configurable):
  """POPO and its ablations, as a replay method of the train step (see replay/method.py).

  Config group ``config.replay.popo``: every field but ``objective`` (``config.replay.objective``).

  Attributes:
    fill: "replay" (POPO: ineffective slots take stored groups) or "drop" (GRPO-filter:
      ineffective groups are masked out of the loss; no buffer is needed).
    insert: which fresh groups enter the buffer: "effective" (POPO) or "all" (POPO-ineff).
    priority: buffer.select priority ("recency" for POPO).
    staleness: for priority "staleness": replay groups about this many steps old.
    slots: static maximum of groups replayed per step (0 = B, every slot may be refilled).
    max_uses: an entry is dropped after this many replays (1 = one-shot; 0 = no limit).
    max_age: entries older than this many steps (step - the entry's version, its oldest
      token's, ``buffer.entry_version``: a continued row's tokens span versions) are never
      replayed (0 = no limit).
    objective: how replayed rows enter the loss, one of objectives.OBJECTIVES.
    unfilled: an ineffective slot left without a stored group: "drop" (out of the loss and its
      denominators: the batch is effective + replayed groups) or "keep" (in the batch with
      advantage 0).
  """
  # update.minibatches_are_groups: rows in whole groups of one prompt
  # (refills replace whole groups in place).
  whole_groups: ClassVar[bool] = True

  fill: str = "replay"
  insert: str = "effective"
  priority: str = "recency"
  staleness: int = 0
  slots: int = 0
  max_uses: int = 0
  max_age: int = 0
  objective: str = objective_field("decoupled")
  unfilled: str = "drop"

  def __post_init__(self):
    if self.fill not in FILL_MODES:
      raise ValueError(f"fill must be one of {FILL_MODES}, got {self.fill!r}")
    if self.unfilled not in UNFILLED_MODES:
      raise ValueError(f"unfilled must be one of {UNFILLED_MODES}, got {self.unfilled!r}")
    if self.insert not in INSERT_MODES:
      raise ValueError(f"insert must be one of {INSERT_MODES}, got {self.insert!r}")
    if self.priority not in buffer.PRIORITIES:
      raise ValueError(f"priority must be one of {buffer.PRIORITIES}, got {self.priority!r}")
    validate_objective(self.objective)
    if self.priority == "proportional":
      # select() needs a per-entry score and a key for it; whole-group POPO has neither.
      raise ValueError("priority 'proportional' needs per-entry scores, which whole-group "
                       "replay does not define; use recency, staleness or lowest_kl")
    for name in ("staleness", "slots", "max_uses", "max_age"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

  @classmethod
  def from_config(cls, config) -> Popo:
    return cls.from_group(config.replay.popo, objective=config.replay.objective)

  def check_config(self, config) -> None:
    """A buffer to refill from, and at most one refill per fresh group."""
    errors.check(self.fill != "replay" or config.replay.capacity > 0, "replay.capacity",
                 "must be > 0 when replay.popo.fill='replay' (POPO needs a buffer)")
    errors.check(self.slots <= config.rollout.batch_prompts, "replay.popo.slots",
                 f"{self.slots} exceeds batch_prompts={config.rollout.batch_prompts}")

  def entry_size(self, group_size: int) -> int:
    return group_size

  def extra_rows(self, num_rows: int, group_size: int) -> int:
    del num_rows, group_size
    return 0  # refills happen in place: the batch shape never changes

  def replays(self, replay: ReplayState) -> bool:
    return self.fill == "replay" and replay.capacity > 0

  def evict(self, replay: ReplayState, step: jax.Array) -> ReplayState:
    """Age and use-count eviction before selection."""
    return buffer.evict(replay, step, max_age=self.max_age or None,
                        max_uses=self.max_uses or None)

  def compose(self, ctx: StepContext, replay: ReplayState, logp_fn: LogpFn) -> Composition:
    """Fills the ineffective slots of the fresh batch from the buffer (or drops them).

    Slot b, the r-th ineffective one in batch order, takes the r-th selected entry while
    selected entries last; the ineffective slots left over leave the loss (``unfilled``).
    POPO-KL measures every stored group's KL to the current policy first (one teacher-forced
    pass over the buffer).
    """
    fresh, effective_B = ctx.fresh, ctx.effective
    b = effective_B.shape[0]
    drop_ineffective = fresh.completion_mask & effective_B[:, None, None]
    if self.fill == "drop":
      return fresh_composition(ctx, drop_ineffective)
    if not self.replays(replay):
      return fresh_composition(ctx, drop_ineffective if self.unfilled == "drop" else None)
    k = self.slots or b
    kl_C, logp_CxExT = (stored_kl(replay, logp_fn) if self.priority == "lowest_kl"
                        else (None, None))
    indices_K, ok_K = buffer.select(replay, k, self.priority, step=ctx.step,
                                    staleness=self.staleness, score_C=kl_C)
    # Valid selections come first (top-k order), so "r < number valid" is the test.
    rank_B = jnp.cumsum((~effective_B).astype(jnp.int32)) - 1
    replayed_B = ~effective_B & (rank_B < jnp.sum(ok_K.astype(jnp.int32)))
    source_B = indices_K[jnp.clip(rank_B, 0, k - 1)]
    stored = jax.tree.map(lambda x: x[source_B], replay.rollouts)

    def pick(fresh_x, stored_x):
      cond = replayed_B.reshape((b,) + (1,) * (fresh_x.ndim - 1))
      return jnp.where(cond, stored_x, fresh_x)

    rollout = jax.tree.map(pick, fresh, stored)
    used_K = ok_K & (jnp.arange(k) < jnp.sum(replayed_B.astype(jnp.int32)))
    g = fresh.completion_ids.shape[1]
    fresh_mask = drop_ineffective if self.unfilled == "drop" else fresh.completion_mask
    metrics = {"replay_slots_filled": jnp.sum(replayed_B.astype(jnp.float32)),
               "replay_slots_unfilled": jnp.sum((~effective_B & ~replayed_B).astype(
                   jnp.float32))}
    prox = None
    if kl_C is not None:
      metrics["replay_kl_selected"] = jnp.sum(jnp.where(used_K, kl_C[indices_K], 0.0)) / (
          jnp.maximum(jnp.sum(used_K.astype(jnp.float32)), 1.0))
      # POPO-KL's pass over the buffer is pi_prox of every stored group: no second pass.
      prox = flat_rows(pick(fresh.behaviour_logp, logp_CxExT[source_B]))
    # At most k slots are refilled: the step's pi_prox pass needs those k groups only (the
    # refilled slots first, then others to fill the static k).
    slots_K = jnp.argsort(~replayed_B, stable=True)[:k].astype(jnp.int32)
    return Composition(
        rollout=jax.tree.map(flat_rows, rollout),
        advantages=flat_rows(pick(ctx.advantages, replay.advantages[source_B])),
        loss_mask=flat_rows(pick(fresh_mask, stored.completion_mask)),
        replayed=jnp.repeat(replayed_B, g),
        gen_logp=flat_rows(pick(fresh.behaviour_logp, replay.gen_logp[source_B])),
        prox_logp=prox, selection=(indices_K, used_K), metrics=metrics,
        prox_rows=(slots_K[:, None] * g + jnp.arange(g, dtype=jnp.int32)).reshape(-1))

  def after_update(self, ctx: StepContext, replay: ReplayState,
                   comp: Composition) -> tuple[ReplayState, dict]:
    """After the update: count the uses, then store this step's effective groups (or all)."""
    if not self.replays(replay):
      return replay, {}
    replay = buffer.mark_used(replay, *comp.selection)
    keep = ctx.effective if self.insert == "effective" else jnp.ones_like(ctx.effective)
    return buffer.insert(replay, ctx.fresh, ctx.advantages, keep,
                         gen_logp_MxExT=ctx.fresh_gen_logp), {}


def stored_kl(replay: ReplayState, logp_fn: LogpFn) -> tuple[jax.Array, jax.Array]:
  """KL(mu || pi_theta) [C] of every stored entry under the current policy (POPO-KL's priority),
  and the pass's [C, E, T] log-probs (the entries' pi_prox).

  The entry's tokens were sampled from its behaviour policy mu, so the per-token k3 estimator
  r - 1 - log r with r = pi_theta / mu (Schulman 2020; unbiased for KL(mu || pi_theta) under
  mu, and >= 0) averaged over the entry's tokens estimates the KL "to the current policy" that
  POPO-KL ranks by (arXiv 2606.01281). Unlike the mean squared log-ratio it weighs a token
  the policy has come to prefer (r > 1) less than one it has come to avoid (r < 1). mu is read
  as the trainer computed it at generation (``ReplayState.gen_logp``), so that under bfloat16 the
  sampler/trainer mismatch does not rank the entries.
  """
  rows = jax.tree.map(flat_rows, replay.rollouts)
  logp_NxT = logp_fn(rows)
  k3 = losses.kl_penalty(flat_rows(replay.gen_logp), logp_NxT, "k3")
  mask = rows.completion_mask.astype(jnp.float32)
  c = replay.capacity
  per_entry = jnp.sum((k3 * mask).reshape(c, -1), axis=1)
  kl_C = per_entry / jnp.maximum(jnp.sum(mask.reshape(c, -1), axis=1), 1.0)
  return kl_C, logp_NxT.reshape(replay.gen_logp.shape)
