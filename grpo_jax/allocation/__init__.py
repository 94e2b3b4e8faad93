"""Host-side prompt selection and rollout allocation (see allocator.py for the interface).

``make_allocator(config, sample_fn, tokenizer, task, stream)`` builds what ``config.allocation``
names: a rule (``method``: uniform | dynamic_sampling | sara) over a selector (``selector``:
stream | mopps | dps).
"""

from grpo_jax.allocation.allocator import Allocator, FullGroups
from grpo_jax.allocation.dynamic_sampling import DynamicSampling
from grpo_jax.allocation.rounds import SCORE_BASES, Prompt, RoundSampler, Rows
from grpo_jax.allocation.sara import Sara, p_effective
from grpo_jax.allocation.selectors import (SELECTORS, DpsSelector, MoppsSelector,
                                           StreamSelector, make_selector, pool_size)

METHODS = ("uniform", "dynamic_sampling", "sara")


def make_allocator(config, sample_fn, tokenizer, task, stream, timer=None) -> Allocator:
  """The allocator described by ``config.allocation`` (validated by grpo_jax.configuration);
  its phases are timed on ``timer`` (a ``metrics.PhaseTimer``; a private one when None)."""
  a, r = config.allocation, config.rollout
  selector = make_selector(a.selector, stream, size=pool_size(task, config.task.train_size),
                           ratio=a.candidates_ratio, decay=a.decay, seed=config.seed)
  sampler = RoundSampler(sample_fn, tokenizer, task, slots=r.batch_prompts * r.group_size,
                         prompt_len=r.prompt_len, overlong_buffer=config.rl.overlong_buffer,
                         overlong_factor=config.rl.overlong_penalty,
                         score_base=config.rl.score_base, timer=timer)
  shape = dict(num_groups=r.batch_prompts, group_size=r.group_size,
               effective_signal=config.rl.effective_signal)
  if a.method == "dynamic_sampling":
    return DynamicSampling(selector, sampler, max_rounds=a.max_rounds, oversample=a.oversample,
                           **shape)
  if a.method == "sara":
    return Sara(selector, sampler, probes=a.probes, tau_lo=a.tau_lo, tau_hi=a.tau_hi,
                alpha0=a.alpha0, beta0=a.beta0, max_rounds=a.max_rounds, seed=config.seed,
                **shape)
  if a.method == "uniform":
    return FullGroups(selector, sampler, **shape)
  raise ValueError(f"allocation.method must be one of {METHODS}, got {a.method!r}")

__all__ = ["Allocator", "DpsSelector", "DynamicSampling", "FullGroups", "METHODS",
           "MoppsSelector", "Prompt", "RoundSampler", "Rows", "SCORE_BASES", "SELECTORS", "Sara",
           "StreamSelector", "make_allocator", "make_selector", "p_effective", "pool_size"]
