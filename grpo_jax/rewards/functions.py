"""Reward functions in TRL's form, built in or the user's own, and DAPO's overlong penalty.

A reward function is ``fn(prompts, completions, **columns) -> list[float | None]``, TRL's
convention (``GRPOTrainer(reward_funcs=...)``): it is called with keywords only, ``prompts`` and
``completions`` (strings, or for conversational prompts lists of messages: the prompt's own
messages, and ``[{"role": "assistant", "content": text}]`` per completion), ``completion_ids``
(the token ids of each completion) and every column of the task's rows by name, so a function
written for TRL takes ``**kwargs`` for the columns it does not read and runs unchanged. ``None``
means "no reward for this row". The reference answer the task read is the column ``answer``.

Built-ins (``REWARDS``, by name in ``config.task.rewards``): ``math`` (math-verify, in worker
processes under a time bound: ``math_answers``), ``gsm8k`` (a numeric answer, ``#### n``),
``countdown`` (the Countdown verifier, columns ``nums`` and ``target``) and ``format`` (the
answer tags are there). A user's own function is named ``"pkg.module:fn"`` or
``"path/to/file.py:fn"`` (``load``). Rewards are arbitrary Python, never model output run as
code: the built-ins only parse the completion. How several rewards combine into a score and an
accuracy signal is ``grpo_jax.rewards.scoring``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from typing import Any, Callable, Sequence

import numpy as np

from grpo_jax import registry
from grpo_jax.rewards import math_answers
from grpo_jax.tasks import countdown, gsm8k

RewardFn = Callable[..., Sequence]
REWARDS = registry.Registry("reward function")


class RewardSpecError(ValueError):
  """A ``config.task.rewards`` entry that does not name a callable reward function."""


def overlong_penalty(lengths_N: np.ndarray, truncated_N: np.ndarray, max_len: int, buffer: int,
                     factor: float = 1.0) -> np.ndarray:
  """DAPO's soft overlong penalty (arXiv 2503.14476), in tokens.

  0 for length <= max_len - buffer; (max_len - buffer - length) / buffer in the last ``buffer``
  tokens; -1 for a completion cut off at max_len without EOS. Times ``factor``; all zeros when
  ``buffer`` is 0.
  """
  lengths = np.asarray(lengths_N, np.float64)
  if buffer <= 0:
    return np.zeros_like(lengths)
  soft = np.minimum(0.0, (max_len - buffer - lengths) / buffer)
  return factor * np.where(np.asarray(truncated_N, bool), -1.0, soft)


def completion_text(completion: Any) -> str:
  """The text of a completion: itself, or the content of its last message (conversational)."""
  if isinstance(completion, str):
    return completion
  if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
    return str(completion[-1].get("content", ""))
  return ""


def _references(answer, n: int) -> list:
  return list(answer) if answer is not None else [None] * n


@REWARDS.register("gsm8k")
def gsm8k_reward(completions, answer=None, **kwargs) -> list[float | None]:
  """1.0 when the final number (after ``####``, else in ``\\boxed{}``, else the last one)
  equals the reference's (a number, or a GSM8K solution ending in ``#### n``), else 0.0; None
  for a row without a numeric reference."""
  del kwargs
  out = []
  for c, ref in zip(completions, _references(answer, len(completions))):
    ref = gsm8k.reference_answer(ref) if isinstance(ref, str) and "####" in ref else ref
    if gsm8k.parse_number(str(ref) if ref is not None else None) is None:
      out.append(None)
    else:
      out.append(gsm8k.score(completion_text(c), str(ref)))
  return out


@REWARDS.register("countdown")
def countdown_reward(completions, nums=None, target=None, **kwargs) -> list[float | None]:
  """Countdown's graded score (1.0 solved, 0.1 a well-formed wrong answer, 0.0 none) from the
  columns ``nums`` and ``target``; None for a row without them."""
  del kwargs
  n = len(completions)
  return [None if ns is None or t is None else countdown.score(completion_text(c), ns, t)
          for c, ns, t in zip(completions, _references(nums, n), _references(target, n))]


# The columns each built-in reads (its keyword defaults let it run without them; the Scorer
# refuses a task whose rows lack them before training starts).
gsm8k_reward.needs = ("answer",)
countdown_reward.needs = ("nums", "target")

_ANSWER = re.compile(r"<answer>.+?</answer>|\\boxed\{", re.DOTALL)


@REWARDS.register("format")
def format_reward(completions, **kwargs) -> list[float]:
  """1.0 when the completion gives its answer in tags (``<answer>...</answer>`` or
  ``\\boxed{...}``) and closes every ``<think>`` it opens, else 0.0."""
  del kwargs
  out = []
  for c in completions:
    text = completion_text(c)
    closed = text.count("<think>") <= text.count("</think>")
    out.append(1.0 if closed and _ANSWER.search(text) else 0.0)
  return out


@REWARDS.register("math")
class MathReward:
  """1.0 when math-verify finds the completion's final answer (its last ``\\boxed{}``, else the
  final expression) equivalent to the reference ``answer``, else 0.0; None for a reference that
  does not parse (kept out of "success"). Runs ``math_answers.MathVerifier``: worker processes,
  each answer bounded by ``timeout_s`` (a timeout scores 0), the batch by ``batch_timeout_s``.

  ``take_counts`` gives the unparseable answers, timeouts and unparseable references since the
  last call (the step's ``reward/unparseable``, ``reward/timeouts``, ``reward/bad_gold``).
  """

  needs = ("answer",)

  def __init__(self, workers: int = 0, timeout_s: float = 5.0,
               batch_timeout_s: float | None = None):
    self.workers = workers or max(1, min(8, os.cpu_count() or 1))
    self.timeout_s, self.batch_timeout_s = timeout_s, batch_timeout_s
    self._verifier = None
    self._counts = {"unparseable": 0, "timeouts": 0, "bad_gold": 0}

  def __call__(self, completions, answer=None, **kwargs) -> list[float | None]:
    del kwargs
    refs = _references(answer, len(completions))
    todo = [i for i, ref in enumerate(refs) if isinstance(ref, str) and ref.strip()]
    verdicts = dict.fromkeys(range(len(refs)), "bad_gold")
    if todo:
      if self._verifier is None:
        kw = {"batch_timeout_s": self.batch_timeout_s} if self.batch_timeout_s else {}
        self._verifier = math_answers.MathVerifier(self.workers, self.timeout_s, **kw)
      got = self._verifier.verify([refs[i] for i in todo],
                                  [completion_text(completions[i]) for i in todo])
      verdicts.update(zip(todo, got))
    for v in verdicts.values():
      key = {"unparseable": "unparseable", "timeout": "timeouts", "bad_gold": "bad_gold"}.get(v)
      if key:
        self._counts[key] += 1
    return [None if verdicts[i] == "bad_gold" else float(verdicts[i] == "correct")
            for i in range(len(refs))]

  def take_counts(self) -> dict[str, int]:
    counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
    return counts

  def close(self) -> None:
    if self._verifier is not None:
      self._verifier.close()
      self._verifier = None


def get(name: str, **settings) -> RewardFn:
  """The built-in reward function ``name`` (``settings`` go to the ones that take them: math's
  workers, timeout_s, batch_timeout_s).

  Raises:
    KeyError: no built-in of that name (the message lists them).
  """
  fn = REWARDS.get(name)
  return fn(**settings) if isinstance(fn, type) else fn


def _load_attr(module, attr: str, spec: str) -> RewardFn:
  if not hasattr(module, attr):
    raise RewardSpecError(f"{spec!r}: {module.__name__} has no {attr!r}")
  fn = getattr(module, attr)
  if not callable(fn):
    raise RewardSpecError(f"{spec!r}: {attr} is a {type(fn).__name__}, not a function")
  return fn


def load(spec: str, **settings) -> tuple[str, RewardFn]:
  """(metric name, function) of one ``config.task.rewards`` entry.

  Args:
    spec: a built-in's name (``REWARDS``), ``"pkg.module:fn"`` (imported) or
      ``"path/to/file.py:fn"`` (loaded from the file; a relative path is from the working
      directory).
    settings: for the built-ins that take them (``get``).

  Raises:
    RewardSpecError: an unknown name, a module or file that does not import (the error it
      raised, in one line), a missing attribute, or one that is not callable.
  """
  spec = spec.strip()
  if ":" not in spec:
    try:
      return spec, get(spec, **settings)
    except KeyError:
      raise RewardSpecError(
          f"{spec!r} is not a built-in reward ({', '.join(REWARDS.names())}) and not "
          "'pkg.module:fn' or 'path/to/file.py:fn'") from None
  where, _, attr = spec.rpartition(":")
  if not where or not attr.isidentifier():
    raise RewardSpecError(f"{spec!r}: expected 'pkg.module:fn' or 'path/to/file.py:fn'")
  try:
    if where.endswith(".py"):
      if not os.path.isfile(where):
        raise RewardSpecError(f"{spec!r}: no such file {where}")
      name = "grpo_jax_user_rewards_" + re.sub(r"\W", "_", os.path.abspath(where))
      module = sys.modules.get(name)  # run once: the config check and the scorer both load it
      if module is None:
        module_spec = importlib.util.spec_from_file_location(name, where)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look modules up by name
        try:
          module_spec.loader.exec_module(module)
        except BaseException:
          del sys.modules[name]  # a failed import is not cached: fixed, it loads next time
          raise
    else:
      module = importlib.import_module(where)
  except RewardSpecError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (the user's module raised: say what)
    first = str(e).splitlines()[0] if str(e) else ""
    raise RewardSpecError(f"{spec!r}: importing {where} raised {type(e).__name__}: {first}"
                          ) from None
  return attr, _load_attr(module, attr, spec)
