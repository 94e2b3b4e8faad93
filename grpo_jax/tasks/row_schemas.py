"""The row schemas of the datasets people train on, read into one ``Example`` record.

Three schemas, detected per file from its first readable row (``detect``) or named:

* ``verl``: verl's RL parquet rows (its GSM8K / MATH preprocessing, DAPO-Math-17k):
  ``prompt`` (a list of ``{role, content}`` messages), ``reward_model: {style, ground_truth}``,
  ``data_source`` (verl's key for choosing a reward), ``extra_info`` and any other column.
* ``trl``: TRL's prompt-only datasets: ``prompt`` as a string (standard) or a list of messages
  (conversational); every other column goes to reward functions by name, the reference answer
  usually among them (``answer``, ``solution``, ``ground_truth``).
* ``qa``: plain ``question`` / ``answer`` rows (GSM8K's own files, this project's JSONL task).

``prompt_field`` / ``answer_field`` rename the two fields any schema reads. A row that does not
fit is skipped with a reason (``to_example`` returns it), so a loader can count the skipped rows
and name the first; nothing here runs or evaluates any field's content.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from grpo_jax.tasks import data_files

SCHEMAS = ("verl", "trl", "qa")
# Where TRL-style rows usually keep the reference answer, in order of preference.
TRL_ANSWER_FIELDS = ("answer", "solution", "ground_truth")


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt of a file-backed task, whatever the file's schema.

  Attributes:
    prompt: the prompt text, or a tuple of ``{"role", "content"}`` messages (conversational).
    answer: the reference answer as text; None when the row has none (a reward function may
      still read what it needs from ``columns``).
    data_source: the dataset the row names (verl's ``data_source``), "" when it names none.
    columns: every other field of the row, by name (what TRL passes to reward functions).
  """

  prompt: str | tuple[dict, ...]
  answer: str | None
  data_source: str
  columns: Mapping[str, Any]

  @property
  def conversational(self) -> bool:
    return not isinstance(self.prompt, str)


def detect(row: Any) -> str:
  """The schema of a row: verl (has ``reward_model``), trl (has ``prompt``), qa (has
  ``question``).

  Raises:
    ValueError: a row of none of them (the message lists the row's fields).
  """
  if not isinstance(row, dict):
    raise ValueError(f"a row is not an object: {data_files.short(row)}")
  if isinstance(row.get("reward_model"), dict):
    return "verl"
  if "prompt" in row:
    return "trl"
  if "question" in row:
    return "qa"
  raise ValueError(f"rows of no known schema (fields {sorted(row)}): expected verl's "
                   "'prompt' + 'reward_model', TRL's 'prompt' or 'question' + 'answer'; name "
                   "the fields with task.prompt_field / task.answer_field")


def _prompt(value: Any, field: str) -> tuple[str | tuple[dict, ...] | None, str]:
  """(the prompt: non-empty text or a tuple of ``{role, content}`` messages, "") or (None, why
  the value is neither)."""
  if isinstance(value, str):
    return (value, "") if value.strip() else (None, f"{field!r} is empty")
  if not isinstance(value, (list, tuple)) or not value:
    return None, f"{field!r} is not a string or a non-empty list of messages: " + (
        data_files.short(value))
  messages = []
  for m in value:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)):
      return None, f"{field!r} holds a message without a string role and content: " + (
          data_files.short(m))
    messages.append({"role": m["role"], "content": m["content"]})
  return tuple(messages), ""


def _answer_text(value: Any) -> str | None:
  """A reference answer as text: strings as they are, plain numbers by ``str``; None for
  anything else (lists, dicts, bools are not an answer a verifier can compare)."""
  if isinstance(value, str):
    return value
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  return None


def _answer(row: dict, schema: str, field: str) -> tuple[str, Any, str]:
  """(the answer's field name, its raw value, "") or (name, None, why it is missing)."""
  if field:
    return field, row.get(field), "" if field in row else f"missing field {field!r}"
  if schema == "verl":
    name, model = "reward_model.ground_truth", row.get("reward_model")
    if not isinstance(model, dict) or "ground_truth" not in model:
      return name, None, f"missing field {name!r}"
    return name, model["ground_truth"], ""
  if schema == "qa":
    return "answer", row.get("answer"), "" if "answer" in row else "missing field 'answer'"
  name = next((f for f in TRL_ANSWER_FIELDS if f in row), "")
  return name, row.get(name) if name else None, ""


def to_example(row: Any, schema: str, prompt_field: str = "",
               answer_field: str = "") -> Example | str:
  """The row as an Example, or the reason it does not fit ``schema``.

  Args:
    row: one record of a data file (``data_files.read_rows``).
    schema: one of SCHEMAS.
    prompt_field: the prompt's field ("" = the schema's: ``prompt``, or ``question`` for qa).
    answer_field: the answer's field ("" = the schema's: verl's ``reward_model.ground_truth``,
      TRL's first of TRL_ANSWER_FIELDS present, qa's ``answer``).
  """
  if isinstance(row, data_files.Unreadable):
    return row.reason
  if not isinstance(row, dict):
    return f"not an object: {data_files.short(row)}"
  if schema not in SCHEMAS:
    raise ValueError(f"unknown row schema {schema!r}; known: {', '.join(SCHEMAS)}")
  p_field = prompt_field or ("question" if schema == "qa" else "prompt")
  if p_field not in row:
    return f"missing field {p_field!r}"
  prompt, why = _prompt(row[p_field], p_field)
  if prompt is None:
    return why
  a_field, raw, why = _answer(row, schema, answer_field)
  if why:
    return why
  answer = _answer_text(raw)
  if a_field and raw is not None and answer is None:
    return f"{a_field!r} is not a string or a number: {data_files.short(raw)}"
  source = row.get("data_source", "")
  columns = {k: v for k, v in row.items() if k != p_field}
  return Example(prompt=prompt, answer=answer,
                 data_source=source if isinstance(source, str) else str(source),
                 columns=columns)


def load_examples(path, schema: str = "auto", prompt_field: str = "",
                  answer_field: str = "", with_reason: bool = False) -> tuple:
  """The Examples of a data file, in file order; rows that do not fit are skipped and counted.

  Args:
    path: a .json / .jsonl / .parquet file (``data_files.read_rows``).
    schema: one of SCHEMAS, or "auto": detected from the file's first object row.
    prompt_field, answer_field: see ``to_example``.

    with_reason: also return the first skipped row's number and reason ("" when none).

  Returns:
    (examples, skipped rows, the schema used), and the first skip's reason with_reason.

  Raises:
    FileNotFoundError, ValueError, ImportError: as ``data_files.read_rows``; ValueError also for
      rows of no known schema and for a file without a usable row (naming the first row that
      does not fit, and why).
  """
  rows, skipped = data_files.read_rows(path)
  if schema == "auto":
    first = next((r for r in rows if isinstance(r, dict)), None)
    if first is None:
      raise ValueError(f"{path}: no usable row (the file has no object rows)")
    try:
      schema = detect(first)
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from None
  examples, reason = [], ""
  for number, row in enumerate(rows, 1):
    example = to_example(row, schema, prompt_field, answer_field)
    if isinstance(example, Example):
      examples.append(example)
    else:
      skipped += 1
      reason = reason or f"row {number}: {example}"
  if not examples:
    raise ValueError(f"{path}: no usable row ({skipped} do not fit the {schema} schema; first: "
                     f"{reason})" if skipped else f"{path}: no usable row (the file has no rows)")
  return (examples, skipped, schema) + ((reason,) if with_reason else ())
