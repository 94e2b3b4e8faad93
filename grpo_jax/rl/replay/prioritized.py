"""Rollout-level advantage-prioritised replay (Yoo, Park, Jang, Kim, Yoon; arXiv 2606.04560).

The buffer holds single rollouts (entry size E = 1): prompt, completion, behaviour log-probs,
the advantage frozen at insertion and a version stamp (its oldest token's version:
``buffer.entry_version``; age eviction reads it). Per step:

1. **Age eviction**, before the draw: an entry older than ``tau_max`` is never replayed
   again. The paper counts tau_max in gradient steps (``age_unit="updates"``: an entry v train
   steps old is v x ``updates_per_step`` updates old, updates_per_step = minibatches x
   epochs); ``age_unit="steps"`` counts train steps.
2. **Fresh-anchored composition**: the update batch is all N fresh rollouts followed by
   R = round(rho * N) replay rows, a fixed, larger shape, of which round(rho * F) are filled,
   F being the fresh rows that count in the loss (all N unless groups are dropped or empty);
   rows stay masked when the buffer holds fewer live entries, and during the first
   ``warmup_steps`` steps nothing is replayed. With ``drop_ineffective`` the fresh groups
   whose rewards do not vary leave the loss first (the reference implementation's filter).
3. **Priority** P(i) = (|A_i| + eps)^alpha / sum_j (|A_j| + eps)^alpha over live entries,
   drawn without replacement by Gumbel top-k on the device (no PER importance weights, as the
   paper's defaults [S]).
4. After the update this step's rollouts are inserted (never replayed in the step that made
   them).

Defaults (from a third-party implementation that states them as the paper's Table 7; not
checked against the paper itself): tau_max 10, rho 0.5, alpha 0.5, eps 1e-6, warm-up 20 steps. Replayed rows keep
their frozen advantage; the objective defaults to "align_mu": the paper's ratio pi_theta /
mu_birth, as pi_theta / pi_gen (mu in the trainer's numerics), with the behaviour weight
pi_gen / mu (1 in float32; replay_objectives.py) and no further correction (the clip then bounds how
far a replayed token's ratio may move from its behaviour policy, up to tau_max steps old). "decoupled" (POPO's objective) is
available and costs one no-grad pass over the larger batch.

Choices the paper leaves open, as config fields: ``insert`` ("nonzero": only rollouts with
|A| > 0 are stored, since a zero advantage carries no gradient and the priority would draw it
~1000x less often anyway; "effective": the rollouts of effective groups, the reference
implementation's "only survivors enter the buffer"; "all" stores every rollout) and
``max_uses`` (0 = an entry may be drawn again in later steps while it is young enough).
``configs/rollout_replay.py:paper`` sets every detail of the reference implementation:
drop_ineffective, insert "effective", ages in updates, one minibatch,
token-mean, clip 0.2 / 0.28, dual clip 10.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from grpo_jax import errors, registry
from grpo_jax.rl.replay import buffer
from grpo_jax.rl.replay.buffer import ReplayState
from grpo_jax.rl.replay.method import (METHODS, Composition, LogpFn, StepContext, flat_rows,
                                    fresh_anchored, no_rows, objective_field,
                                    validate_objective)

INSERT_MODES = ("nonzero", "effective", "all")
AGE_UNITS = ("steps", "updates")


def priorities(advantages_C: jax.Array, valid_C: jax.Array, alpha: float = 0.5,
               eps: float = 1e-6) -> jax.Array:
  """Sampling probabilities [C] float32: (|A| + eps)^alpha normalised over valid entries.

  Zero for invalid entries; the valid ones sum to 1 (all zeros when none is valid).
  Reference: Yoo et al., arXiv 2606.04560 (priority by advantage magnitude).
  """
  p = jnp.power(jnp.abs(advantages_C.astype(jnp.float32)) + eps, alpha)
  p = jnp.where(valid_C, p, 0.0)
  return p / jnp.maximum(jnp.sum(p), jnp.finfo(jnp.float32).tiny)


def priority_entropy(p_C: jax.Array) -> jax.Array:
  """-sum p log p over the entries with p > 0 (nats): log(live entries) when uniform."""
  return -jnp.sum(jnp.where(p_C > 0, p_C * jnp.log(jnp.maximum(p_C, 1e-30)), 0.0))


@METHODS.register("prioritized")
@dataclasses.dataclass(frozen=True)
class PrioritizedReplay(registry.Configurable):
  """Rollout-level prioritised replay as a replay method of the train step.

  Config group ``config.replay.prioritized``: every field but ``objective``
  (``config.replay.objective``) and ``updates_per_step`` (rl.num_minibatches x rl.num_epochs).

  Attributes:
    tau_max: entries older than this (in ``age_unit``) are never replayed.
    rho: replay rows per fresh row; R = round(rho * N) is static.
    alpha: priority exponent.
    eps: added to |A| before the exponent.
    warmup_steps: no replay before this train step.
    insert: which fresh rollouts are stored: "nonzero" (|A| > 0), "effective" (the rollouts
      of effective groups) or "all".
    max_uses: an entry is dropped after this many replays (0 = no limit).
    objective: how replayed rows enter the loss (objectives.OBJECTIVES); "align_mu" as the paper.
    drop_ineffective: fresh groups that are not effective leave the loss (and the count of
      fresh rows that sizes the replay).
    age_unit: "steps" (train steps) or "updates" (gradient steps: train steps times
      ``updates_per_step``), the unit of ``tau_max``.
    updates_per_step: optimiser updates per train step (minibatches x epochs).
  """
  # update.minibatches_are_groups: rows in whole groups of one prompt
  # (single rollouts are appended, not groups).
  whole_groups: ClassVar[bool] = False

  tau_max: int = 10
  rho: float = 0.5
  alpha: float = 0.5
  eps: float = 1e-6
  warmup_steps: int = 20
  insert: str = "nonzero"
  max_uses: int = 0
  objective: str = objective_field("align_mu")
  drop_ineffective: bool = False
  age_unit: str = "steps"
  updates_per_step: int = dataclasses.field(default=1, metadata=registry.DERIVED)

  def __post_init__(self):
    validate_objective(self.objective)
    if self.insert not in INSERT_MODES:
      raise ValueError(f"insert must be one of {INSERT_MODES}, got {self.insert!r}")
    if self.age_unit not in AGE_UNITS:
      raise ValueError(f"age_unit must be one of {AGE_UNITS}, got {self.age_unit!r}")
    if self.updates_per_step < 1:
      raise ValueError(f"updates_per_step must be >= 1, got {self.updates_per_step}")
    if self.tau_max < 1:
      raise ValueError(f"tau_max must be >= 1 ({self.age_unit}), got {self.tau_max}")
    if self.age_unit == "updates" and self.tau_max < self.updates_per_step:
      raise ValueError(
          f"tau_max={self.tau_max} updates is less than one train step "
          f"({self.updates_per_step} updates): nothing could ever be replayed; raise tau_max "
          "or use fewer minibatches")
    if not 0.0 < self.rho <= 4.0:
      raise ValueError(f"rho must be in (0, 4], got {self.rho}")
    if self.alpha < 0 or self.eps <= 0:
      raise ValueError(f"alpha must be >= 0 and eps > 0, got {self.alpha}, {self.eps}")
    if self.warmup_steps < 0 or self.max_uses < 0:
      raise ValueError("warmup_steps and max_uses must be >= 0")

  @classmethod
  def from_config(cls, config) -> PrioritizedReplay:
    return cls.from_group(config.replay.prioritized, objective=config.replay.objective,
                          updates_per_step=config.rl.num_minibatches * config.rl.num_epochs)

  def check_config(self, config) -> None:
    errors.check(config.replay.capacity > 0, "replay.capacity",
                 "must be > 0 for prioritized (rollout-level) replay")
    errors.check(isinstance(self.drop_ineffective, bool), "replay.prioritized.drop_ineffective",
                 f"{self.drop_ineffective!r} must be true or false")

  def entry_size(self, group_size: int) -> int:
    del group_size
    return 1

  def extra_rows(self, num_rows: int, group_size: int) -> int:
    del group_size
    return max(1, round(self.rho * num_rows))

  def replays(self, replay: ReplayState) -> bool:
    return replay.capacity > 0

  @property
  def max_age_steps(self) -> int:
    """tau_max in train steps: an entry a steps old is a x updates_per_step updates old, so it
    stays while a <= tau_max // updates_per_step (age_unit "updates")."""
    return self.tau_max // self.updates_per_step if self.age_unit == "updates" else self.tau_max

  def evict(self, replay: ReplayState, step: jax.Array) -> ReplayState:
    """Age eviction on the version stamps (and the use limit when one is set)."""
    return buffer.evict(replay, step, max_age=self.max_age_steps,
                        max_uses=self.max_uses or None)

  def compose(self, ctx: StepContext, replay: ReplayState, logp_fn: LogpFn) -> Composition:
    """All N fresh rows, then R slots of which round(rho * F) are filled by priority without
    replacement (masked if absent); F = the fresh rows that count in the loss."""
    del logp_fn
    n = ctx.advantages.size
    r = self.extra_rows(n, ctx.fresh.completion_ids.shape[1])
    fresh_mask = ctx.fresh.completion_mask
    if self.drop_ineffective:
      fresh_mask = fresh_mask & ctx.effective[:, None, None]
    active = jnp.sum(jnp.any(fresh_mask, axis=-1).astype(jnp.float32))
    wanted = jnp.minimum(jnp.round(self.rho * active), r).astype(jnp.int32)
    live_C = replay.valid & (ctx.step >= self.warmup_steps)
    p_C = priorities(replay.advantages[:, 0], live_C, self.alpha, self.eps)
    if replay.capacity:
      indices_R, ok_R = buffer.select(replay.replace(valid=live_C), r, "proportional",
                                      score_C=p_C, rng=ctx.rng)
      # The valid draws come first (top-k order): keep the first ``wanted``.
      ok_R = ok_R & (jnp.arange(r) < wanted)
      stored = jax.tree.map(lambda x: x[indices_R, 0], replay.rollouts)
      stored_adv = replay.advantages[indices_R, 0]
      stored_gen = replay.gen_logp[indices_R, 0]
    else:
      stored, stored_adv, ok_R = no_rows(ctx, r)
      stored_gen = stored.behaviour_logp
      indices_R = jnp.zeros((r,), jnp.int32)
    return fresh_anchored(
        ctx, stored, stored_adv, ok_R, gen_logp_RxT=stored_gen, selection=(indices_R, ok_R),
        fresh_mask_BxGxT=fresh_mask,
        metrics={"replay_priority_entropy": priority_entropy(p_C),
                 "replay_live_entries": jnp.sum(live_C.astype(jnp.float32)),
                 "replay_rows_wanted": wanted.astype(jnp.float32)})

  def after_update(self, ctx: StepContext, replay: ReplayState,
                   comp: Composition) -> tuple[ReplayState, dict]:
    """After the update: count uses, then store this step's rollouts one entry each."""
    if not self.replays(replay):
      return replay, {}
    replay = buffer.mark_used(replay, *comp.selection)
    rows = jax.tree.map(lambda x: flat_rows(x)[:, None], ctx.fresh)  # [N, 1, ...]
    adv_N = flat_rows(ctx.advantages)
    g = ctx.advantages.shape[1]
    keep_N = {"nonzero": lambda: jnp.abs(adv_N) > 0,
              "effective": lambda: jnp.repeat(ctx.effective, g),
              "all": lambda: jnp.ones_like(adv_N, bool)}[self.insert]()
    replay = buffer.insert(replay, rows, adv_N[:, None], keep_N,
                           gen_logp_MxExT=flat_rows(ctx.fresh_gen_logp)[:, None])
    return replay, {"replay_inserted": jnp.sum(keep_N.astype(jnp.float32))}
