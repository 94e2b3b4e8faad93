"""Rewards on the host: the task's verifier over decoded completions, and DAPO's overlong penalty.

``REWARDS`` holds the reward functions by their ``config.rl.score_base`` name, each
``fn(task, completions, problems) -> (scores [R] float32, success [R] bool, errors [R] bool)``;
the overlong penalty is added to whichever one runs. Rewards are arbitrary Python: a verifier that raises is counted and scores 0, it never stops
training. The DAPO soft overlong penalty (arXiv 2503.14476) is measured in tokens and added to
the score. Generation itself, in fixed-shape rounds, is ``grpo_jax.allocation.rounds``.
"""

from __future__ import annotations

import logging

import numpy as np

from grpo_jax import registry

_LOG = logging.getLogger(__name__)


def overlong_penalty(lengths_N: np.ndarray, truncated_N: np.ndarray, max_len: int, buffer: int,
                     factor: float = 1.0) -> np.ndarray:
  """DAPO's soft overlong penalty, in tokens.

  0 for length <= max_len - buffer; (max_len - buffer - length) / buffer in the last ``buffer``
  tokens; -1 for a completion cut off at max_len without EOS. Times ``factor``; all zeros when
  ``buffer`` is 0.
  """
  lengths = np.asarray(lengths_N, np.float64)
  if buffer <= 0:
    return np.zeros_like(lengths)
  soft = np.minimum(0.0, (max_len - buffer - lengths) / buffer)
  return factor * np.where(np.asarray(truncated_N, bool), -1.0, soft)


def score_completions(task, texts, problems) -> tuple[np.ndarray, np.ndarray]:
  """Task scores of each completion, and which rows' verifier raised (those score 0).

  Returns:
    (float32 scores [R], bool errors [R]); a verifier exception never stops training.
  """
  scores, errors = [], []
  for text, problem in zip(texts, problems):
    try:
      scores.append(float(task.score(text, problem)))
      errors.append(False)
    except Exception:  # pylint: disable=broad-except
      errors.append(True)
      scores.append(0.0)
  if any(errors):
    _LOG.warning("%d reward computation(s) raised; scored 0", sum(errors))
  return np.asarray(scores, np.float32), np.asarray(errors, bool)


REWARDS = registry.Registry("reward")


@REWARDS.register("task")
def task_reward(task, completions, problems) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """The task's graded score (e.g. Countdown's 0.1 for a well-formed wrong answer) and its
  accuracy signal ``task.is_success``; rows whose verifier raised score 0 and fail."""
  scores, errors = score_completions(task, completions, problems)
  success = np.array([task.is_success(s) for s in scores], bool)
  return scores, success, errors


@REWARDS.register("accuracy")
def accuracy_reward(task, completions, problems) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """+1 for a success, -1 otherwise: DAPO's rule-based reward (arXiv 2503.14476)."""
  _, success, errors = task_reward(task, completions, problems)
  return np.where(success, 1.0, -1.0).astype(np.float32), success, errors
