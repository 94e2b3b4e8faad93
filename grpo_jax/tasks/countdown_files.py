"""Loading Countdown problems from local files in the public "Countdown-Tasks-3to4" format.

Rows carry ``target`` (int) and ``nums`` (list of ints). Files may be JSON (a list of rows or a
dict of columns), JSONL (one row per line) or Parquet (needs pyarrow). Malformed rows are
skipped and counted, never raised: one bad row must not cost a training run. A file without a
single usable row is an error that names the first malformed row and why.
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Any

from grpo_jax.tasks import data_files
from grpo_jax.tasks.countdown_problem import Problem, is_plain_int

_LOG = logging.getLogger(__name__)


def _row_to_problem(row: Any) -> Problem | str:
  """Converts one row dict to a Problem, or says why it is malformed."""
  if not isinstance(row, dict):
    return f"not an object: {data_files.short(row)}"
  target, nums = row.get("target"), row.get("nums")
  if "target" not in row or "nums" not in row:
    return f"missing field {'target' if 'target' not in row else 'nums'!r}"
  if not is_plain_int(target):
    return f"'target' is not an integer: {data_files.short(target)}"
  if not isinstance(nums, (list, tuple)) or not nums:
    return f"'nums' is not a non-empty list: {data_files.short(nums)}"
  if not all(is_plain_int(n) for n in nums):
    return f"'nums' holds a non-integer: {data_files.short(nums)}"
  return Problem(nums=tuple(int(n) for n in nums), target=int(target))


def load_problems(path: str | os.PathLike[str]) -> tuple[list[Problem], int]:
  """Loads problems in the "Countdown-Tasks-3to4" row format.

  Each row has ``target`` (int) and ``nums`` (non-empty list of ints).
  Malformed rows (missing fields, non-integer or bool values, empty or
  non-list nums, invalid JSON lines) are skipped and counted, with a single
  warning, rather than aborting a long run over a few bad records.

  Args:
      path: A ``.json`` (list of row objects, or an object of columns
          ``{"target": [...], "nums": [...]}``), ``.jsonl`` (one object per
          line) or ``.parquet`` file.

  Returns:
      The problems in file order (without solutions) and the number of
      skipped rows. The warning names the first skipped row and why.

  Raises:
      FileNotFoundError: If `path` does not exist.
      ValueError: On an unsupported extension, an empty file, a .json file
          whose top level is neither rows nor columns (or is not valid
          JSON), or a file without a single usable row (the message names
          the first malformed row and why).
      ImportError: For .parquet when pyarrow is not installed.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no such problem file: {path}")
  rows, skipped = data_files.read_rows(path, columns=("target", "nums"))
  problems, first = [], None
  for number, row in enumerate(rows, 1):
    problem = row.reason if isinstance(row, data_files.Unreadable) else _row_to_problem(row)
    if isinstance(problem, Problem):
      problems.append(problem)
      continue
    skipped += 1
    first = first or f"row {number}: {problem}"
  if skipped and first is None:  # only the columns' lengths differ
    first = "the 'target' and 'nums' columns have different lengths"
  if not problems:
    raise ValueError(f"{path}: no usable row (" + (
        f"{skipped} malformed; first: {first})" if skipped else "the file has no rows)"))
  if skipped:
    _LOG.warning("Skipped %d malformed row(s) in %s (first: %s)", skipped, path, first)
  return problems, skipped


