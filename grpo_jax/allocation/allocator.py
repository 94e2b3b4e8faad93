"""The allocator interface, and uniform allocation (B prompts x G rollouts) on it.

The train loop asks one object per step for the step's rollouts and knows nothing else about
how they were chosen::

    rollout, stats = allocator.collect(params, step, rng)   # B complete groups, host stats
    allocator.state_dict() / allocator.load_state_dict(d)    # in every checkpoint

An allocator combines a *selector* (which prompts: data order, MoPPS, DPS; ``selectors.py``)
with a *rule* for how many rollouts each prompt gets (``rule.py``: uniform, G each, here;
DAPO's dynamic sampling; SARA's probe, commit or abandon), run by one of two engines: fixed-shape
rounds (``round_groups.RoundGroups``) or the slot pool of partial rollouts
(``partial.PartialGroups``). Both hand the train step B complete groups, so every allocator
composes with every estimator and every replay method.

``stats`` carries the run's counters (``rollouts``: every rollout generated this step, used or
not; ``completion_tokens``; ``reward_errors``; with generation on its own devices, the
counting fields come with ``overlap``'s stats, after the update's dispatch: ``partial.py``)
and per-step metrics under ``alloc/``:
rollouts generated and in the update, effective groups per 1,000 rollouts, rounds, prompts
touched, empty groups, and for SARA the abandonment and wrong-abandonment counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from grpo_jax import random_keys, registry
from grpo_jax import timing
from grpo_jax.allocation import rounds as rounds_lib
from grpo_jax.allocation import rule as rule_lib


# Allocation rules by config.allocation.method; a module of grpo_jax/allocation registers its
# rule's spec (``rule.RuleSpec``: a registry.Configurable whose fields are
# config.allocation.<name>) on import.
RULES = registry.Registry("allocation rule", package="grpo_jax.allocation")


class Allocator:
  """Base: a selector, a round sampler and the batch shape; ``collect`` is the rule."""

  name = "allocator"

  def __init__(self, selector, sampler: rounds_lib.RoundSampler, *, num_groups: int,
               group_size: int, effective_signal: str = "success"):
    self.selector, self.sampler = selector, sampler
    self.num_groups, self.group_size = num_groups, group_size
    self.effective_signal = effective_signal
    # The round sampler's timer: prompt selection and batch assembly are timed on it too.
    self.timer = getattr(sampler, "timer", None) or timing.PhaseTimer()

  def collect(self, params, step: int, rng):
    """(Rollout of B complete groups on the device, stats dict) for train step ``step``."""
    raise NotImplementedError

  @staticmethod
  def round_key(rng, r: int):
    """Round r's sampler key, folded from the step's generation key for every round (the
    sampler folds a call's key with each token position, so a call's key must never be
    another round's: ``random_keys.py``)."""
    return random_keys.round_key(rng, r)

  def _draw(self, n: int, taken: set) -> list:
    """n prompts not drawn yet this step; fewer (or none) when the selector runs dry."""
    with self.timer.phase("prompts"):
      try:
        return self.selector.draw(n, exclude=taken)
      except ValueError:
        # A pool selector (MoPPS, DPS: a finite ``size``) raises once every prompt is taken or
        # too long; after the step's first draw that only means this step's pool is spent. A
        # stream's error (a long run of over-long prompts) is a real one.
        if not taken or getattr(self.selector, "size", None) is None:
          raise
        return []

  def overlap(self, params, step: int) -> dict:
    """Update ``step`` was dispatched, its new parameters ``params``: work to overlap with it
    (generation on its own devices: ``PartialGroups``), and its metrics; none here."""
    del params, step
    return {}

  def state_dict(self) -> dict:
    return {"selector": self.selector.state_dict()}

  def load_state_dict(self, state: dict) -> None:
    self.selector.load_state_dict(state["selector"])

  def _finish(self, groups, generated, touched, step, rounds, extra=None):
    """Assembles the batch, tells the selector what it saw, and the step's stats.

    Args:
      groups: (Prompt, Rows) of the complete groups for the update (at most B).
      generated: every Rows the step generated (counted rollouts).
      touched: (Prompt, Rows) of every prompt the step spent rollouts on (for the selector).
      step: the train step (the rows' version).
      rounds: rounds run.
      extra: more ``alloc/`` metrics.
    """
    with self.timer.phase("assembly"):
      return self._finish_timed(groups, generated, touched, step, rounds, extra)

  def _finish_timed(self, groups, generated, touched, step, rounds, extra):
    self.selector.observe([(p.index, int(np.sum(r.rollout.success)), len(r)) for p, r in touched])
    rows = rounds_lib.Rows.concat(generated)
    if groups:
      rollout, empty = rounds_lib.assemble(groups, self.num_groups, self.group_size, step)
    else:  # nothing usable: an all-empty batch, shaped by a prompt the step touched
      first = [(touched[0][0], rounds_lib.empty_rows(touched[0][1], self.group_size))]
      rollout, empty = rounds_lib.assemble(first, self.num_groups, self.group_size, step)
      empty += 1
    effective = sum(rounds_lib.is_effective(r, self.effective_signal) for _, r in groups)
    stats = rounds_lib.row_stats(rows)
    in_update = len(groups) * self.group_size
    stats.update({
        "alloc/rollouts_generated": float(len(rows)),
        "alloc/rollouts_in_update": float(in_update),
        "alloc/effective_groups": float(effective),
        "alloc/effective_per_1k_rollouts": 1000.0 * effective / max(len(rows), 1),
        "alloc/rounds": float(rounds), "alloc/prompts_touched": float(len(touched)),
        "alloc/empty_groups": float(empty), **(extra or {})})
    scorer = getattr(self.sampler, "scorer", None)
    if scorer is not None:  # reward/*: what the step's reward functions gave and counted
      stats.update(scorer.take_stats())
    return rollout, stats


class UniformRule(rule_lib.Rule):
  """Uniform allocation (GRPO): G rollouts for each of B prompts, every group kept; one round
  of B whole groups, or on the pool G rows a group admitted at once."""

  name = "uniform"

  @property
  def sequential(self) -> bool:
    return False


@RULES.register("uniform")
@dataclasses.dataclass(frozen=True)
class UniformSpec(registry.Configurable):
  """``allocation.method=uniform``: G rollouts for each of B prompts (no group of its own)."""

  def check_config(self, config) -> None:
    del config

  def rule(self, *, group_size: int, effective_signal: str = "success") -> UniformRule:
    return UniformRule(group_size, effective_signal)
