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

On the slot pool of partial rollouts (``rollout.partial``) the filter is ``PoolFilter``: each
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
from grpo_jax.generate import producer as producer_lib


class DynamicSampling(allocator_lib.Allocator):
  """Full groups of fresh prompts, batch after batch, keeping the effective ones.

  Args:
    selector, sampler, num_groups, group_size, effective_signal: see ``Allocator``.
    max_rounds: generation rounds per step at most (each B prompts x G rollouts).
    oversample: rounds per generation batch (its prompts are oversample x B); the kept groups
      are counted after each batch.
  """

  name = "dynamic_sampling"

  def __init__(self, selector, sampler, *, num_groups: int, group_size: int,
               effective_signal: str = "success", max_rounds: int = 10, oversample: int = 1):
    super().__init__(selector, sampler, num_groups=num_groups, group_size=group_size,
                     effective_signal=effective_signal)
    if max_rounds < 1:
      raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    if not 1 <= oversample <= max_rounds:
      raise ValueError(f"oversample must be in [1, max_rounds={max_rounds}], got {oversample}")
    self.max_rounds, self.oversample = max_rounds, oversample

  def collect(self, params, step: int, rng):
    b = self.num_groups
    kept, touched, generated = [], [], []
    taken = set()
    r = batches = effective = 0
    dry = False
    while len(kept) < b and r < self.max_rounds and not dry:
      batch_rounds = 0
      while batch_rounds < self.oversample and r < self.max_rounds and not dry:
        prompts = self._draw(self.num_groups, taken)
        dry = len(prompts) < b  # a selector that returns fewer has no more for this step
        if not prompts:
          break
        taken.update(p.index for p in prompts)
        per_prompt, _ = self.sampler.run(params, [(p, self.group_size) for p in prompts],
                                         self.round_key(rng, r))
        r += 1
        batch_rounds += 1
        generated += per_prompt
        for prompt, rows in zip(prompts, per_prompt):
          touched.append((prompt, rows))
          if rounds_lib.is_effective(rows, self.effective_signal):
            effective += 1
            if len(kept) < b:
              kept.append((prompt, rows))
      batches += bool(batch_rounds)
    if not touched:
      raise ValueError("the selector had no prompt for this step")
    return self._finish(kept, generated, touched, step, rounds=r,
                        extra={"alloc/capped": float(len(kept) < b),
                               "alloc/generation_batches": float(batches),
                               "alloc/effective_dropped": float(effective - len(kept))})


class PoolFilter:
  """DAPO's filter on the slot pool (``allocation.partial.PoolPolicy``): whole groups of G, a
  group whose rewards all agree on the effective signal dropped when it completes.

  Args:
    effective_signal: "success" or "score" (``rounds.is_effective``).
    group_size: G.
  """

  def __init__(self, effective_signal: str, group_size: int):
    self.signal, self.first_rows = effective_signal, group_size
    self._dropped = 0

  def verdict(self, tag, rows: rounds_lib.Rows, group_size: int) -> int:
    del tag, group_size
    if rounds_lib.is_effective(rows, self.signal):
      return 0
    self._dropped += 1
    return producer_lib.DROP

  def forget(self, tag) -> None:
    del tag

  def take_stats(self) -> dict:
    out, self._dropped = {"alloc/ineffective_dropped": float(self._dropped)}, 0
    return out

  def state_dict(self) -> dict:
    return {}

  def load_state_dict(self, state: dict) -> None:
    del state


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

  def build(self, selector, sampler, *, max_rounds: int, seed: int, **shape) -> DynamicSampling:
    del seed
    return DynamicSampling(selector, sampler, max_rounds=max_rounds,
                           oversample=self.oversample, **shape)

  def pool_policy(self, *, group_size: int, effective_signal: str, **unused) -> PoolFilter:
    """The rule on the pool of partial rollouts."""
    del unused
    return PoolFilter(effective_signal, group_size)
