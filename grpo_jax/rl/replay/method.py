"""The interface between the train step and a replay method, and its simplest implementation.

A replay method is a frozen (hashable, static under jit) dataclass with

  objective             how replayed rows enter the loss: a name of ``replay_objectives.OBJECTIVES``,
                        where each is defined (its behaviour weight and ratio) once
  entry_size(G) -> E    rollouts per buffer entry (G for group replay, 1 for rollout replay)
  extra_rows(N, G) -> R rows added to the update batch beyond the N fresh ones (static)
  replays(buffer)       False when the method can never replay (static: e.g. capacity 0)
  evict(buffer, step) -> buffer                     before anything is selected
  compose(ctx, buffer, logp_fn) -> Composition      the [N + R]-row update batch
  after_update(ctx, buffer, comp) -> (buffer, metrics)   inserts, counts uses

plus ``from_config(config)`` (the method from its own group ``config.replay.<name>``, whose
keys are its dataclass fields: ``registry.Configurable``) and ``check_config(config)`` (its
checks against other groups, e.g. capacity against the batch). Each method registers itself in
``METHODS`` under its ``config.replay.method`` name, so adding one is its module and a config
file. The train step has no branch per method: it evicts, composes, computes what the objective
needs, runs the update and inserts, whatever the method. ``logp_fn(rows) -> [n, T]`` is the
policy at the start of the step (no gradient), for methods that score candidates with a
teacher-forced pass (POPO-KL, Headroom-Drift; the step passes a ``PolicyPass``, whose
``count`` also gives the pass's real tokens and positions computed, for the method's metrics);
its log-probs are pi_prox, so a method that evaluated its replayed rows returns them in
``Composition.prox_logp`` and the step does not run the same pass again.

Every count (replayed, admitted, evicted) is a mask inside a fixed-size batch, never a shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Protocol

import flax
import jax
import jax.numpy as jnp

from grpo_jax import registry
from grpo_jax.rl import replay_objectives
from grpo_jax.rl.replay.buffer import ReplayState
from grpo_jax.types import Rollout

LogpFn = Callable[[Rollout], jax.Array]


class PolicyPass(NamedTuple):
  """The start-of-step policy's no-grad pass as the train step hands it to ``compose``: called
  on n rows it gives their [n, T] log-probs (a ``LogpFn``); ``count(rows)`` gives the (real
  tokens, token positions computed) float32 of that pass over them (``policy.pass_tokens``), for
  a method that reports the useful fraction of its own passes."""

  logp: LogpFn
  count: Callable[[Rollout], tuple[jax.Array, jax.Array]]

  def __call__(self, rows: Rollout) -> jax.Array:
    return self.logp(rows)

# Every replay method, by its config.replay.method name; a module of grpo_jax/replay registers
# its method on import, and the table imports them all on first lookup.
METHODS = registry.Registry("replay method", package="grpo_jax.rl.replay")


def objective_field(default: str = "decoupled"):
  """A method's ``objective`` field: read from the shared ``config.replay.objective``."""
  return dataclasses.field(default=default, metadata=registry.DERIVED)


@flax.struct.dataclass
class StepContext:
  """What the step knows when it composes: this step's fresh groups and their statistics.

  Attributes:
    fresh: Rollout of [B, G, ...] arrays.
    advantages: float32 [B, G] their advantages.
    effective: bool [B], which groups are effective (on the configured signal).
    step: int32 policy step (the version these rollouts carry).
    rng: key for the method's own sampling (e.g. Gumbel top-k priorities).
    gen_logp: float32 [B, G, T] the trainer's log-probs of the fresh tokens at the start of the step, what
      ``after_update`` stores as an entry's pi_gen (buffer.ReplayState.gen_logp); set by
      the step after its proximal pass. None: the sampler's log mu (same numerics).
  """

  fresh: Rollout
  advantages: jax.Array
  effective: jax.Array
  step: jax.Array
  rng: jax.Array
  gen_logp: Optional[jax.Array] = None

  @property
  def fresh_gen_logp(self) -> jax.Array:
    """[B, G, T] pi_gen of the fresh rows (log mu when the step has not set it)."""
    if self.gen_logp is None:
      return self.fresh.behaviour_logp
    return self.gen_logp


