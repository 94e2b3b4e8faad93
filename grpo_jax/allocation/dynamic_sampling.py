"""DAPO dynamic sampling (Yu et al., arXiv 2503.14476, §3.2): over-sample and filter.

Each round draws B fresh prompts and samples a full group of G for each; only *effective*
groups (rewards not all equal on ``rl.effective_signal``: DAPO filters on accuracy) are kept,
and rounds continue until B are kept or ``max_rounds`` rounds have run (DAPO's cap on
generation batches). Effective groups beyond B are dropped, as in DAPO. Every generated
rollout is counted, kept or not. A step that hits the cap trains on the groups it has, the
remaining slots being empty groups (``rounds.py``): the update sees fewer groups, never an
ineffective one.
"""

from __future__ import annotations

from grpo_jax.allocation import allocator as allocator_lib
from grpo_jax.allocation import rounds as rounds_lib


class DynamicSampling(allocator_lib.Allocator):
  """Full groups of fresh prompts, round after round, keeping the effective ones.

  Args:
    selector, sampler, num_groups, group_size, effective_signal: see ``Allocator``.
    max_rounds: generation rounds per step at most (each B prompts x G rollouts).
  """

  name = "dynamic_sampling"

  def __init__(self, selector, sampler, *, num_groups: int, group_size: int,
               effective_signal: str = "success", max_rounds: int = 10):
    super().__init__(selector, sampler, num_groups=num_groups, group_size=group_size,
                     effective_signal=effective_signal)
    if max_rounds < 1:
      raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    self.max_rounds = max_rounds

  def collect(self, params, step: int, rng):
    kept, touched, generated = [], [], []
    taken = set()
    r = 0
    while len(kept) < self.num_groups and r < self.max_rounds:
      with self.timer.phase("prompts"):
        prompts = self.selector.draw(self.num_groups, exclude=taken)
      taken.update(p.index for p in prompts)
      per_prompt, _ = self.sampler.run(params, [(p, self.group_size) for p in prompts],
                                       self.round_key(rng, r))
      r += 1
      generated += per_prompt
      for prompt, rows in zip(prompts, per_prompt):
        touched.append((prompt, rows))
        if len(kept) < self.num_groups and rounds_lib.is_effective(rows,
                                                                   self.effective_signal):
          kept.append((prompt, rows))
    return self._finish(kept, generated, touched, step, rounds=r,
                        extra={"alloc/capped": float(len(kept) < self.num_groups)})
