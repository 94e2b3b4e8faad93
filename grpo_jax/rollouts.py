"""Host side of one iteration: prompts -> sampler -> verifier -> a device ``Rollout``.

The sampler runs on the device; decoding and reward verification run on the host (rewards are
arbitrary Python: a verifier that raises is counted and scores 0, it never stops training).
The DAPO soft overlong penalty (arXiv 2503.14476) is measured in tokens and added to the score.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import tokenization
from grpo_jax.types import Rollout

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
    position: next data position (checkpointed).
    skipped: prompts skipped for length so far (checkpointed).
  """

  task: object
  tokenizer: object
  prompt_len: int
  chat_template: bool = False
  position: int = 0
  skipped: int = 0

  def render(self, problem) -> str:
    text = self.task.prompt(problem)
    if self.chat_template:
      text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                tokenize=False, add_generation_prompt=True)
    return text

  def next_batch(self, n: int, max_skips: int = 10_000):
    """n (position, problem, text) triples, in data order.

    Raises:
      ValueError: more than ``max_skips`` consecutive prompts are longer than P.
    """
    out = []
    skipped_now = 0
    in_a_row = 0  # consecutive skips: max_skips bounds these, not the call's total
    while len(out) < n:
      problem = self.task.train_problem(self.position)
      text = self.render(problem)
      if tokenization.prompt_lengths(self.tokenizer, [text])[0] <= self.prompt_len:
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


def score_completions(task, texts, problems) -> tuple[np.ndarray, int]:
  """Task scores of each completion; a verifier exception scores 0 and is counted."""
  scores, errors = [], 0
  for text, problem in zip(texts, problems):
    try:
      scores.append(float(task.score(text, problem)))
    except Exception:  # pylint: disable=broad-except
      errors += 1
      scores.append(0.0)
  if errors:
    _LOG.warning("%d reward computation(s) raised; scored 0", errors)
  return np.asarray(scores, np.float32), errors


def generate(sample_fn, params, tokenizer, task, batch, *, group_size: int, prompt_len: int,
             version: int, rng, overlong_buffer: int = 0, overlong_factor: float = 1.0):
  """Samples G completions for each prompt of ``batch`` and scores them.

  Args:
    sample_fn: jitted sampler ``fn(params, ids, mask, rng) -> Completions``.
    params: policy parameters.
    tokenizer: transformers tokenizer.
    task: the task (``score``, ``is_success``).
    batch: B (position, problem, prompt text) triples from ``PromptStream.next_batch``.
    group_size: G.
    prompt_len: P.
    version: policy step stamped on every row.
    rng: sampling key.
    overlong_buffer, overlong_factor: DAPO soft overlong penalty (0 disables).

  Returns:
    (Rollout on the device with N = B * G rows, dict of host statistics).
  """
  texts = [text for _, _, text in batch for _ in range(group_size)]
  problems = [p for _, p, _ in batch for _ in range(group_size)]
  positions = np.repeat(np.asarray([pos for pos, _, _ in batch], np.int32), group_size)
  ids, mask = tokenization.encode_prompts(tokenizer, texts, prompt_len)
  out = sample_fn(params, ids, mask, rng)
  tokens, comp_mask, lengths, truncated = jax.device_get(
      (out.tokens_NxT, out.mask_NxT, out.lengths_N, out.truncated_N))
  completions = tokenization.decode_completions(tokenizer, tokens, comp_mask)
  scores, errors = score_completions(task, completions, problems)
  success = np.array([task.is_success(s) for s in scores], bool)
  t_max = tokens.shape[1]
  scores = scores + overlong_penalty(lengths, truncated, t_max, overlong_buffer,
                                     overlong_factor).astype(np.float32)
  n = len(texts)
  rollout = Rollout(prompt_ids_NxP=jnp.asarray(ids), prompt_mask_NxP=jnp.asarray(mask),
                    completion_ids_NxT=out.tokens_NxT, completion_mask_NxT=out.mask_NxT,
                    behaviour_logp_NxT=out.logp_NxT, scores_N=jnp.asarray(scores),
                    success_N=jnp.asarray(success), prompt_id_N=jnp.asarray(positions),
                    version_N=jnp.full((n,), version, jnp.int32))
  stats = {"rollouts": n, "completion_tokens": int(lengths.sum()), "reward_errors": errors,
           "truncated_fraction": float(truncated.mean()), "sample_text": completions[0]}
  return rollout, stats
