"""Reward functions written for TRL's GRPOTrainer, in its documented form (keyword arguments,
dataset columns by name, ``**kwargs`` for the rest); grpo_jax must run them unchanged."""

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


NOT_A_FUNCTION = 3
