"""Rows of local data files: JSON, JSONL and Parquet, read the same way for every task.

A row is whatever one record of the file holds (usually a dict). A line of a JSONL file that is
not JSON stays in place as an ``Unreadable`` row, so that a task reports it like any other
malformed row (by its number) and skips it: one bad record must not cost a training run. What
makes a whole file unusable (missing, empty, an unknown extension, a JSON document that is
neither rows nor columns) raises ValueError / FileNotFoundError with one line naming the file.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Sequence

EXTENSIONS = (".json", ".jsonl", ".parquet")


class Unreadable:
  """A record that could not be parsed, with the reason (kept in the row's place)."""

  def __init__(self, reason: str):
    self.reason = reason


def _json_rows(path: pathlib.Path, columns: Sequence[str] | None) -> tuple[list[Any], int]:
  """A .json file: a list of rows, or a dict of equal-length columns (rows that only some
  columns reach are counted as skipped)."""
  text = path.read_text(encoding="utf-8")
  if not text.strip():
    raise ValueError(f"{path} is empty")
  try:
    data = json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{path} is not valid JSON ({e})") from None
  if isinstance(data, list):
    return data, 0
  names = list(columns) if columns else list(data) if isinstance(data, dict) else []
  if isinstance(data, dict) and names and all(k in data for k in names):
    if not all(isinstance(data[k], list) for k in names):
      raise ValueError(f"{path}: columns {' and '.join(map(repr, names))} must be lists")
    lengths = [len(data[k]) for k in names]
    rows = [dict(zip(names, values)) for values in zip(*(data[k] for k in names))]
    return rows, max(lengths) - min(lengths)
  wanted = ("a dict with " + " and ".join(map(repr, columns)) + " columns") if columns else (
      "a dict of columns")
  raise ValueError(f"{path}: expected a list of rows or {wanted}")


def _jsonl_rows(path: pathlib.Path, columns: Sequence[str] | None) -> tuple[list[Any], int]:
  """A .jsonl file: one record per line; blank lines ignored."""
  del columns
  rows = []
  with path.open("r", encoding="utf-8") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError as e:
        rows.append(Unreadable(f"not valid JSON ({e})"))
  return rows, 0


def _parquet_rows(path: pathlib.Path, columns: Sequence[str] | None) -> tuple[list[Any], int]:
  """A .parquet file, read with pyarrow (nested columns become dicts and lists)."""
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("Reading .parquet files needs pyarrow: pip install pyarrow") from e
  try:
    table = pq.read_table(path, columns=list(columns) if columns else None)
  except Exception as e:  # pylint: disable=broad-except  (pyarrow raises several kinds)
    raise ValueError(f"{path} is not a readable Parquet file ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''})") from None
  return table.to_pylist(), 0


def read_rows(path: str | os.PathLike[str],
              columns: Sequence[str] | None = None) -> tuple[list[Any], int]:
  """The records of a local data file, in file order.

  Args:
    path: a ``.json`` (a list of rows, or a dict of columns), ``.jsonl`` (one record per line)
      or ``.parquet`` file.
    columns: the columns a task reads: Parquet reads only these, a JSON dict of columns must
      hold them (None: every column).

  Returns:
    (rows, skipped): rows are dicts or other JSON values or ``Unreadable`` markers; skipped
    counts the records lost before that (columns of a JSON dict of unequal lengths).

  Raises:
    FileNotFoundError: no such file.
    ValueError: an unsupported extension, an empty or unparsable file, a JSON document that
      is neither rows nor columns, an unreadable Parquet file.
    ImportError: a .parquet file without pyarrow installed.
  """
  path = pathlib.Path(path)
  if path.is_dir():
    raise ValueError(f"{path} is a folder, not a data file; a Hugging Face datasets folder "
                     "(save_to_disk) converts in one line: datasets.load_from_disk(folder)"
                     ".to_parquet('train.parquet')")
  if not path.is_file():
    raise FileNotFoundError(f"no such data file: {path}")
  readers = {".json": _json_rows, ".jsonl": _jsonl_rows, ".parquet": _parquet_rows}
  suffix = path.suffix.lower()
  if suffix not in readers:
    raise ValueError(f"unsupported data file extension {suffix!r} for {path}; "
                     f"supported: {', '.join(EXTENSIONS)}")
  return readers[suffix](path, columns)


def read_jsonl(path: str | os.PathLike[str]) -> list[Any]:
  """The records of a JSONL file whatever its extension (``Unreadable`` for lines that are not
  JSON)."""
  return _jsonl_rows(pathlib.Path(path), None)[0]


def short(value: Any, width: int = 60) -> str:
  """``repr(value)`` cut to ``width`` characters, for one-line messages about a row."""
  text = repr(value)
  return text if len(text) <= width else text[:width - 3] + "..."
