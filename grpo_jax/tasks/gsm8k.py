"""GSM8K (Cobbe et al., arXiv 2110.14168) through tensorflow-datasets, and local JSONL tasks.

A GSM8K reference answer ends with ``#### <number>``. A completion's final answer is, in order
of preference, the number after its last ``####``, inside its last ``\\boxed{...}``, or its last
number; it scores 1.0 when it equals the reference within a relative 1e-6, else 0.0. Commas,
dollar signs and a trailing period are ignored ("1,000" == "1000.").

Model output is untrusted text: it is only searched with linear-time regular expressions and
read with ``float``, never evaluated. Only ASCII digits are numbers (the references are ASCII;
``float`` alone would also read Arabic-Indic or fullwidth digits, and mixed-script strings
such as "7\u0662" as 72), and a completion longer than MAX_COMPLETION_CHARS scores 0.0 without
being searched, which bounds the work per completion.

``JsonlTask`` serves the same verifier over a local JSONL file of {"prompt" | "question",
"answer"} rows; malformed rows are skipped and counted.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re

from grpo_jax import errors, registry
from grpo_jax import tasks as tasks_lib
from grpo_jax.tasks import data_files

_LOG = logging.getLogger(__name__)

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+", re.ASCII)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
SUCCESS_THRESHOLD = 1.0
# Far above any completion a model writes within its token budget (1M characters is ~250k
# tokens); the verifier's work is linear in the length up to this cap.
MAX_COMPLETION_CHARS = 1_000_000


@dataclasses.dataclass(frozen=True)
class Problem:
  """A question and its numeric reference answer (as text)."""

  question: str
  answer: str


def parse_number(text: str) -> float | None:
  """The number in ``text`` ("$1,234.50." -> 1234.5), or None."""
  if text is None:
    return None
  cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
  if not cleaned.isascii():  # float() would read other scripts' digits too
    return None
  try:
    value = float(cleaned)
  except ValueError:
    return None
  return value if math.isfinite(value) else None


def reference_answer(solution: str) -> str | None:
  """The text after the last ``####`` of a GSM8K solution."""
  if "####" not in solution:
    return None
  return solution.rsplit("####", 1)[1].strip()


def extract_final_answer(completion: str) -> str | None:
  """The model's final answer: after the last ####, else last \\boxed{}, else last number."""
  if "####" in completion:
    found = _NUMBER.search(completion.rsplit("####", 1)[1])
    return found.group(0) if found else None
  boxed = _BOXED.findall(completion)
  if boxed:
    return boxed[-1]
  found = _NUMBER.findall(completion)
  return found[-1] if found else None


def score(completion: str, answer: str) -> float:
  """1.0 when the completion's final answer equals the reference number, else 0.0.

  Never raises and never evaluates the completion; non-text and completions longer than
  MAX_COMPLETION_CHARS score 0.0.
  """
  if not isinstance(completion, str) or len(completion) > MAX_COMPLETION_CHARS:
    return 0.0
  try:
    got = parse_number(extract_final_answer(completion) or "")
    want = parse_number(answer)
  except Exception:  # pylint: disable=broad-except
    return 0.0
  if got is None or want is None:
    return 0.0
  return 1.0 if abs(got - want) <= 1e-6 * max(1.0, abs(want)) else 0.0


class _QATask:
  """Shared prompt / score / data access of question-answer tasks."""

  success_threshold = SUCCESS_THRESHOLD

  def __init__(self, train: list[Problem], test: list[Problem]):
    if not train:
      raise ValueError(f"{self.name}: no usable training problems")
    self.train, self.test = train, test or train

  def train_problem(self, index: int) -> Problem:
    return self.train[index % len(self.train)]

  def num_train_problems(self) -> int:
    return len(self.train)

  def eval_problems(self, n: int) -> list[Problem]:
    return self.test[:n]

  def prompt(self, problem: Problem) -> str:
    return f"{problem.question}\n{INSTRUCTION}"

  def score(self, completion: str, problem: Problem) -> float:
    return score(completion, problem.answer)

  def is_success(self, score_value: float) -> bool:
    return score_value >= SUCCESS_THRESHOLD - 1e-9

  def reward_inputs(self, problems) -> tuple[list[str], dict[str, list]]:
    """Reward functions get each problem's prompt, ``question`` and ``answer`` (the number)."""
    return ([self.prompt(p) for p in problems],
            {"question": [p.question for p in problems], "answer": [p.answer for p in problems]})


