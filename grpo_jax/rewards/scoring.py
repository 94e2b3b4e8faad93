"""A batch of completions scored: the reward, the accuracy signal ("success") and what failed.

``Scorer`` turns decoded completions into what the train step and evaluation use. Either the
task's own verifier (``task.score`` / ``task.is_success``: Countdown, GSM8K; the default when
``config.task.rewards`` is empty) or reward functions in TRL's form (``grpo_jax.rewards.functions``), each
with a weight: the score is the weighted sum of their values, a ``None`` counting 0 (TRL's
``nansum``), and a row succeeds when the *success reward* (``task.success_reward``, by default
the first) is at least ``task.success_threshold``; a row it gives no value (None) never
succeeds. "Success" decides which groups are effective for POPO, dynamic sampling, SARA and the
selectors, so it is the accuracy signal, not the shaped score.

Reward functions are called as TRL calls them (``grpo_jax.rewards.calls``): with
``trainer_state``, ``log_metric`` and ``log_extra`` besides the rows, ``async def`` functions
awaited together. They are the user's code: one that raises (or whose coroutine raises),
returns a list of the wrong length or a value that is not a finite number gives no value for
that batch, is counted (``reward/<name>_failures``) and named once on the console; training
goes on. When every function has given no value for any row of ``max_failed_batches`` batches
in a row (failed, or returned None for every row: nothing to train on), the run stops
(``RewardError``), before that step updates anything; a function that returns None for some
rows (TRL's multi-task rewards) is fine. ``rl.score_base="accuracy"`` replaces the score by
+1 / -1 from success (DAPO's rule-based reward, arXiv 2503.14476).
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers

import numpy as np

from grpo_jax import console, errors
from grpo_jax.rewards import calls as reward_calls, functions as rewards
from grpo_jax.tasks import data_files

_LOG = logging.getLogger(__name__)
SCORE_BASES = ("task", "accuracy")
# What TRL passes every reward function besides the rows (``reward_calls``).
CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                 "log_metric")


class RewardError(RuntimeError):
  """Every reward function failed on too many batches in a row: the run stops."""


def score_completions(task, texts, problems) -> tuple[np.ndarray, np.ndarray]:
  """The task verifier's score of each completion, and which rows' verifier raised (score 0).

  Returns:
    (float32 scores [R], bool errors [R]); a verifier exception never stops training.
  """
  scores, failed = [], []
  for text, problem in zip(texts, problems):
    try:
      scores.append(float(task.score(text, problem)))
      failed.append(False)
    except Exception:  # pylint: disable=broad-except
      failed.append(True)
      scores.append(0.0)
  if any(failed):
    _LOG.warning("%d reward computation(s) raised; scored 0", sum(failed))
  return np.asarray(scores, np.float32), np.asarray(failed, bool)


def reward_inputs(task, problems) -> tuple[list, dict[str, list]]:
  """(prompts, columns) a reward function is called with for ``problems``: the task's own
  (``task.reward_inputs``), or the prompt texts and no column."""
  if hasattr(task, "reward_inputs"):
    return task.reward_inputs(problems)
  return [task.prompt(p) for p in problems], {}


def _values(out, n: int) -> tuple[np.ndarray, str]:
  """(float64 [n], NaN for None) and "", or (NaNs, why ``out`` is not n finite numbers)."""
  nans = np.full((n,), np.nan)
  if isinstance(out, np.ndarray):
    out = out.tolist()
  if not isinstance(out, (list, tuple)):
    return nans, f"returned a {type(out).__name__}, not a list of {n} rewards"
  if len(out) != n:
    return nans, f"returned {len(out)} rewards for {n} completions"
  values = np.empty((n,))
  for i, v in enumerate(out):
    if v is None:
      values[i] = np.nan
    elif isinstance(v, numbers.Real) and math.isfinite(float(v)):
      values[i] = float(v)
    elif isinstance(v, numbers.Real) and math.isnan(float(v)):
      values[i] = np.nan  # TRL's own encoding of "no reward"
    else:
      return nans, f"returned {data_files.short(v)} at row {i} (need a finite number or None)"
  return values, ""


class Scorer:
  """Scores batches of decoded completions (see the module docstring).

  Args:
    task: the task (``score`` / ``is_success`` for its own verifier, ``reward_inputs`` for
      reward functions).
    functions: (name, fn) reward functions in TRL's form; empty: the task's own verifier.
    weights: one per function (default all 1).
    success_reward: the function whose value decides success (index into ``functions``).
    success_threshold: a value >= this (less 1e-9) is a success.
    score_base: "task" (the combined reward) or "accuracy" (+1 success / -1 otherwise).
    max_failed_batches: stop after this many batches in a row on which no function gave a
      value for any row (0: never).

  Attributes:
    state: the ``reward_calls.TrainerState`` the functions see as ``trainer_state`` (the loop
      keeps it up to date).
  """

  def __init__(self, task, functions=(), weights=None, *, success_reward: int = 0,
               success_threshold: float = 1.0, score_base: str = "task",
               max_failed_batches: int = 3):
    if score_base not in SCORE_BASES:
      raise ValueError(f"score_base must be one of {SCORE_BASES}, got {score_base!r}")
    self.task, self.functions = task, list(functions)
    self.weights = list(weights) if weights is not None else [1.0] * len(self.functions)
    if len(self.weights) != len(self.functions):
      raise ValueError(f"{len(self.weights)} weights for {len(self.functions)} reward functions")
    if self.functions and not 0 <= success_reward < len(self.functions):
      raise ValueError(f"success_reward {success_reward} is not one of the "
                       f"{len(self.functions)} reward functions")
    self.success_reward, self.success_threshold = success_reward, success_threshold
    self.score_base, self.max_failed_batches = score_base, max_failed_batches
    self.failed_in_a_row = 0
    self.state = reward_calls.TrainerState()
    self._named = set()  # functions (and notes) said on the console
    self._sums = {}  # metric -> [sum, count] since take_stats
    # What the functions log, and the completions rows of batches that logged columns: for
    # training batches (record=True) and for evaluation's, kept apart.
    self._logs = {True: reward_calls.RewardLog(), False: reward_calls.RewardLog()}
    self._rows = {True: [], False: []}

  def check_columns(self, columns) -> None:
    """Raises errors.ConfigError when a function needs an argument that neither the call
    (``CALL_KEYWORDS``) nor the task's ``columns`` supplies."""
    given = {*CALL_KEYWORDS, *columns}
    for name, fn in self.functions:
      lacking = [c for c in getattr(fn, "needs", ()) if c not in given]
      errors.check(not lacking, "task.rewards",
                   f"the {name} reward reads the column(s) {', '.join(map(repr, lacking))}, "
                   f"which the {self.task.name} task's rows do not have (they have "
                   f"{', '.join(sorted(columns)) or 'none'})")
      try:
        params = inspect.signature(fn).parameters.values()
      except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        continue
      missing = [p.name for p in params if p.default is p.empty
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in given]
      errors.check(not missing, "task.rewards",
                   f"reward {name!r} needs {', '.join(map(repr, missing))}, but the rows have "
                   f"the columns {', '.join(sorted(columns)) or '(none)'}")

  def score(self, problems, texts, completion_ids=None, *, record: bool = True):
    """Scores one batch.

    Args:
      problems: the task's problem of each row [R].
      texts: the decoded completions [R].
      completion_ids: the token ids of each completion (lists) [R]; reward functions get
        ``[]`` for each without them.
      record: count this batch in ``take_stats`` and the failure limit (False: evaluation,
        whose logged metrics and columns ``take_log(training=False)`` gives).

    Returns:
      (float32 scores [R], bool success [R], bool errors [R]: a reward failed for the row).

    Raises:
      RewardError: no function gave a value on ``max_failed_batches`` batches in a row.
    """
    if self.functions:
      scores, success, failed, table = self._functions(problems, texts, completion_ids, record)
    else:
      scores, failed = score_completions(self.task, texts, problems)
      success = np.array([self.task.is_success(s) for s in scores], bool)
      table = None
    if self.score_base == "accuracy":
      scores = np.where(success, 1.0, -1.0).astype(np.float32)
    if table is not None:  # a function logged columns: the batch's rows for the completions file
      prompts, columns = table
      self._rows[record] += [
          {"prompt": prompts[i], "completion": texts[i], "score": float(scores[i]),
           "success": bool(success[i]), **{c: v[i] for c, v in columns.items()}}
          for i in range(len(texts))]
    return scores, success, failed

  def _functions(self, problems, texts, completion_ids, record):
    n = len(texts)
    prompts, columns = reward_inputs(self.task, problems)
    if prompts and not isinstance(prompts[0], str):  # conversational: completions as messages
      completions = [[{"role": "assistant", "content": t}] for t in texts]
    else:
      completions = list(texts)
    log = self._logs[record]
    log.start_batch(n)
    kwargs = {**columns, "prompts": prompts, "completions": completions,
              "completion_ids": completion_ids if completion_ids is not None else [[]] * n,
              "trainer_state": self.state, "log_extra": log.log_extra,
              "log_metric": log.log_metric}
    values, failures = [], []
    for (name, _), (out, error) in zip(self.functions,
                                       reward_calls.call_all([f for _, f in self.functions],
                                                             kwargs)):
      if error is not None:
        v, why = np.full((n,), np.nan), f"raised {type(error).__name__}: {error}"
      else:
        v, why = _values(out, n)
      values.append(v)
      failures.append(why)
      if record:
        self._add(f"reward/{name}_failures", float(bool(why)), 1)
        if not why and np.isfinite(v).any():
          self._add(f"reward/{name}_mean", float(np.nansum(v)), int(np.isfinite(v).sum()))
      if why:
        self._say_once(name, f"grpo_jax: reward {name!r} {why.splitlines()[0]}; its rows get "
                       f"no value from it (counted in reward/{name}_failures; training goes on)")
    logged, notes = log.end_batch()
    for note in notes:
      self._say_once(note, f"grpo_jax: a reward function's {note}")
    for fn in (f for _, f in self.functions if hasattr(f, "take_counts")):
      counts = fn.take_counts()  # taken either way: evaluation's counts are not the step's
      for key, count in counts.items() if record else ():
        self._add(f"reward/{key}", float(count), 0)
    stacked = np.stack(values)  # [functions, R]
    if record:
      self._limit(failures, stacked)
    w = np.asarray(self.weights)[:, None]
    scores = np.nansum(w * stacked, axis=0).astype(np.float32)
    decider = stacked[self.success_reward]
    success = np.nan_to_num(decider, nan=-np.inf) >= self.success_threshold - 1e-9
    failed = np.full((n,), any(failures), bool)
    table = None
    if logged:
      per_function = {name: [None if math.isnan(x) else float(x) for x in v]
                      for (name, _), v in zip(self.functions, stacked)}
      table = prompts, {**per_function, **logged}
    return scores, success, failed, table

  def _say_once(self, key: str, line: str) -> None:
    if key not in self._named:
      self._named.add(key)
      console.say(line)

  def _limit(self, failures, values_FxR) -> None:
    """Counts a batch on which no function gave any row a value (it failed, or returned None
    for every row): ``max_failed_batches`` of them in a row stop the run."""
    none = [not why and not np.isfinite(v).any() for why, v in zip(failures, values_FxR)]
    empty = all(bool(why) or no for why, no in zip(failures, none))
    if empty and any(none):
      self._add("reward/valueless_batches", 1.0, 0)
      self._say_once("<valueless>", "grpo_jax: no reward function gave a value for any row of "
                     "a batch (None for every row: nothing in it is trained on; counted in "
                     "reward/valueless_batches)")
    self.failed_in_a_row = self.failed_in_a_row + 1 if empty else 0
    if self.max_failed_batches and self.failed_in_a_row >= self.max_failed_batches:
      n = values_FxR.shape[1]
      last = "; ".join(f"{name}: {why.splitlines()[0] if why else f'None for all {n} rows'}"
                       for (name, _), why in zip(self.functions, failures))
      what = "failed or returned None for every row" if any(none) else "failed"
      raise RewardError(f"every reward function {what} on {self.failed_in_a_row} batches in a "
                        f"row (last: {last}); nothing of this step was trained on and the "
                        "checkpoints are as they were")

  def _add(self, key: str, total: float, count: int) -> None:
    s = self._sums.setdefault(key, [0.0, 0])
    s[0] += total
    s[1] += count

  def take_stats(self) -> dict[str, float]:
    """The ``reward/`` metrics since the last call: each function's mean value over the rows
    it scored (``<name>_mean``) and failed batches (``<name>_failures``), the built-ins'
    counts (``unparseable``, ``timeouts``, ``bad_gold``), batches with no value at all
    (``valueless_batches``) and what the functions logged with ``log_metric`` (``<name>``,
    its mean; a name that is one of the above is said once and left out). Empty for the
    task's verifier."""
    out = {key: (total / count if key.endswith("_mean") else total)
           for key, (total, count) in self._sums.items() if count or not key.endswith("_mean")}
    self._sums = {}
    for name, value in self._logs[True].take_metrics().items():
      if f"reward/{name}" in out:
        self._say_once(f"<metric {name}>", f"grpo_jax: a reward function's log_metric({name!r}) "
                       f"has the name of a built-in metric (reward/{name}): left out")
      else:
        out[f"reward/{name}"] = value
    return out

  def take_log(self, training: bool = True) -> tuple[dict[str, float], list[dict]]:
    """What the functions logged since the last call, on training batches or on evaluation's:
    (``log_metric``'s means by name, the completions rows of the batches in which a function
    logged a column: prompt, completion, score, success, each function's value, the
    columns). Training's metrics are ``take_stats``'s: here only its rows."""
    metrics = {} if training else self._logs[False].take_metrics()
    rows, self._rows[training] = self._rows[training], []
    return metrics, rows

  def close(self) -> None:
    """Stops the reward functions' workers (math-verify's processes)."""
    for _, fn in self.functions:
      if hasattr(fn, "close"):
        fn.close()


