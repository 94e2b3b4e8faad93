"""What a batch's reward functions are called with beyond the rows, and how they are awaited.

TRL's GRPOTrainer passes every reward function three keywords besides ``prompts``,
``completions``, ``completion_ids`` and the rows' columns, and awaits ``async def`` functions
together (``asyncio.gather``); a function written for it may read any of them, by parameter or
from ``**kwargs``:

* ``trainer_state``: TRL passes ``transformers.TrainerState``; here ``TrainerState`` below,
  with the fields reward functions read (``global_step``, ``max_steps``, ``epoch``, the process
  flags) and this codebase's budgets. The object is the run's own and changes as it goes.
* ``log_metric(name, value)``: a scalar, averaged over the step's calls and written as
  ``reward/<name>`` in the step's record of ``metrics.jsonl`` (in an evaluation:
  ``eval/reward/<name>``, or ``eval/<set>/reward/<name>``).
* ``log_extra(column, values)``: one value per completion of the call, a column of the
  completions file (``completions/step_<N>.jsonl``, ``completions/eval_<N>.jsonl``: the
  ``metrics.MetricWriter``), written for the steps in which a function logged one.

``RewardLog`` collects what the functions log; ``call_all`` calls them and awaits the
coroutines among their results, concurrently, in one event loop per batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import math
import numbers
from typing import Any, Callable, Sequence


@dataclasses.dataclass
class TrainerState:
  """The training progress a reward function sees as ``trainer_state`` (TRL's fields).

  Attributes:
    global_step: train steps completed (each of this codebase's train steps, its epochs x
      minibatches of updates included, counts one, as ``max_steps`` does): 0 while the first
      batch is generated. In an evaluation: the steps of the parameters evaluated.
    max_steps: ``config.total_steps``. Under a rollout or token budget the run may end sooner;
      ``rollouts`` / ``max_rollouts`` and ``completion_tokens`` / ``max_tokens`` say how far.
    epoch: passes over the training set so far (data positions read, length-skipped prompts
      included, over its size; fractional, as TRL's); None for an unbounded generator (the
      generated Countdown task), which has no epochs.
    rollouts, completion_tokens: generated so far (the run's counters).
    max_rollouts, max_tokens: the budgets (``config.total_rollouts`` / ``total_tokens``; 0 =
      none).
    is_world_process_zero, is_local_process_zero: whether this process writes the run's
      outputs (TRL's flags for logging from one process).
  """

  global_step: int = 0
  max_steps: int = 0
  epoch: float | None = None
  rollouts: int = 0
  completion_tokens: int = 0
  max_rollouts: int = 0
  max_tokens: int = 0
  is_world_process_zero: bool = True
  is_local_process_zero: bool = True


class RewardLog:
  """What reward functions logged through ``log_metric`` and ``log_extra``.

  ``start_batch(n)`` opens a batch of n completions; ``log_extra`` fills its columns, which
  ``end_batch`` checks (n values each: other lengths are left out and named in the returned
  notes). ``log_metric`` values are averaged per name over everything logged before ``take``.
  """

  def __init__(self):
    self._metrics: dict[str, list[float]] = {}
    self._columns: dict[str, list] = {}
    self._n = 0
    self._notes: list[str] = []

  def log_metric(self, name: str, value: float) -> None:
    """TRL's ``log_metric``: one scalar under ``name`` (a finite real, else noted and left
    out)."""
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
      self._notes.append(f"log_metric({name!r}, {value!r}) is not a finite number: left out")
      return
    self._metrics.setdefault(str(name), []).append(float(value))

  def log_extra(self, column: str, values: Sequence) -> None:
    """TRL's ``log_extra``: a column of the current batch, one value per completion."""
    self._columns.setdefault(str(column), []).extend(list(values))

  def start_batch(self, n: int) -> None:
    self._n, self._columns = n, {}

  def end_batch(self) -> tuple[dict[str, list], list[str]]:
    """(the batch's columns of n values each, notes on what was left out)."""
    columns, notes = {}, self._notes
    for name, values in self._columns.items():
      if len(values) == self._n:
        columns[name] = values
      else:
        notes.append(f"log_extra({name!r}, ...) gave {len(values)} values for {self._n} "
                     "completions: the column is left out")
    self._columns, self._notes = {}, []
    return columns, notes

  def take_metrics(self) -> dict[str, float]:
    """Each logged metric's mean since the last call."""
    out = {name: sum(v) / len(v) for name, v in self._metrics.items() if v}
    self._metrics = {}
    return out


def _in_fresh_loop(awaitable):
  """Runs a coroutine to completion in a new event loop: in this thread, or in a helper thread
  when this one already runs a loop (a notebook's), where ``asyncio.run`` may not be called."""
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(awaitable)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, awaitable).result()


def call_all(functions: Sequence[Callable], kwargs: dict[str, Any]) -> list[tuple[Any, Any]]:
  """Calls each function with ``kwargs``; awaits the coroutines among the results together.

  Returns:
    one (output, None) or (None, the Exception it raised) per function, in order.

  Raises:
    BaseException that is not an Exception (KeyboardInterrupt, SystemExit): never swallowed.
  """
  results: list[tuple[Any, Any]] = [(None, None)] * len(functions)
  pending = {}
  for i, fn in enumerate(functions):
    try:
      out = fn(**kwargs)
    except Exception as e:  # pylint: disable=broad-except  (the user's code)
      results[i] = (None, e)
      continue
    if inspect.isawaitable(out):
      pending[i] = out
    else:
      results[i] = (out, None)
  if pending:

    async def gather():
      return await asyncio.gather(*pending.values(), return_exceptions=True)

    for i, out in zip(pending, _in_fresh_loop(gather())):
      if isinstance(out, BaseException) and not isinstance(out, Exception):
        raise out  # interrupted: not a reward function's failure
      results[i] = (None, out) if isinstance(out, Exception) else (out, None)
  return results
