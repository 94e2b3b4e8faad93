"""RL tasks: problem sources, prompts and verifiers, behind one interface and one registry.

A task module registers a *spec* under its ``config.task.name``: a frozen dataclass
(``registry.Configurable``) whose fields are its own config group ``config.task.<name>`` and
whose ``build(task_config)`` returns the ``Task``. The shared keys of ``config.task`` (name,
data_path, train_size, chat_template) are read by ``build`` where they apply. Adding a task is
its module; ``make_task`` and the config defaults find it through ``TASKS``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import os

from grpo_jax import console, errors, registry
from grpo_jax.tasks import data_files

TASKS = registry.Registry("task", package="grpo_jax.tasks")


@runtime_checkable
class Task(Protocol):
  """What the prompt stream, the allocators, the verifier and evaluation use of a task.

  Problems are opaque to everything but the task. ``score`` runs on untrusted model output: it
  must parse, never execute, and may raise (the row then scores 0 and is counted).
  """

  name: str

  def train_problem(self, index: int) -> Any:
    """The training problem at data position ``index`` (random access, any index >= 0)."""

  def num_train_problems(self) -> int:
    """How many distinct training problems there are; 0 for an unbounded generator."""

  def eval_problems(self, n: int) -> list:
    """The first ``n`` held-out problems (a fixed list)."""

  def prompt(self, problem) -> str:
    """The prompt text of ``problem`` (before any chat template)."""

  def score(self, completion: str, problem) -> float:
    """The reward of ``completion`` (decoded text) for ``problem``."""

  def is_success(self, score_value: float) -> bool:
    """The 0/1 accuracy signal of a score."""

  # Optional, for reward functions in TRL's form and several held-out sets:
  #   reward_inputs(problems) -> (prompts, {column: [value per problem]})
  #   eval_sets(n) -> {set name: its first n problems (None: all)}
  #   messages(problem) -> the chat messages of a conversational prompt, or None
  #   default_rewards: the rewards used when config.task.rewards is empty (a task without a
  #     verifier of its own leaves score / is_success out and names these)


class TaskSpec(Protocol):
  """A registered task: its own config group's fields, and the task they build."""

  @classmethod
  def config_group(cls): ...

  @classmethod
  def from_group(cls, group, **derived): ...

  def build(self, task_config) -> Task: ...


def eval_sets(task, n: int | None) -> dict[str, list]:
  """The task's held-out sets by name, the first ``n`` problems of each (None: whole, for a
  task with named sets); a task with one unnamed set gives ``{"": task.eval_problems(n)}``."""
  if hasattr(task, "eval_sets"):
    return task.eval_sets(n)
  return {"": task.eval_problems(n)}


def infer_name(config) -> None:
  """``task.name`` "file" for a ``task.data_path`` of rows that are not Countdown's (the first
  row has neither ``nums`` nor ``target``: a malformed Countdown row stays Countdown's, whose
  loader names what is wrong), when the name was left at its default (countdown); says so in
  one line. Nothing else changes."""
  t = config.task
  if t.name != "countdown" or not t.data_path or not os.path.isfile(t.data_path):
    return
  try:
    rows, _ = data_files.read_rows(t.data_path)
  except (ValueError, ImportError):
    return  # the task that reads the file names what is wrong with it
  first = next((r for r in rows if isinstance(r, dict)), None)
  if first is not None and "nums" not in first and "target" not in first:
    t.name = "file"
    console.say(f"grpo_jax: task.name=file (the rows of {t.data_path} are not Countdown's "
                "nums / target)")


def make_task(config) -> Task:
  """The task named by ``config.task.name``, built from ``config.task.<name>``.

  Raises:
    ConfigError: an unknown name, a setting out of range, or a data file that cannot be used
      (empty, not JSON, no usable row: the message names the first malformed row and why).
  """
  t = config.task
  try:
    spec_cls = TASKS.get(t.name)
  except KeyError as e:
    raise errors.ConfigError(f"config.task.name: {e.args[0]}") from None
  try:
    spec = spec_cls.from_group(t.get(t.name, {}))
  except ValueError as e:
    raise errors.ConfigError(f"config.task.{t.name}: {e}") from None
  try:
    return spec.build(t)
  except errors.ConfigError:
    raise
  except ValueError as e:
    if not t.data_path or not getattr(spec, "reads_data_path", True):
      raise
    raise errors.ConfigError(f"config.task.data_path: {e}") from None