def parse_weights(text: str, n: int) -> list[float]:
  """``task.reward_weights`` ("1,0.5"; "" = all 1) as n floats.

  Raises:
    ValueError: not numbers, or not n of them.
  """
  if not text.strip():
    return [1.0] * n
  try:
    weights = [float(w) for w in text.split(",")]
  except ValueError:
    raise ValueError(f"{text!r} is not comma-separated numbers") from None
  if len(weights) != n or not all(math.isfinite(w) for w in weights):
    raise ValueError(f"{text!r}: need {n} finite weight(s), one per reward")
  return weights


def reward_specs(task_config, task=None) -> list[str]:
  """The entries of ``task.rewards``, or the task's default (``task.default_rewards``)."""
  text = task_config.rewards or getattr(task, "default_rewards", "")
  return [s.strip() for s in text.split(",") if s.strip()]


def make_scorer(config, task) -> Scorer:
  """The Scorer ``config.task`` describes for ``task`` (reward functions loaded, their
  arguments checked against the task's columns).

  Raises:
    errors.ConfigError: a reward that does not load, weights that do not match, a success
      reward that is not among them, a task without a verifier and no reward named.
  """
  t = config.task
  specs = reward_specs(t, task)
  errors.check(bool(specs) or hasattr(task, "score"), "task.rewards",
               f"the {task.name} task has no verifier of its own: name a reward (e.g. "
               f"task.rewards=math; built-ins: {', '.join(rewards.REWARDS.names())})")
  settings = dict(workers=t.math_workers, timeout_s=t.math_timeout_s,
                  batch_timeout_s=t.math_batch_timeout_s or None)
  functions = []
  for spec in specs:
    try:
      name, fn = rewards.load(spec, **(settings if spec == "math" else {}))
    except rewards.RewardSpecError as e:
      raise errors.ConfigError(f"config.task.rewards: {e}") from None
    errors.check(name not in dict(functions), "task.rewards", f"two rewards named {name!r}")
    functions.append((name, fn))
  try:
    weights = parse_weights(t.reward_weights, len(functions))
  except ValueError as e:
    raise errors.ConfigError(f"config.task.reward_weights: {e}") from None
  names = [n for n, _ in functions]
  success = t.success_reward or (names[0] if names else "")
  errors.check(not names or success in names, "task.success_reward",
               f"{success!r} is not one of the rewards ({', '.join(names)})")
  scorer = Scorer(task, functions, weights, success_reward=names.index(success) if names else 0,
                  success_threshold=t.success_threshold, score_base=config.rl.score_base,
                  max_failed_batches=t.max_reward_failures)
  if functions:
    problem = task.train_problem(0)
    scorer.check_columns(reward_inputs(task, [problem])[1])
    check_references(scorer, task, t.answer_field)
  return scorer


