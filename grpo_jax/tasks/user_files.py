"""Your own task from local files: TRL's, verl's or plain question / answer rows.

``task.name=file`` (inferred when ``task.data_path`` holds rows that are not Countdown's) trains
on the rows of ``config.task.data_path`` (.jsonl, .json or .parquet) and evaluates on each file
of ``config.task.eval_paths`` (comma-separated; each set named by its file stem, e.g.
``math500``, or its folder and stem when two files share one: ``set_names``). With no held-out file, a seeded ``task.file.eval_fraction`` of the training rows
is held out as the set ``heldout`` (and the console says so). The row schema is detected per
file (``row_schemas``: verl, trl, qa) or named by ``task.schema``; ``task.prompt_field`` /
``task.answer_field`` rename the two fields it reads. Rows that do not fit are skipped, counted
and the first named; a file with no usable row is an error naming it.

Prompts: a conversational prompt (a list of messages) always goes through the tokenizer's chat
template (its contents joined by blank lines when the tokenizer has none); a string prompt
only with ``task.chat_template``. ``task.system_prompt`` is a system message before the
prompt's own (a leading line for a string prompt without the template). The task has no
verifier of its own: its rewards are ``task.rewards`` (``math`` unless named), called with
every other column of the row and ``answer``, the reference the schema reads.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from grpo_jax import console, errors, registry
from grpo_jax import tasks as tasks_lib
from grpo_jax.tasks import row_schemas

HELDOUT = "heldout"


class FileTask:
  """Training and held-out ``row_schemas.Example`` problems from local files.

  Args:
    train: the training examples (data position i reads ``train[i % len(train)]``).
    eval_sets: held-out examples by set name (in ``eval_paths`` order).
    system_prompt: a system message before each prompt ("" = none).
    chat_template: render string prompts with the tokenizer's chat template too.
  """

  name = "file"
  default_rewards = "math"

  def __init__(self, train, eval_sets: dict, system_prompt: str = "",
               chat_template: bool = False):
    self.train, self._eval_sets = list(train), dict(eval_sets)
    self.system_prompt, self.chat_template = system_prompt, chat_template

  def train_problem(self, index: int) -> row_schemas.Example:
    return self.train[index % len(self.train)]

  def num_train_problems(self) -> int:
    return len(self.train)

  def eval_sets(self, n: int | None) -> dict[str, list]:
    """Each held-out set's first ``n`` examples (None: all of them)."""
    return {name: examples[:n] for name, examples in self._eval_sets.items()}

  def eval_problems(self, n: int) -> list:
    """The first ``n`` problems of the first held-out set."""
    return next(iter(self.eval_sets(n).values()))

  def messages(self, problem) -> list[dict] | None:
    """The chat messages of the prompt (system prompt first), or None for a string prompt
    rendered without the template."""
    system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
    if problem.conversational:
      own = list(problem.prompt)
      return own if own[0]["role"] == "system" else system + own
    if self.chat_template:
      return system + [{"role": "user", "content": problem.prompt}]
    return None

  def prompt(self, problem) -> str:
    """The prompt as text: a string prompt (after the system prompt's line), or a
    conversational prompt's contents joined by blank lines."""
    if problem.conversational:
      return "\n\n".join(m["content"] for m in self.messages(problem))
    return f"{self.system_prompt}\n\n{problem.prompt}" if self.system_prompt else problem.prompt

  def reward_inputs(self, problems) -> tuple[list, dict[str, list]]:
    """(the rows' own prompts, every other column by name, ``answer`` the reference read)."""
    names = []
    for p in problems:
      names += [k for k in p.columns if k not in names]
    columns = {k: [p.columns.get(k) for p in problems] for k in names}
    columns["answer"] = [p.answer for p in problems]
    prompts = [list(p.prompt) if p.conversational else p.prompt for p in problems]
    return prompts, columns


def _load(path: str, task_config) -> list[row_schemas.Example]:
  """The usable examples of one file; skipped rows said in one line."""
  examples, skipped, schema, first = row_schemas.load_examples(
      path, task_config.schema, task_config.prompt_field, task_config.answer_field,
      with_reason=True)
  if skipped:
    console.say(f"grpo_jax: {path}: skipped {skipped} of {skipped + len(examples)} row(s) that "
                f"do not fit the {schema} schema (first: {first or 'unequal JSON columns'})")
  return examples


def set_names(paths: list[str]) -> dict[str, str]:
  """{set name: path} of the held-out files: each named by its file stem; files that share a
  stem by their folder's name and the stem (``a_test``, ``b_test``), or the whole path's.

  Raises:
    errors.ConfigError: one file listed twice.
  """
  seen = set()
  for path in paths:
    real = os.path.realpath(path)
    errors.check(real not in seen, "task.eval_paths",
                 f"{path} is listed twice: name each held-out file once")
    seen.add(real)
  stem = lambda p: os.path.splitext(os.path.basename(p))[0]
  longer = lambda p: "_".join(filter(None, [os.path.basename(os.path.dirname(
      os.path.abspath(p))), stem(p)]))
  whole = lambda p: os.path.splitext(os.path.abspath(p))[0].strip(os.sep).replace(os.sep, "_")
  names = [stem(p) for p in paths]
  for rename in (longer, whole):
    names = [rename(p) if names.count(n) > 1 else n for p, n in zip(paths, names)]
  return dict(zip(names, paths))


@tasks_lib.TASKS.register("file")
@dataclasses.dataclass(frozen=True)
class FileSpec(registry.Configurable):
  """``config.task.file``: the held-out split when ``config.task.eval_paths`` is empty.

  Attributes:
    eval_fraction: the share of training rows held out (at least one row, at most 512).
    split_seed: the seed of that split (fixed: every run of a sweep sees the same set).
  """

  eval_fraction: float = 0.1
  split_seed: int = 0

  def __post_init__(self):
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

  def build(self, task_config) -> FileTask:
    if not task_config.data_path:
      raise errors.ConfigError("config.task.data_path: the file task reads task.data_path: "
                               "pass --config.task.data_path=train.parquet (or .jsonl / .json)")
    train = _load(task_config.data_path, task_config)
    paths = [p.strip() for p in task_config.eval_paths.split(",") if p.strip()]
    sets = {}
    for name, path in set_names(paths).items():
      try:
        sets[name] = _load(path, task_config)
      except (ValueError, FileNotFoundError) as e:
        raise errors.ConfigError(f"config.task.eval_paths: {e}") from None
    if not sets:
      if len(train) < 2:
        raise ValueError(f"{task_config.data_path}: one usable row; a held-out split needs "
                         "two (or name a held-out file in task.eval_paths)")
      # At least one row held out, at least one left to train on, at most 512.
      held = min(512, len(train) - 1, max(1, round(self.eval_fraction * len(train))))
      order = np.random.default_rng(self.split_seed).permutation(len(train))
      sets[HELDOUT] = [train[i] for i in sorted(order[:held])]
      train = [train[i] for i in sorted(order[held:])]
      console.say(f"grpo_jax: no task.eval_paths: holding out {held} of {len(train) + held} "
                  f"rows of {task_config.data_path} as the set {HELDOUT!r} "
                  f"(task.file.eval_fraction={self.eval_fraction}, seed {self.split_seed})")
    return FileTask(train, sets, task_config.system_prompt, task_config.chat_template)
