"""Host-side prompt selection and rollout allocation (see allocator.py for the interface).

``make_allocator(config, sample_fn, tokenizer, task, stream)`` builds what ``config.allocation``
names: a rule (``method``, registered in ``RULES``: uniform | dynamic_sampling | sara; the
interface in ``rule.py``) over a selector (``selector``, registered in ``SELECTORS``: stream |
mopps | dps). Each reads its own group (``config.allocation.sara``, ``config.allocation.mopps``,
...); ``max_rounds`` is shared. The rule runs in fixed-shape rounds (``round_groups.py``) or,
with ``rollout.partial``, on a slot pool (``partial.py``), deciding from the rows as they end.
"""

from grpo_jax.allocation.allocator import RULES, Allocator, UniformRule
from grpo_jax.allocation.dynamic_sampling import DynamicSamplingRule
from grpo_jax.allocation.partial import PartialGroups, PoolVerdicts
from grpo_jax.allocation.round_groups import RoundGroups
from grpo_jax.allocation.rounds import Prompt, RoundSampler, Rows
from grpo_jax.allocation.rule import COMMIT, DROP, Rule, RuleSpec, Verdict
from grpo_jax.allocation.sara import SaraRule, p_effective
from grpo_jax.allocation.selectors import (SELECTORS, DpsSelector, MoppsSelector,
                                           StreamSelector, pool_size)
from grpo_jax.rewards import scoring


def spec(table, group, name: str):
  """The registered ``name``'s spec from ``group.<name>`` (its defaults when the group lacks
  it). Raises KeyError (unknown name) or ValueError (a value out of range)."""
  return table.get(name).from_group(group.get(name, {}))


def make_allocator(config, sample_fn, tokenizer, task, stream, timer=None,
                   scorer=None, make_producer=None, make_generator=None, rule_spec=None,
                   selector_spec=None) -> Allocator:
  """The allocator described by ``config.allocation`` (validated by grpo_jax.configuration);
  its rows are scored by ``scorer`` (``scoring.make_scorer`` when None) and its phases timed on
  ``timer`` (a ``timing.PhaseTimer``; a private one when None). With ``make_producer``
  (``rollout.partial``: ``run.build.producer_factory``) the rows come from a slot pool
  (``PartialGroups``), generated on their own devices with ``make_generator``
  (``rollout.devices``: ``run.build.generator_factory``). ``rule_spec`` and ``selector_spec``
  are the rule's and the selector's specs when validation already built them
  (``settings.Settings``), else read from ``config.allocation``."""
  a, r = config.allocation, config.rollout
  if selector_spec is None:
    selector_spec = spec(SELECTORS, a, a.selector)
  if rule_spec is None:
    rule_spec = spec(RULES, a, a.method)
  selector = selector_spec.build(
      stream, size=pool_size(task, config.task.train_size), seed=config.seed)
  sampler = RoundSampler(sample_fn, tokenizer, task, slots=r.batch_prompts * r.group_size,
                         prompt_len=r.prompt_len, overlong_buffer=config.rl.overlong_buffer,
                         overlong_factor=config.rl.overlong_penalty,
                         scorer=scorer or scoring.make_scorer(config, task), timer=timer)
  rule = rule_spec.rule(group_size=r.group_size, effective_signal=config.rl.effective_signal)
  shape = dict(num_groups=r.batch_prompts, group_size=r.group_size,
               effective_signal=config.rl.effective_signal, max_rounds=a.max_rounds,
               seed=config.seed)
  if make_producer is not None:
    return PartialGroups(selector, sampler, make_producer=make_producer,
                         policy=PoolVerdicts(rule) if rule.sequential else None,
                         make_generator=make_generator, **shape)
  return RoundGroups(selector, sampler, rule=rule, **shape)


__all__ = ["Allocator", "COMMIT", "DROP", "DpsSelector", "DynamicSamplingRule", "MoppsSelector",
           "PartialGroups", "PoolVerdicts", "Prompt", "RULES", "RoundGroups", "RoundSampler",
           "Rows", "Rule", "RuleSpec", "SELECTORS", "SaraRule", "StreamSelector", "UniformRule",
           "Verdict", "make_allocator", "p_effective", "pool_size", "spec"]