@flax.struct.dataclass
class Composition:
  """The update batch after replay.

  Attributes:
    rollout: Rollout of [N + R, ...] rows: the N fresh rows (or their replacements) first.
    advantages: float32 [N + R] advantages (stored ones frozen at insertion on replayed rows).
    loss_mask: bool [N + R, T] which tokens count (False on empty or dropped rows).
    replayed: bool [N + R], the row comes from the buffer.
    gen_logp: float32 [N + R, T] the stored pi_gen of replayed rows (the trainer's log-probs when
      the entry was generated; ``buffer.ReplayState.gen_logp``), log mu on fresh rows.
    prox_logp: optional float32 [N + R, T] log pi_prox of replayed rows from the method's own pass
      at the start-of-step parameters (None: the step runs the pass when the objective needs it).
    prox_rows: optional int32 [M] distinct rows that hold every replayed row, the replayed ones
      first, M a static bound (whole groups where rows come in groups): the step's pi_prox pass
      runs over these rows only (``prox.gathered``). None: over the whole batch.
    selection: what ``after_update`` needs to know of this step's selection (per method).
    metrics: float32 scalar diagnostics of the method.
  """

  rollout: Rollout
  advantages: jax.Array
  loss_mask: jax.Array
  replayed: jax.Array
  gen_logp: jax.Array
  prox_logp: Optional[jax.Array]
  selection: Any
  metrics: dict
  prox_rows: Optional[jax.Array] = None


class ReplayMethod(Protocol):
  """The interface above, as a type (every method is a frozen dataclass implementing it).

  ``whole_groups`` (a class attribute): every row the method adds or replaces comes within a
  whole group of G rows of one prompt, aligned to G in the batch, so the update may run the
  shared-prompt pass unchecked (``update.minibatches_are_groups``); False gets the per-row
  pass.
  """

  objective: str
  whole_groups: ClassVar[bool]

  @classmethod
  def from_config(cls, config) -> "ReplayMethod": ...

  def check_config(self, config) -> None: ...

  def entry_size(self, group_size: int) -> int: ...

  def extra_rows(self, num_rows: int, group_size: int) -> int: ...

  def replays(self, replay: ReplayState) -> bool: ...

  def evict(self, replay: ReplayState, step: jax.Array) -> ReplayState: ...

  def compose(self, ctx: StepContext, replay: ReplayState, logp_fn: LogpFn) -> Composition: ...

  def after_update(self, ctx: StepContext, replay: ReplayState,
                   comp: Composition) -> tuple[ReplayState, dict]: ...


def flat_rows(x: jax.Array) -> jax.Array:
  """[B, G, ...] -> [B * G, ...] (group-major rows)."""
  return x.reshape((-1,) + x.shape[2:])


def fresh_composition(ctx: StepContext, mask_BxGxT: jax.Array | None = None,
                      metrics: dict | None = None) -> Composition:
  """The fresh batch as it is (optionally with another loss mask): no row replayed."""
  mask = ctx.fresh.completion_mask if mask_BxGxT is None else mask_BxGxT
  n = ctx.advantages.size
  rows = jax.tree.map(flat_rows, ctx.fresh)
  return Composition(rollout=rows, advantages=flat_rows(ctx.advantages),
                     loss_mask=flat_rows(mask), replayed=jnp.zeros((n,), bool),
                     gen_logp=rows.behaviour_logp, prox_logp=None, selection=None,
                     metrics=metrics or {})