def _rows_to_problems(rows, source: str) -> list[Problem]:
  problems, skipped = [], 0
  for row in rows:
    question, solution = row.get("question"), row.get("answer")
    answer = reference_answer(solution) if isinstance(solution, str) else None
    if not isinstance(question, str) or not question.strip() or parse_number(answer or "") is None:
      skipped += 1
      continue
    problems.append(Problem(question=question.strip(), answer=answer))
  if skipped:
    _LOG.warning("%s: skipped %d malformed row(s)", source, skipped)
  return problems


class GSM8KTask(_QATask):
  """GSM8K train / test splits loaded with ``tfds.load('gsm8k')`` (no download if prepared)."""

  name = "gsm8k"

  def __init__(self, data_dir: str | None = None):
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

    splits = {}
    for split in ("train", "test"):
      try:
        ds = tfds.load("gsm8k", split=split, data_dir=data_dir, download=False)
      except Exception as e:  # pylint: disable=broad-except  (TFDS raises several kinds)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise errors.ConfigError(
            f"config.task.gsm8k: GSM8K is not prepared in {data_dir or 'TFDS default data_dir'} "
            f"({first[:160]}); prepare it where there is network (tfds build gsm8k) and pass "
            "--config.task.gsm8k.data_dir=DIR, or use your own rows: "
            "--config.task.data_path=gsm8k.parquet --config.task.rewards=gsm8k") from None
      rows = [{k: v.decode("utf-8") for k, v in ex.items()} for ex in tfds.as_numpy(ds)]
      splits[split] = _rows_to_problems(rows, f"gsm8k/{split}")
    super().__init__(splits["train"], splits["test"])


class JsonlTask(_QATask):
  """Prompt / answer rows from a local JSONL file; the answer may be a bare number or a
  GSM8K-style solution ending in ``#### <number>``. The last 10% of rows (at least one) are
  held out for evaluation."""

  name = "jsonl"

  def __init__(self, path: str):
    if not path or not os.path.exists(path):
      raise FileNotFoundError(f"task.data_path: JSONL file not found: {path!r}")
    rows, bad = [], 0
    for row in data_files.read_jsonl(path):
      if not isinstance(row, dict):  # not JSON, or not an object
        bad += 1
        continue
      question = row.get("question", row.get("prompt"))
      answer = row.get("answer")
      if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
      if isinstance(answer, str) and "####" not in answer:
        answer = f"#### {answer}"
      rows.append({"question": question, "answer": answer})
    if bad:
      _LOG.warning("%s: skipped %d unparsable line(s)", path, bad)
    problems = _rows_to_problems(rows, path)
    self.skipped = bad + len(rows) - len(problems)
    if not problems:
      raise ValueError(f"{path}: no usable row ({len(rows) + bad} rows: {bad} not a JSON object, "
                       f"{len(rows) - len(problems)} without a question and a numeric answer)")
    held = max(1, len(problems) // 10) if len(problems) > 1 else 0
    super().__init__(problems[:len(problems) - held], problems[len(problems) - held:])


@tasks_lib.TASKS.register("gsm8k")
@dataclasses.dataclass(frozen=True)
class GSM8KSpec(registry.Configurable):
  """``config.task.gsm8k``: GSM8K through TFDS (prepared beforehand; nothing downloads).

  Attributes:
    data_dir: TFDS data_dir ("" = TFDS's default).
  """

  data_dir: str = ""
  reads_data_path = False  # the TFDS loader ignores config.task.data_path

  def build(self, task_config) -> GSM8KTask:
    del task_config
    return GSM8KTask(data_dir=self.data_dir or None)


@tasks_lib.TASKS.register("jsonl")
@dataclasses.dataclass(frozen=True)
class JsonlSpec(registry.Configurable):
  """``task.name=jsonl``: {"prompt" | "question", "answer"} rows from ``config.task.data_path``
  (no group of its own)."""

  def build(self, task_config) -> JsonlTask:
    return JsonlTask(task_config.data_path)
