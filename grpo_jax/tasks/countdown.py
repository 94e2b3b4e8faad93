"""The Countdown numbers game as an RL task (as in TinyZero and POPO).

A problem is a multiset of integers and a target. A completion succeeds when
its last ``<answer>...</answer>`` block holds an arithmetic expression (``+ - *
/`` and parentheses) that uses every given number exactly once and evaluates to
the target (the reward: ``countdown_reward.py``).

Problems come either from a deterministic generator with random access by
index (so a run can resume from any data position) or from files in the public
"Countdown-Tasks-3to4" row format (``{"target": int, "nums": [int, ...]}``).

Generator choices, fixed here so every consumer sees the same data:

* Only exact divisions: every intermediate value of a generated solution is an
  integer (``a / b`` is used only when ``b`` divides ``a``). This keeps the
  data learnable for very small models. Negative intermediates are allowed.
* Solutions are rendered compactly with minimal parentheses and no spaces,
  e.g. ``(37-12)*5`` or ``37-12+5``; they re-parse under the rules of
  ``arithmetic.py`` and score 1.0.
* The train/test split is a pure function of the canonical key (sorted numbers
  plus target) via a stable hash that does not depend on the seed, so train
  and test never share a (multiset, target) pair, whatever the seeds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
from collections.abc import Iterable, Sequence

import numpy as np

from grpo_jax import registry
from grpo_jax import tasks as tasks_lib
from grpo_jax.tasks import countdown_files
from grpo_jax.tasks import countdown_solver
from grpo_jax.tasks.countdown_problem import Problem, is_plain_int
# The reward, re-exported: countdown.score, countdown.extract_answer, ... (``countdown_reward``).
from grpo_jax.tasks.countdown_reward import (  # noqa: F401
    ANSWER_CLOSE, ANSWER_OPEN, FORMAT_SCORE, MAX_COMPLETION_CHARS, SUCCESS_THRESHOLD,
    extract_answer, is_success, score)
from grpo_jax.tasks.countdown_solver import Expr, combine, leaf, reaches

_LOG = logging.getLogger(__name__)

TEMPLATES: dict[str, str] = {
  "short": ("Using the numbers {nums}, create an equation that equals {target}."),
  "tinyzero": (
    "Using the numbers {nums}, create an equation that equals {target}. "
    "You can use basic arithmetic operations (+, -, *, /) and each number "
    "can only be used once. Show your work in <think> </think> tags. And "
    "return the final answer in <answer> </answer> tags, for example "
    "<answer> (1 + 2) / 3 </answer>."
  ),
}


def _template_words(templates: Iterable[str]) -> tuple[str, ...]:
  """Sorted union of the alphabetic words of the rendered templates."""
  words: set[str] = set()
  for template in templates:
    # Blank the format fields so their names ("nums", "target") are not
    # mistaken for words that appear in prompts.
    rendered = template.format(nums="", target="")
    words.update(re.findall(r"[A-Za-z]+", rendered))
  return tuple(sorted(words))


# Vocabulary for the embedded word-level tokenizer: every word a prompt can
# contain besides the numbers.
TEMPLATE_WORDS: tuple[str, ...] = _template_words(TEMPLATES.values())

_SPLIT_IDS = {"train": 0, "test": 1}
# Generation gives up (instead of looping forever) when a config cannot produce
# problems, e.g. a target range no expression over the numbers can reach.
MAX_ATTEMPTS = 100_000


# ---------------------------------------------------------------------------
# Generator.


@dataclasses.dataclass(frozen=True)
class GeneratorConfig:
  """Settings of the problem generator.

  Attributes:
      num_numbers: How many numbers each problem has (2 to 6).
      min_number: Smallest number (inclusive, >= 1).
      max_number: Largest number (inclusive, <= 10_000).
      min_target: Smallest target (inclusive).
      max_target: Largest target (inclusive).
      seed: Seed of the generator (>= 0).
      eval_fraction: Fraction of the problem space (by canonical key) held
          out as the test split, strictly between 0 and 1.
  """

  num_numbers: int = 3
  min_number: int = 1
  max_number: int = 50
  min_target: int = 1
  max_target: int = 100
  seed: int = 0
  eval_fraction: float = 0.1

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if field.name == "eval_fraction":
        continue
      value = getattr(self, field.name)
      if not is_plain_int(value):
        raise ValueError(f"{field.name} must be an int, got {value!r}")
    if self.num_numbers not in (2, 3, 4, 5, 6):
      raise ValueError(f"num_numbers must be in 2..6, got {self.num_numbers}")
    if self.min_number < 1:
      raise ValueError(f"min_number must be >= 1, got {self.min_number}")
    # Keeps exact solutions exactly representable as floats, so the
    # reference answer always scores 1.0.
    if self.max_number > 10_000:
      raise ValueError(f"max_number must be <= 10000, got {self.max_number}")
    if self.max_number < self.min_number:
      raise ValueError(f"max_number ({self.max_number}) must be >= min_number ({self.min_number})")
    if self.max_target < self.min_target:
      raise ValueError(f"max_target ({self.max_target}) must be >= min_target ({self.min_target})")
    if self.seed < 0:
      raise ValueError(f"seed must be >= 0, got {self.seed}")
    fraction = self.eval_fraction
    if (
      not isinstance(fraction, (int, float))
      or isinstance(fraction, bool)
      or not 0.0 < fraction < 1.0
    ):
      raise ValueError(f"eval_fraction must be a number in (0, 1), got {fraction!r}")


def canonical_key(nums: Iterable[int], target: int) -> str:
  """Order-independent identity of a problem, e.g. ``"5,7,44|56"``."""
  return ",".join(str(n) for n in sorted(int(n) for n in nums)) + f"|{target}"


def split_of(nums: Iterable[int], target: int, eval_fraction: float) -> str:
  """Returns "test" or "train" for a problem, as a pure function of its key.

  Uses blake2b rather than ``hash()``, which is salted per process. The seed
  is deliberately not part of the hash: the held-out set is the same region
  of problem space for every generator seed.
  """
  digest = hashlib.blake2b(canonical_key(nums, target).encode("utf-8"), digest_size=8).digest()
  unit = int.from_bytes(digest, "big") / 2**64  # Uniform in [0, 1).
  return "test" if unit < eval_fraction else "train"


def _random_solution(rng: np.random.Generator, nums: Sequence[int]) -> Expr:
  """Random expression using each of `nums` once, with exact divisions only.

  Operands are shuffled, then adjacent subexpressions are merged at random
  positions until one remains, which yields varied tree shapes. Each merge
  picks an operator uniformly among the allowed ones; division is allowed
  only when it is exact, so every intermediate value is an integer.
  """
  order = rng.permutation(len(nums))
  items = [leaf(int(nums[i])) for i in order]
  while len(items) > 1:
    i = int(rng.integers(len(items) - 1))
    left, right = items[i], items[i + 1]
    ops = ["+", "-", "*"]
    if right[0] != 0 and (left[0] / right[0]).denominator == 1:
      ops.append("/")
    op = ops[int(rng.integers(len(ops)))]
    items[i : i + 2] = [combine(left, op, right)]
  return items[0]


def generate_problem(config: GeneratorConfig, split: str, index: int) -> Problem:
  """Deterministically generates problem number `index` of a split.

  Candidates are drawn from ``numpy.random.default_rng([seed, split_id,
  index, attempt])`` for attempt = 0, 1, ...: numbers uniform in
  [min_number, max_number] and a random exact-division expression over them.
  The first candidate whose value is an integer in [min_target, max_target]
  and whose canonical key belongs to `split` is returned, so the result
  depends only on (config, split, index).

  Args:
      config: Generator settings.
      split: "train" or "test".
      index: Non-negative position in the split.

  Returns:
      The problem, with nums in sampled order and a solution.

  Raises:
      ValueError: On an unknown split or negative index.
      RuntimeError: If MAX_ATTEMPTS candidates all fail (the config's target
          range is unreachable or the split is too small).
  """
  if split not in _SPLIT_IDS:
    raise ValueError(f"split must be one of {sorted(_SPLIT_IDS)}, got {split!r}")
  if index < 0:
    raise ValueError(f"index must be >= 0, got {index}")
  for attempt in range(MAX_ATTEMPTS):
    rng = np.random.default_rng([config.seed, _SPLIT_IDS[split], index, attempt])
    sampled = rng.integers(config.min_number, config.max_number + 1, size=config.num_numbers)
    nums = tuple(int(n) for n in sampled)
    value, text, _ = _random_solution(rng, nums)
    if value.denominator != 1:
      continue
    target = int(value)
    if not config.min_target <= target <= config.max_target:
      continue
    if split_of(nums, target, config.eval_fraction) != split:
      continue
    # Guards the "reference scores 1.0" contract against float rounding
    # on very large intermediates; never fails with the default ranges.
    if not reaches(text, target):
      continue
    return Problem(nums=nums, target=target, solution=text)
  raise RuntimeError(
    f"no {split} problem found in {MAX_ATTEMPTS} attempts for index "
    f"{index} with {config}; is the target range reachable?"
  )


def eval_problems(config: GeneratorConfig, n: int) -> list[Problem]:
  """The fixed held-out set: test problems 0..n-1."""
  return [generate_problem(config, "test", i) for i in range(n)]


def train_problems(config: GeneratorConfig, start: int, n: int) -> list[Problem]:
  """Train problems start..start+n-1."""
  return [generate_problem(config, "train", i) for i in range(start, start + n)]


# ---------------------------------------------------------------------------
# Prompts and references.


def prompt(problem: Problem, template: str = "short") -> str:
  """Renders the prompt, e.g. "Using the numbers [44, 19, 35], ..."."""
  if template not in TEMPLATES:
    raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}")
  return TEMPLATES[template].format(nums=str([int(n) for n in problem.nums]), target=problem.target)


def reference_completion(problem: Problem) -> str:
  """A completion scoring 1.0, for supervised warm-up.

  Uses ``problem.solution``; for problems without one (loaded from files)
  falls back to the brute-force solver, which is slow beyond 4 numbers.

  Raises:
      ValueError: If the problem has no solution and the solver finds none.
  """
  solution = problem.solution
  if solution is None:
    solution = countdown_solver.solve(problem.nums, problem.target)
    if solution is None:
      raise ValueError(f"problem has no solution: {problem}")
  return f"{ANSWER_OPEN} {solution} {ANSWER_CLOSE}"


# ---------------------------------------------------------------------------
# Task bundle.


class CountdownTask:
  """Countdown bundled with its data source and prompt template.

  Training problems come from the generator, or from `train_data` (e.g. a
  loaded file) indexed modulo its length; evaluation problems always come
  from the generator's held-out test split.
  """

  name = "countdown"
  success_threshold = SUCCESS_THRESHOLD

  def __init__(
    self,
    config: GeneratorConfig | None = None,
    template: str = "short",
    train_data: Sequence[Problem] | None = None,
  ):
    """Initialises the task.

    Args:
        config: Generator settings; defaults to GeneratorConfig().
        template: Key of TEMPLATES used by `prompt`.
        train_data: Optional fixed training problems replacing the
            generator's train split.

    Raises:
        ValueError: On an unknown template or empty `train_data`.
    """
    if template not in TEMPLATES:
      raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}")
    if train_data is not None and not train_data:
      raise ValueError("train_data must not be empty")
    self.config = config if config is not None else GeneratorConfig()
    self.template = template
    self.train_data = tuple(train_data) if train_data is not None else None

  @classmethod
  def from_file(
    cls,
    path: str | os.PathLike[str],
    config: GeneratorConfig | None = None,
    template: str = "short",
  ) -> CountdownTask:
    """Task whose training problems come from a file (see load_problems).

    Rows whose canonical key falls in the generator's test split are
    dropped so the generated evaluation set stays held out.

    Raises:
        ValueError: If the file has no usable row (see load_problems) or
            every row is in the held-out split.
    """
    config = config if config is not None else GeneratorConfig()
    problems, _ = countdown_files.load_problems(path)
    train = [p for p in problems if split_of(p.nums, p.target, config.eval_fraction) == "train"]
    if not train:
      raise ValueError(f"no usable training problems in {path}: all {len(problems)} fall in the "
                       "generator's held-out test split")
    return cls(config=config, template=template, train_data=train)

  def train_problem(self, index: int) -> Problem:
    """Training problem at data position `index` (random access)."""
    if self.train_data is not None:
      return self.train_data[index % len(self.train_data)]
    return generate_problem(self.config, "train", index)

  def num_train_problems(self) -> int:
    """The training file's size; 0 when the generator serves every index."""
    return len(self.train_data) if self.train_data is not None else 0

  def eval_problems(self, n: int) -> list[Problem]:
    """The first `n` held-out problems."""
    return eval_problems(self.config, n)

  def prompt(self, problem: Problem) -> str:
    return prompt(problem, self.template)

  def score(self, completion: str, problem: Problem) -> float:
    return score(completion, problem.nums, problem.target)

  def is_success(self, score_value: float) -> bool:
    return is_success(score_value)

  def reward_inputs(self, problems) -> tuple[list[str], dict[str, list]]:
    """Reward functions get each problem's prompt and its ``nums`` and ``target``."""
    return ([self.prompt(p) for p in problems],
            {"nums": [list(p.nums) for p in problems], "target": [p.target for p in problems]})

  def reference_completion(self, problem: Problem) -> str:
    return reference_completion(problem)


@tasks_lib.TASKS.register("countdown")
@dataclasses.dataclass(frozen=True)
class CountdownSpec(GeneratorConfig, registry.Configurable):
  """``config.task.countdown``: the generator's settings (``GeneratorConfig``'s fields) and the
  prompt template.

  Training problems come from the generator, or from ``config.task.data_path`` (countdown rows,
  see countdown_files); evaluation problems always from the generator's held-out split.

  Attributes:
    template: prompt template (a TEMPLATES key).
  """

  template: str = "short"

  def generator(self) -> GeneratorConfig:
    """The generator settings alone (what CountdownTask and the file split take)."""
    return GeneratorConfig(**{f.name: getattr(self, f.name)
                              for f in dataclasses.fields(GeneratorConfig)})

  def __post_init__(self):
    self.generator()  # GeneratorConfig's checks, naming the bad setting
    if self.template not in TEMPLATES:
      raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {self.template!r}")

  def build(self, task_config) -> CountdownTask:
    if task_config.data_path:
      return CountdownTask.from_file(task_config.data_path, self.generator(),
                                     template=self.template)
    return CountdownTask(self.generator(), template=self.template)
