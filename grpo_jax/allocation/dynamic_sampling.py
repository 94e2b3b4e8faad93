"""DAPO dynamic sampling (Yu et al., arXiv 2503.14476, §3.2): over-sample and filter.

DAPO generates in *generation batches* of 3 x B prompts, keeps only the *effective* groups
(rewards not all equal on ``rl.effective_signal``: DAPO filters on accuracy) and generates
another batch until B are kept, at most 10 batches a step. Here a generation batch is
``oversample`` rounds (each B fresh prompts x G rollouts, one fixed-shape sampler call), every
prompt of a step drawn once (no repeats within the step), and the kept count is checked after
each whole batch: a batch always runs to its end, so it may keep more than needed. Steps stop
after the batch that brings B effective groups, after ``max_rounds`` rounds (a cap that may cut
the last batch short: DAPO's 10 batches of 3 x B are ``oversample = 3``, ``max_rounds = 30``),
or when the selector runs dry. ``oversample = 1`` checks after every round.

Effective groups beyond B are dropped, as in DAPO (the first B in draw order are kept;
``alloc/effective_dropped`` counts the rest). Every generated rollout is counted, kept or not.
A step that hits the cap trains on the groups it has, the remaining slots being empty groups
(``rounds.py``): the update sees fewer groups, never an ineffective one.

The rule is ``DynamicSamplingRule`` (``rule.py``), run in rounds by ``round_groups.RoundGroups``.
On the slot pool of partial rollouts (``rollout.partial``, ``partial.PartialGroups``) each
group is judged as it completes and dropped if ineffective, so the step ends as soon as B
effective groups are ready and nothing beyond them is generated for the step (what a group in
flight completes later trains in a later step); ``oversample`` has nothing to batch there and
is not read. The cap is the same number of rollouts: ``max_rounds`` x B x G rows admitted a
step.
"""

from __future__ import annotations

import dataclasses

from grpo_jax import errors, registry
from grpo_jax.allocation import allocator as allocator_lib
from grpo_jax.allocation import rounds as rounds_lib
from grpo_jax.allocation import rule as rule_lib


class DynamicSamplingRule(rule_lib.Rule):
  """DAPO's filter (module doc): whole groups, an effective one kept, the rest dropped; on
  rounds B new prompts a round and a stop only after a whole generation batch.

  Args:
    group_size: G.
    effective_signal: "success" or "score" (``rounds.is_effective``).
    oversample: rounds per generation batch (its prompts are oversample x B); the kept groups
      are counted after each batch.
  """

  name = "dynamic_sampling"

  def __init__(self, group_size: int, effective_signal: str = "success", oversample: int = 1):
    super().__init__(group_size, effective_signal)
    if oversample < 1:
      raise ValueError(f"oversample must be >= 1, got {oversample}")
    self.oversample = oversample

  def verdict(self, rows: rounds_lib.Rows, group_size: int) -> rule_lib.Verdict:
    del group_size
    return rule_lib.COMMIT if rule_lib.is_effective(rows, self.effective_signal) else (
        rule_lib.DROP)

  def new_groups(self, *, needed: int, undecided: int, free: int, last: bool) -> int:
    """B fresh prompts every round of a batch, however many groups are still needed."""
    del needed, undecided, last
    return free // self.group_size

  def may_stop(self, rounds: int) -> bool:
    return rounds % self.oversample == 0

  def metrics(self, counts: rule_lib.Counts) -> dict:
    if not counts.on_rounds:
      return {"alloc/ineffective_dropped": float(counts.dropped)}
    return {"alloc/capped": float(counts.trained < counts.num_groups),
            "alloc/generation_batches": float(-(-counts.rounds // self.oversample)),
            "alloc/effective_dropped": float(counts.surplus)}


@allocator_lib.RULES.register("dynamic_sampling")
@dataclasses.dataclass(frozen=True)
class DynamicSamplingSpec(registry.Configurable):
  """``config.allocation.dynamic_sampling``.

  Attributes:
    oversample: prompts per generation batch in multiples of B (DAPO: 3); the kept groups are
      counted after each batch.
  """

  oversample: int = 1

  def __post_init__(self):
    if not isinstance(self.oversample, int) or self.oversample < 1:
      raise ValueError(f"oversample={self.oversample!r} must be an integer >= 1 (generation "
                       "batches of oversample x B prompts)")

  def check_config(self, config) -> None:
    rounds = config.allocation.max_rounds
    errors.check(self.oversample <= rounds, "allocation.dynamic_sampling.oversample",
                 f"{self.oversample} must be <= allocation.max_rounds={rounds} (one generation "
                 "batch is oversample rounds)")

  def rule(self, *, group_size: int, effective_signal: str = "success") -> DynamicSamplingRule:
    return DynamicSamplingRule(group_size, effective_signal, oversample=self.oversample)
