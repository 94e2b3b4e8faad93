"""Reward functions written for TRL's GRPOTrainer, in its documented form (keyword arguments,
dataset columns by name, ``**kwargs`` for the rest); grpo_jax must run them unchanged."""

import asyncio
import re


def boxed_matches(completions, ground_truth, **kwargs):
  """1.0 when the last \\boxed{...} of a standard (string) completion is the ground truth."""
  found = [re.findall(r"\\boxed\{([^{}]*)\}", c) for c in completions]
  return [1.0 if f and f[-1].strip() == str(gt) else 0.0 for f, gt in zip(found, ground_truth)]


def says_answer(completions, **kwargs):
  """Conversational form: each completion is a list of messages; 1.0 when 'answer' appears."""
  return [1.0 if "answer" in c[0]["content"] else 0.0 for c in completions]


def length_penalty(completions, completion_ids, **kwargs):
  """-0.01 per completion token (reads completion_ids, as TRL passes them)."""
  return [-0.01 * len(ids) for ids in completion_ids]


def curriculum_length_penalty(completions, completion_ids, trainer_state, **kwargs):
  """A curriculum, TRL's documented use of ``trainer_state``: the length penalty phases in with
  training progress, -0.01 per token times global_step / max_steps."""
  progress = trainer_state.global_step / trainer_state.max_steps
  return [-0.01 * len(ids) * progress for ids in completion_ids]


def step_from_kwargs(completions, **kwargs):
  """Reads the state from ``**kwargs``, as functions that take no named ``trainer_state`` do:
  the global step as the reward (1.0 per completed step)."""
  return [float(kwargs["trainer_state"].global_step)] * len(completions)


def boxed_with_logs(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
  """TRL's logging example: 1.0 when the last \\boxed{...} is the ground truth; logs the
  reference and what was extracted as columns, and the batch's accuracy as a metric."""
  found = [re.findall(r"\\boxed\{([^{}]*)\}", c) for c in completions]
  extracted = [f[-1].strip() if f else None for f in found]
  rewards = [1.0 if e == str(gt) else 0.0 for e, gt in zip(extracted, ground_truth)]
  if log_extra:
    log_extra("golden_answer", [str(gt) for gt in ground_truth])
    log_extra("extracted_answer", [e or "[none]" for e in extracted])
  if log_metric:
    log_metric("accuracy", sum(rewards) / len(rewards))
  return rewards


def token_counts(completions, completion_ids, log_extra=None, log_metric=None, **kwargs):
  """Logs and does not score (None for every row, TRL's "no reward"): each completion's token
  count as a column, their mean as a metric."""
  counts = [len(ids) for ids in completion_ids]
  if log_extra:
    log_extra("tokens", counts)
  if log_metric:
    log_metric("mean_tokens", sum(counts) / len(counts))
  return [None] * len(completions)


async def async_boxed(completions, **kwargs):
  """TRL's asynchronous form (awaited by the trainer): 1.0 when the completion has a box."""
  await asyncio.sleep(0)
  return [1.0 if "\\boxed{" in c else 0.0 for c in completions]


NOT_A_FUNCTION = 3
