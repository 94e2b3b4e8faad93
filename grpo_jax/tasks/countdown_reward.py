"""The Countdown reward: a completion's last ``<answer>...</answer>`` block, parsed (never
evaluated as code: ``arithmetic.py``), must use every given number exactly once and reach the
target (1.0); a well-formed answer that does not scores the format reward (0.1, as in
TinyZero); anything else 0.0. ``countdown.py`` holds the task and its problem generator.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from grpo_jax.tasks import arithmetic
from grpo_jax.tasks.countdown_solver import VALUE_TOLERANCE

SUCCESS_THRESHOLD = 1.0
# VALUE_TOLERANCE (countdown_solver): absolute tolerance on the answer's value; float
# evaluation of an exact expression such as (1/49)*49 gives 0.9999999999999999.
# Reward for an answer that is well-formed but wrong (format shaping, as in TinyZero).
FORMAT_SCORE = 0.1

# Far above any completion a model writes within its token budget; a longer one scores 0.0
# without being scanned, which bounds the work per completion (the answer inside is capped
# again, at arithmetic.MAX_TEXT_LENGTH).
MAX_COMPLETION_CHARS = 1_000_000

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"


def extract_answer(completion: str) -> str | None:
  """Returns the stripped content of the last ``<answer>...</answer>`` pair.

  Pairs are matched like the non-greedy regex ``<answer>(.*?)</answer>``
  with DOTALL scanning left to right, but with ``str.find`` so the cost is
  linear even for adversarial text with many unclosed tags.

  Args:
      completion: Model output.

  Returns:
      The content of the last pair, stripped of surrounding whitespace, or
      None when there is no complete pair.
  """
  last = None
  position = 0
  while True:
    start = completion.find(ANSWER_OPEN, position)
    if start < 0:
      break
    start += len(ANSWER_OPEN)
    end = completion.find(ANSWER_CLOSE, start)
    if end < 0:
      break
    last = (start, end)
    position = end + len(ANSWER_CLOSE)
  if last is None:
    return None
  return completion[last[0] : last[1]].strip()


def _uses_exactly(literals: Sequence[int | float], nums: Iterable[int]) -> bool:
  """Whether the literals are, as a multiset, exactly the integers `nums`.

  Only int literals count as using a number: ``3.0`` or ``2.5`` never match
  an entry of `nums`, so a model cannot dodge the rule with float spellings.
  """
  if any(type(value) is not int for value in literals):
    return False
  return collections.Counter(literals) == collections.Counter(int(n) for n in nums)


def score(completion: str, nums: Sequence[int], target: int) -> float:
  """Scores a completion for a Countdown problem.

  Args:
      completion: Model output; only its last answer block is considered.
      nums: The numbers that must each be used exactly once.
      target: The value to reach (within VALUE_TOLERANCE).

  Returns:
      1.0 if the final answer parses, uses exactly `nums` as integer literals
      and evaluates to `target`; FORMAT_SCORE (0.1) if it parses but fails
      any of those checks (including division by zero); 0.0 if there is no
      well-formed answer (no tags, empty, disallowed syntax or characters,
      over the size limits, a completion longer than MAX_COMPLETION_CHARS).
      Never raises; never evaluates the text (see arithmetic.py).
  """
  if not isinstance(completion, str) or len(completion) > MAX_COMPLETION_CHARS:
    return 0.0
  answer = extract_answer(completion)
  if answer is None:
    return 0.0
  node = arithmetic.parse_arithmetic(answer)
  if node is None:
    return 0.0
  if not _uses_exactly(arithmetic.literal_numbers(node), nums):
    return FORMAT_SCORE
  value = arithmetic.evaluate_arithmetic(node)
  try:
    reached = value is not None and abs(value - target) <= VALUE_TOLERANCE
  except OverflowError:  # A target too large to compare as a float.
    reached = False
  return 1.0 if reached else FORMAT_SCORE


def is_success(score_value: float) -> bool:
  """Whether a score counts as solving the problem."""
  return score_value >= SUCCESS_THRESHOLD - 1e-9
