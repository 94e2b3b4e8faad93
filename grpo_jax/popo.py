"""POPO: group-prioritised off-policy optimisation on the on-device replay buffer.

POPO (Mao, Qu, Wang, Zou, Ji; arXiv 2606.01281) keeps a small FIFO buffer of recent *effective*
groups (success not constant within the group). Each step the slots of the ineffective fresh
groups are filled, one by one, with the most recently stored effective groups, so the batch
shape never changes and no extra rollouts are drawn; this step's effective groups are inserted
only after selection, so a group is never replayed in the step that produced it. Replayed
groups keep the advantages and behaviour log-probs frozen at insertion; the loss is the
decoupled objective (behaviour weight pi_prox / mu, trust region on pi_theta / pi_prox; see
losses.py). The paper publishes no equations or code: the open choices (capacity, one-shot or
repeated reuse, cap of the weight) are config fields (METHODS.md section 1, [R]).

Variants, by config: GRPO-filter (``fill="drop"``: ineffective groups leave the loss, nothing
refills them), POPO-ineff (``insert="all"``: the buffer takes every group), POPO-stale(s)
(``priority="staleness"``), POPO-KL (``priority="lowest_drift"`` with the drift of every stored
group measured against the current policy each step), and two objectives for replayed rows
besides the decoupled one (``objective``, see OBJECTIVES): POPO-pi_old ("pi_old": replayed rows
are treated as if the current policy had sampled them: no behaviour weight, trust region around
pi_prox) and "align_mu" (the coupled objective: trust region around the behaviour policy,
pi_prox := mu, the "fully aligning to the behaviour policy" the authors compare against).

Everything is [B, G, ...] arrays and masks: the number of groups replayed is a count inside a
fixed-shape batch, never a shape.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp

from grpo_jax import replay as replay_lib
from grpo_jax.replay import ReplayState
from grpo_jax.types import Rollout

FILL_MODES = ("none", "replay", "drop")
INSERT_MODES = ("effective", "all")
# How replayed rows enter the loss (w = behaviour weight, rho = trust-region ratio):
#   decoupled  w = pi_prox / mu (capped), rho = pi_theta / pi_prox   POPO; Hilton et al. 2110.00641
#   pi_old     w = 1,                     rho = pi_theta / pi_prox   replay taken as on-policy
#   align_mu   w = 1,                     rho = pi_theta / mu        coupled PPO around mu
OBJECTIVES = ("decoupled", "pi_old", "align_mu")


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  """Static replay settings of the train step.

  Attributes:
    fill: "none" (plain GRPO), "replay" (POPO: ineffective slots take stored groups), "drop"
      (GRPO-filter: ineffective groups are masked out of the loss).
    insert: which fresh groups enter the buffer: "effective" (POPO) or "all" (POPO-ineff).
    priority: replay.select priority ("recency" for POPO).
    staleness: for priority "staleness": replay groups about this many steps old.
    slots: static maximum of groups replayed per step (0 = B, every slot may be refilled).
    max_uses: an entry is dropped after this many replays (1 = one-shot; 0 = no limit).
    max_age: entries older than this many steps (step - version stamp) are never replayed
      (0 = no limit).
    objective: how replayed rows enter the loss, one of OBJECTIVES.
  """

  fill: str = "none"
  insert: str = "effective"
  priority: str = "recency"
  staleness: int = 0
  slots: int = 0
  max_uses: int = 0
  max_age: int = 0
  objective: str = "decoupled"

  def __post_init__(self):
    if self.fill not in FILL_MODES:
      raise ValueError(f"fill must be one of {FILL_MODES}, got {self.fill!r}")
    if self.insert not in INSERT_MODES:
      raise ValueError(f"insert must be one of {INSERT_MODES}, got {self.insert!r}")
    if self.priority not in replay_lib.PRIORITIES:
      raise ValueError(f"priority must be one of {replay_lib.PRIORITIES}, got {self.priority!r}")
    if self.objective not in OBJECTIVES:
      raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
    if self.priority == "proportional":
      # select() needs a per-entry score and a key for it; whole-group POPO has neither.
      raise ValueError("priority 'proportional' needs per-entry scores, which whole-group "
                       "replay does not define; use recency, staleness or lowest_drift")
    for name in ("staleness", "slots", "max_uses", "max_age"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@flax.struct.dataclass
class Composition:
  """The fixed-shape batch after replay, and what was replayed.

  Attributes:
    rollout: Rollout [B, G, ...] (fresh groups, some slots replaced by stored ones).
    advantages_BxG: fresh advantages, stored (frozen) ones in replayed slots.
    loss_mask_BxGxT: completion mask, zeroed for dropped groups (GRPO-filter).
    replayed_B: bool, the slot holds a replayed group.
    indices_K, used_K: buffer entries selected and actually used.
  """

  rollout: Rollout
  advantages_BxG: jax.Array
  loss_mask_BxGxT: jax.Array
  replayed_B: jax.Array
  indices_K: jax.Array
  used_K: jax.Array


def compose(fresh: Rollout, advantages_BxG: jax.Array, effective_B: jax.Array,
            replay: ReplayState, step: jax.Array, config: ReplayConfig,
            drift_C: jax.Array | None = None) -> Composition:
  """Fills the ineffective slots of the fresh batch from the buffer (or drops them).

  Args:
    fresh: this step's rollouts as [B, G, ...] arrays.
    advantages_BxG: their advantages.
    effective_B: which fresh groups are effective.
    replay: the buffer, already evicted.
    step: the current policy step (for the staleness priority).
    config: ReplayConfig.
    drift_C: drift of every entry under the current policy (for "lowest_drift").

  Returns:
    The Composition.
  """
  b = effective_B.shape[0]
  mask = fresh.completion_mask_NxT
  if config.fill == "drop":
    mask = mask & effective_B[:, None, None]
  if config.fill != "replay" or replay.capacity == 0:
    k = 0
    return Composition(fresh, advantages_BxG, mask, jnp.zeros((b,), bool),
                       jnp.zeros((k,), jnp.int32), jnp.zeros((k,), bool))
  k = config.slots or b
  if drift_C is not None:
    replay = replay.replace(drift_C=drift_C)
  indices_K, ok_K = replay_lib.select(replay, k, config.priority, step=step,
                                      staleness=config.staleness)
  # Slot b is the r-th ineffective slot; it takes selected entry r while entries last. Valid
  # selections come first (top-k order), so "r < number valid" is the test.
  rank_B = jnp.cumsum((~effective_B).astype(jnp.int32)) - 1
  replayed_B = ~effective_B & (rank_B < jnp.sum(ok_K.astype(jnp.int32)))
  source_B = indices_K[jnp.clip(rank_B, 0, k - 1)]
  stored = jax.tree.map(lambda x: x[source_B], replay.rollouts)

  def pick(fresh_x, stored_x):
    cond = replayed_B.reshape((b,) + (1,) * (fresh_x.ndim - 1))
    return jnp.where(cond, stored_x, fresh_x)

  rollout = jax.tree.map(pick, fresh, stored)
  advantages = pick(advantages_BxG, replay.advantages_CxE[source_B])
  used_K = ok_K & (jnp.arange(k) < jnp.sum(replayed_B.astype(jnp.int32)))
  return Composition(rollout, advantages, pick(mask, stored.completion_mask_NxT), replayed_B,
                     indices_K, used_K)


def insert_fresh(replay: ReplayState, fresh: Rollout, advantages_BxG: jax.Array,
                 effective_B: jax.Array, step: jax.Array, config: ReplayConfig) -> ReplayState:
  """Stores this step's groups after selection: effective ones (POPO) or all (POPO-ineff)."""
  if config.fill != "replay":
    return replay
  keep = effective_B if config.insert == "effective" else jnp.ones_like(effective_B)
  return replay_lib.insert(replay, fresh, advantages_BxG, keep, step)


def evict(replay: ReplayState, step: jax.Array, config: ReplayConfig) -> ReplayState:
  """Age and use-count eviction before selection."""
  return replay_lib.evict(replay, step, max_age=config.max_age or None,
                          max_uses=config.max_uses or None)