# Rows read for the reference check: all of a file's, the first of a larger or unbounded set.
_CHECKED_ROWS = 4096


def check_references(scorer: Scorer, task, answer_field: str = "") -> None:
  """Refuses, before training, a task whose rows give a built-in reward nothing to compare
  with: a column the built-in reads (``needs``, e.g. math's ``answer``) that is None in every
  training row checked, or in every row of a held-out set. Such a run would score every row
  None (``bad_gold``), train on nothing and evaluate to 0.

  Raises:
    errors.ConfigError: naming the reward, the set, the columns the rows do have and
      ``task.answer_field``.
  """
  size = task.num_train_problems() if hasattr(task, "num_train_problems") else 0
  sets = {"training": [task.train_problem(i) for i in range(min(size or 1, _CHECKED_ROWS))]}
  if hasattr(task, "eval_sets"):  # named held-out files: each is checked on its own
    sets.update({f"held-out {name!r}": rows[:_CHECKED_ROWS]
                 for name, rows in task.eval_sets(None).items()})
  for where, problems in sets.items():
    if not problems:
      continue
    _, columns = reward_inputs(task, problems)
    filled = sorted(c for c, v in columns.items() if any(x is not None for x in v))
    for name, fn in scorer.functions:
      empty = [c for c in getattr(fn, "needs", ()) if c in columns and c not in filled]
      field = "task.answer_field" if "answer" in empty else "task.rewards"
      errors.check(
          not empty, field,
          f"the {name} reward compares with the column(s) {', '.join(map(repr, empty))}, but "
          f"no {where} row of the {task.name} task has a value there (their fields: "
          f"{', '.join(c for c in filled if c != 'answer') or 'none'}; "
          f"task.answer_field={answer_field!r}): name the reference's field, e.g. "
          "--config.task.answer_field=<field>")