def fresh_anchored(ctx: StepContext, stored_R: Rollout, advantages_R: jax.Array,
                   ok_R: jax.Array, gen_logp_RxT: jax.Array | None = None,
                   prox_logp_RxT: jax.Array | None = None, selection=None,
                   metrics: dict | None = None,
                   fresh_mask_BxGxT: jax.Array | None = None) -> Composition:
  """All N fresh rows, then R stored rows (a static R): row i of the tail counts only where
  ``ok_R[i]`` (fewer entries than R leave masked rows with advantage 0).

  The layout of rollout-level replay (arXiv 2606.04560) and of Headroom-Drift's extra groups
  (arXiv 2609.03941). ``gen_logp_RxT``: the stored rows' pi_gen (default: their log mu);
  ``prox_logp_RxT``: their log pi_prox when the method has it; ``fresh_mask_BxGxT``: another
  loss mask for the fresh rows (e.g. dropped groups). A pi_prox pass runs over the tail only.
  """
  fresh = jax.tree.map(flat_rows, ctx.fresh)
  n = fresh.num_rows
  cat = lambda f, s: jnp.concatenate([f, s.astype(f.dtype)])
  prox = None if prox_logp_RxT is None else cat(fresh.behaviour_logp, prox_logp_RxT)
  gen = stored_R.behaviour_logp if gen_logp_RxT is None else gen_logp_RxT
  fresh_mask = (fresh.completion_mask if fresh_mask_BxGxT is None
                else flat_rows(fresh_mask_BxGxT))
  return Composition(
      rollout=jax.tree.map(cat, fresh, stored_R),
      advantages=cat(flat_rows(ctx.advantages), jnp.where(ok_R, advantages_R, 0.0)),
      loss_mask=cat(fresh_mask, stored_R.completion_mask & ok_R[:, None]),
      replayed=cat(jnp.zeros((n,), bool), ok_R),
      gen_logp=cat(fresh.behaviour_logp, gen), prox_logp=prox,
      selection=selection, metrics=metrics or {},
      # Only the tail can be replayed; its replayed rows first.
      prox_rows=n + jnp.argsort(~ok_R, stable=True).astype(jnp.int32))


def no_rows(ctx: StepContext, r: int) -> tuple[Rollout, jax.Array, jax.Array]:
  """(r zero rows shaped like the fresh ones, zero advantages, all False): the tail of a
  fresh-anchored batch when there is no buffer (capacity 0)."""
  zeros = jax.tree.map(lambda x: jnp.zeros((r,) + x.shape[2:], x.dtype), ctx.fresh)
  return zeros, jnp.zeros((r,), jnp.float32), jnp.zeros((r,), bool)


def validate_objective(objective: str):
  if objective not in replay_objectives.OBJECTIVES:
    raise ValueError(f"objective must be one of {tuple(replay_objectives.OBJECTIVES)}, got "
                     f"{objective!r}")


@METHODS.register("none")
@dataclasses.dataclass(frozen=True)
class NoReplay(registry.Configurable):
  """Plain on-policy training: the batch is the fresh rollouts, the buffer is never touched."""
  # update.minibatches_are_groups: rows in whole groups of one prompt
  # (nothing is replayed: the batch is the fresh groups).
  whole_groups: ClassVar[bool] = True

  objective: str = objective_field()

  @classmethod
  def from_config(cls, config) -> NoReplay:
    return cls(objective=config.replay.objective)

  def check_config(self, config) -> None:
    del config

  def entry_size(self, group_size: int) -> int:
    return group_size

  def extra_rows(self, num_rows: int, group_size: int) -> int:
    del num_rows, group_size
    return 0

  def replays(self, replay: ReplayState) -> bool:
    del replay
    return False

  def evict(self, replay: ReplayState, step: jax.Array) -> ReplayState:
    del step
    return replay

  def compose(self, ctx: StepContext, replay: ReplayState, logp_fn: LogpFn) -> Composition:
    del replay, logp_fn
    return fresh_composition(ctx)

  def after_update(self, ctx: StepContext, replay: ReplayState,
                   comp: Composition) -> tuple[ReplayState, dict]:
    del ctx, comp
    return replay, {}
