"""Host side of one iteration: the prompt stream, the verifier, DAPO's overlong penalty.

Decoding and reward verification run on the host (rewards are arbitrary Python: a verifier that
raises is counted and scores 0, it never stops training). The DAPO soft overlong penalty
(arXiv 2503.14476) is measured in tokens and added to the score. Generation itself, in
fixed-shape rounds, is ``grpo_jax.allocation.rounds``.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from grpo_jax import tokenization

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


@dataclasses.dataclass
class PromptStream:
  """Training prompts by data position, skipping (and counting) prompts that do not fit P.

  Attributes:
    task: object with ``train_problem(i)`` and ``prompt(problem)``.
    tokenizer: transformers tokenizer.
    prompt_len: P.
    chat_template: wrap each prompt in the tokenizer's chat template.
    train_size: when > 0, the training set is the task's first ``train_size`` problems and
      data position i reads problem ``i % train_size`` (epochs over a finite set).
    position: next data position (checkpointed).
    skipped: prompts skipped for length so far (checkpointed).
  """

  task: object
  tokenizer: object
  prompt_len: int
  chat_template: bool = False
  train_size: int = 0
  position: int = 0
  skipped: int = 0

  def render(self, problem) -> str:
    text = self.task.prompt(problem)
    if self.chat_template:
      text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                tokenize=False, add_generation_prompt=True)
    return text

  def problem(self, index: int):
    """The training problem at data position ``index`` (wrapped by ``train_size``)."""
    return self.task.train_problem(index % self.train_size if self.train_size else index)

  def fits(self, text: str) -> bool:
    return tokenization.prompt_lengths(self.tokenizer, [text])[0] <= self.prompt_len

  def next_batch(self, n: int, max_skips: int = 10_000):
    """n (position, problem, text) triples, in data order.

    Raises:
      ValueError: more than ``max_skips`` consecutive prompts are longer than P.
    """
    out = []
    skipped_now = 0
    in_a_row = 0  # consecutive skips: max_skips bounds these, not the call's total
    while len(out) < n:
      # As many positions as prompts are still needed, rendered and measured in one tokenizer
      # call; taken in order, so exactly the positions a one-by-one scan would read.
      problems = [self.problem(i) for i in range(self.position, self.position + n - len(out))]
      texts = [self.render(problem) for problem in problems]
      lengths = tokenization.prompt_lengths(self.tokenizer, texts)
      for problem, text, length in zip(problems, texts, lengths):
        if length <= self.prompt_len:
          out.append((self.position, problem, text))
          in_a_row = 0
        else:
          self.skipped += 1
          skipped_now += 1
          in_a_row += 1
          if in_a_row > max_skips:
            raise ValueError(f"more than {max_skips} consecutive prompts are longer than "
                             f"rollout.prompt_len={self.prompt_len}: raise it")
        self.position += 1
    if skipped_now:
      _LOG.warning("skipped %d prompt(s) longer than %d tokens (%d so far)", skipped_now,
                   self.prompt_len, self.skipped)
    return out


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
