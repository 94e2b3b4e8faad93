"""GSM8K answer extraction and scoring; the TFDS loader under TFDS's own mock-data facility."""

import json

import pytest

from grpo_jax.tasks import gsm8k
from tests import optional


@pytest.mark.parametrize("completion,answer,expected", [
    ("so 3 + 4 = 7\n#### 7", "7", 1.0),
    ("#### 1,000.", "1000", 1.0),            # commas and a trailing period ignored
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("first 5 then 12 apples", "12", 1.0),   # last number when nothing else marks it
    ("#### 6 because 7", "7", 0.0),           # the number right after #### counts
    ("#### $18.50", "18.5", 1.0),
    ("no number here", "3", 0.0),
    ("#### -4", "-4", 1.0),
])
def test_score(completion, answer, expected):
  assert gsm8k.score(completion, answer) == expected


def test_reference_answer():
  assert gsm8k.reference_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
  assert gsm8k.reference_answer("no marker") is None


def test_tfds_loader_with_mock_data():
  tfds = optional.require_or_skip("tensorflow_datasets")
  tf = optional.require_or_skip("tensorflow")
  rows = {
      "train": [("How many legs do 2 cats have?", "2 * 4 = 8\n#### 8"),
                ("What is 10 - 3?", "#### 7"),
                ("Malformed, no marker", "seven")],
      "test": [("What is 6 * 7?", "#### 42")],
  }

  def as_dataset(self, split, **kwargs):
    del self, kwargs
    q, a = zip(*rows[str(split)])
    return tf.data.Dataset.from_tensor_slices({"question": list(q), "answer": list(a)})

  with tfds.testing.mock_data(as_dataset_fn=as_dataset,
                              policy=tfds.testing.MockPolicy.USE_CODE):
    task = gsm8k.GSM8KTask()
  assert len(task.train) == 2  # the malformed row is skipped
  assert task.train_problem(0) == gsm8k.Problem("How many legs do 2 cats have?", "8")
  assert task.train_problem(2) == task.train_problem(0)  # random access wraps
  (problem,) = task.eval_problems(5)
  assert problem.answer == "42"
  assert task.prompt(problem).endswith(gsm8k.INSTRUCTION)
  assert task.is_success(task.score("6 * 7 = 42\n#### 42", problem))


def test_gsm8k_not_prepared_is_one_line(tmp_path):
  """Nothing downloads at run time: an empty TFDS data_dir names the fix, not a TFDS trace."""
  optional.require_or_skip("tensorflow_datasets")
  from grpo_jax import errors  # pylint: disable=g-import-not-at-top
  with pytest.raises(errors.ConfigError, match=r"config.task.gsm8k: GSM8K is not prepared in "
                     rf"{tmp_path} .*tfds build gsm8k"):
    gsm8k.GSM8KTask(data_dir=str(tmp_path))


def test_jsonl_task(tmp_path):
  path = tmp_path / "qa.jsonl"
  lines = [json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) for i in range(10)]
  lines += ["not json", json.dumps({"prompt": "missing answer"}), ""]
  path.write_text("\n".join(lines))
  task = gsm8k.JsonlTask(str(path))
  assert task.skipped == 2
  # 10 good rows: the last one (10% = 1) is held out.
  assert len(task.train) == 9 and task.eval_problems(5) == [gsm8k.Problem("What is 9 + 1?", "10")]
  with pytest.raises(FileNotFoundError, match="task.data_path"):
    gsm8k.JsonlTask(str(tmp_path / "missing.jsonl"))
