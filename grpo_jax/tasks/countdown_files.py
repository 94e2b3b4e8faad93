"""Loading Countdown problems from local files in the public "Countdown-Tasks-3to4" format.

Rows carry ``target`` (int) and ``nums`` (list of ints). Files may be JSON (a list of rows or a
dict of columns), JSONL (one row per line) or Parquet (needs pyarrow). Malformed rows are
skipped and counted, never raised: one bad row must not cost a training run. A file without a
single usable row is an error that names the first malformed row and why.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from typing import Any

from grpo_jax.tasks.countdown_problem import Problem, is_plain_int

_LOG = logging.getLogger(__name__)


_SUPPORTED_EXTENSIONS = (".json", ".jsonl", ".parquet")


def _row_to_problem(row: Any) -> Problem | str:
  """Converts one row dict to a Problem, or says why it is malformed."""
  if not isinstance(row, dict):
    return f"not an object: {_short(row)}"
  target, nums = row.get("target"), row.get("nums")
  if "target" not in row or "nums" not in row:
    return f"missing field {'target' if 'target' not in row else 'nums'!r}"
  if not is_plain_int(target):
    return f"'target' is not an integer: {_short(target)}"
  if not isinstance(nums, (list, tuple)) or not nums:
    return f"'nums' is not a non-empty list: {_short(nums)}"
  if not all(is_plain_int(n) for n in nums):
    return f"'nums' holds a non-integer: {_short(nums)}"
  return Problem(nums=tuple(int(n) for n in nums), target=int(target))


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


class _Unreadable:
  """A line that is not JSON, kept in place so its reason is reported like a malformed row."""

  def __init__(self, reason: str):
    self.reason = reason


def _read_json_rows(path: pathlib.Path) -> tuple[list[Any], int]:
  """Rows of a .json file (list of rows, or dict of columns)."""
  with path.open("r", encoding="utf-8") as f:
    text = f.read()
  if not text.strip():
    raise ValueError(f"{path} is empty")
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e})") from None
  if isinstance(data, list):
    return data, 0
  if isinstance(data, dict) and "target" in data and "nums" in data:
    targets, nums = data["target"], data["nums"]
    if not isinstance(targets, list) or not isinstance(nums, list):
      raise ValueError(f"{path}: columns 'target' and 'nums' must be lists")
    # Rows present in only one column lack a field: count them as skipped.
    rows = [{"target": t, "nums": n} for t, n in zip(targets, nums)]
    return rows, abs(len(targets) - len(nums))
  raise ValueError(f"{path}: expected a list of rows or a dict with 'target' and 'nums' columns")


def _read_jsonl_rows(path: pathlib.Path) -> tuple[list[Any], int]:
  """Rows of a .jsonl file; blank lines ignored, invalid JSON lines kept as ``_Unreadable``."""
  rows = []
  with path.open("r", encoding="utf-8") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as e:
        rows.append(_Unreadable(f"not valid JSON ({e})"))
  return rows, 0


def _read_parquet_rows(path: pathlib.Path) -> tuple[list[Any], int]:
  """Rows of a .parquet file, read with pyarrow."""
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("Reading .parquet files needs pyarrow: pip install pyarrow") from e
  return pq.read_table(path, columns=["target", "nums"]).to_pylist(), 0


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
  suffix = path.suffix.lower()
  readers = {
    ".json": _read_json_rows,
    ".jsonl": _read_jsonl_rows,
    ".parquet": _read_parquet_rows,
  }
  if suffix not in readers:
    raise ValueError(
      f"unsupported problem file extension {suffix!r} for {path}; "
      f"supported: {', '.join(_SUPPORTED_EXTENSIONS)}"
    )
  rows, skipped = readers[suffix](path)
  problems, first = [], None
  for number, row in enumerate(rows, 1):
    problem = row.reason if isinstance(row, _Unreadable) else _row_to_problem(row)
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


