"""Data files in the schemas people have: verl's parquet, TRL's prompt datasets, question /
answer rows; read into one Example record, bad rows skipped, counted and the first named."""

import pathlib

import pytest

from grpo_jax.tasks import data_files, row_schemas
from tests import optional

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def _verl_parquet(path):
  """Rows shaped as verl's GSM8K / MATH preprocessing writes them (examples/data_preprocess)."""
  pa = optional.require_or_skip("pyarrow")
  pq = optional.require_or_skip("pyarrow.parquet")
  rows = [
      {"data_source": "lighteval/MATH", "ability": "math",
       "prompt": [{"role": "user", "content": "Compute 1/2 + 1/3."}],
       "reward_model": {"style": "rule", "ground_truth": "\\frac{5}{6}"},
       "extra_info": {"split": "train", "index": 0}},
      {"data_source": "openai/gsm8k", "ability": "math",
       "prompt": [{"role": "user", "content": "Tom has 3 apples and buys 4. How many?"}],
       "reward_model": {"style": "rule", "ground_truth": "7"},
       "extra_info": {"split": "train", "index": 1}},
  ]
  pq.write_table(pa.Table.from_pylist(rows), path)
  return rows


def test_a_verl_parquet_is_detected_and_read_as_it_is(tmp_path):
  rows = _verl_parquet(tmp_path / "train.parquet")
  examples, skipped, schema = row_schemas.load_examples(tmp_path / "train.parquet")
  assert (schema, skipped, len(examples)) == ("verl", 0, 2)
  first = examples[0]
  assert first.prompt == ({"role": "user", "content": "Compute 1/2 + 1/3."},)
  assert first.conversational and first.answer == "\\frac{5}{6}"
  assert first.data_source == "lighteval/MATH"
  # Every field but the prompt reaches reward functions by name, nested ones as dicts.
  assert first.columns["extra_info"] == rows[0]["extra_info"]
  assert first.columns["ability"] == "math" and "prompt" not in first.columns
  assert examples[1].answer == "7"


def test_trl_rows_standard_and_conversational_with_their_columns():
  """tests/data/trl_prompts.jsonl: 5 lines; line 3 has an empty prompt and line 4 is not
  JSON, so 3 examples and 2 skipped rows, the first named by its row number."""
  examples, skipped, schema = row_schemas.load_examples(DATA / "trl_prompts.jsonl")
  assert (schema, skipped, len(examples)) == ("trl", 2, 3)
  standard, chat, number = examples
  assert standard.prompt.startswith("What is 1/2 + 1/4?") and not standard.conversational
  assert standard.answer == "\\frac{3}{4}"  # TRL keeps it in "solution"
  assert standard.columns == {"solution": "\\frac{3}{4}", "level": 1}
  assert [m["role"] for m in chat.prompt] == ["system", "user"] and chat.answer == "x = 5"
  assert number.answer == "4"  # a JSON number as text


def test_question_answer_rows_and_field_overrides(tmp_path):
  path = tmp_path / "qa.json"
  path.write_text('[{"question": "2 + 2?", "answer": "#### 4"}, '
                  '{"question": "3 + 3?", "answer": "#### 6"}]')
  examples, _, schema = row_schemas.load_examples(path)
  assert schema == "qa" and [e.answer for e in examples] == ["#### 4", "#### 6"]
  # A dict of columns, with its own field names mapped.
  path = tmp_path / "columns.json"
  path.write_text('{"query": ["a?", "b?"], "target": ["1", "2"]}')
  examples, _, _ = row_schemas.load_examples(path, schema="trl", prompt_field="query",
                                             answer_field="target")
  assert [(e.prompt, e.answer) for e in examples] == [("a?", "1"), ("b?", "2")]


def test_verl_rows_are_verl_even_though_they_have_a_prompt():
  """Detection order: a verl row has 'prompt' too; read as TRL its answer would be lost."""
  row = {"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "1"}}
  assert row_schemas.detect(row) == "verl"
  assert row_schemas.detect({"prompt": "x", "answer": "1"}) == "trl"
  assert row_schemas.detect({"question": "x", "answer": "1"}) == "qa"
  with pytest.raises(ValueError, match=r"no known schema \(fields \['input', 'output'\]\)"):
    row_schemas.detect({"input": "x", "output": "y"})


@pytest.mark.parametrize("row,schema,reason", [
    ({"reward_model": {"ground_truth": "1"}}, "verl", "missing field 'prompt'"),
    ({"prompt": "x", "reward_model": {"style": "rule"}}, "verl",
     "missing field 'reward_model.ground_truth'"),
    ({"prompt": "   "}, "trl", "'prompt' is empty"),
    ({"prompt": [{"role": "user"}]}, "trl",
     "'prompt' holds a message without a string role and content: {'role': 'user'}"),
    ({"prompt": 7}, "trl", "'prompt' is not a string or a non-empty list of messages: 7"),
    ({"prompt": "x", "answer": [1, 2]}, "trl", "'answer' is not a string or a number: [1, 2]"),
    ({"question": "x"}, "qa", "missing field 'answer'"),
    ({"question": "x", "answer": True}, "qa", "'answer' is not a string or a number: True"),
    ([1, 2], "trl", "not an object: [1, 2]"),
])
def test_a_row_that_does_not_fit_says_why(row, schema, reason):
  assert row_schemas.to_example(row, schema) == reason


def test_a_file_without_a_usable_row_names_the_first_and_why(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"prompt": ""}\n{"prompt": "ok", "answer": {"a": 1}}\n')
  with pytest.raises(ValueError) as e:
    row_schemas.load_examples(path)
  assert str(e.value) == (f"{path}: no usable row (2 do not fit the trl schema; first: row 1: "
                          "'prompt' is empty)")
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(ValueError, match="no usable row"):
    row_schemas.load_examples(tmp_path / "empty.jsonl")
  with pytest.raises(ValueError, match="unknown row schema 'alpaca'"):
    row_schemas.load_examples(DATA / "trl_prompts.jsonl", schema="alpaca")


def test_unreadable_files_are_one_line(tmp_path):
  with pytest.raises(FileNotFoundError, match="no such data file"):
    data_files.read_rows(tmp_path / "missing.parquet")
  (tmp_path / "rows.csv").write_text("a,b\n")
  with pytest.raises(ValueError, match=r"unsupported data file extension '\.csv'.*\.parquet"):
    data_files.read_rows(tmp_path / "rows.csv")
  (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
  optional.require_or_skip("pyarrow")
  with pytest.raises(ValueError, match="is not a readable Parquet file"):
    data_files.read_rows(tmp_path / "broken.parquet")
