"""The training prompt stream: problems by data position, rendered, and skipped (and counted)
when longer than the prompt budget P. Checkpointed as (position, skipped)."""

from __future__ import annotations

import dataclasses
import logging

from grpo_jax.generate import tokenization

_LOG = logging.getLogger(__name__)


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
    """The prompt text the sampler sees: a conversational prompt (``task.messages``) through
    the chat template (its contents joined by blank lines when the tokenizer has none), a
    string prompt through it only when ``chat_template`` is set."""
    messages = self.task.messages(problem) if hasattr(self.task, "messages") else None
    if messages is not None:
      if not getattr(self.tokenizer, "chat_template", None):
        return "\n\n".join(m["content"] for m in messages)
      return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)
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
      tokenization.PromptTooLongError: more than ``max_skips`` consecutive prompts are longer
        than P (a whole pass over a finite training set of them: none fits).
    """
    out = []
    finite = self.train_size or getattr(self.task, "num_train_problems", lambda: 0)()
    if finite:  # a whole pass of skips: no prompt of the set fits
      max_skips = min(max_skips, finite)
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
            raise tokenization.PromptTooLongError(f"more than {max_skips} consecutive prompts are longer than "
                             f"rollout.prompt_len={self.prompt_len} (the last had {length} "
                             "tokens): raise it")
        self.position += 1
    if skipped_now:
      _LOG.warning("skipped %d prompt(s) longer than %d tokens (%d so far)", skipped_now,
                   self.prompt_len, self.skipped)
    return out
