"""Tests for grpo_jax.tasks.countdown."""

import ast
import builtins
import fractions
import json
import logging
import re

import hypothesis
from hypothesis import strategies as st
import pytest

from grpo_jax.tasks import arithmetic
from grpo_jax.tasks import countdown, countdown_files, countdown_solver
from tests import optional

NUMS = (3, 5, 7)
TARGET = 56  # (3 + 5) * 7 = 8 * 7 = 56


def _answer(expression):
  return f"<think>let me try</think> <answer>{expression}</answer>"


# ---------------------------------------------------------------------------
# extract_answer


def test_extract_answer_last_pair_wins():
  text = "<answer> 1+2 </answer> blah <answer>\n(3+5)*7\n</answer> tail"
  assert countdown.extract_answer(text) == "(3+5)*7"


def test_extract_answer_missing_or_unclosed():
  assert countdown.extract_answer("(3+5)*7") is None
  assert countdown.extract_answer("<answer>(3+5)*7") is None
  assert countdown.extract_answer("</answer>(3+5)*7<answer>") is None
  assert countdown.extract_answer("<answer></answer>") == ""


def test_extract_answer_non_greedy_semantics():
  # Like re "<answer>(.*?)</answer>": the first opener runs to the first
  # closer, so a nested opener is part of the content.
  text = "<answer>a<answer>b</answer>"
  assert countdown.extract_answer(text) == "a<answer>b"


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
  st.lists(
    st.sampled_from(["<answer>", "</answer>", "1+2", " ", "\n", "x", "<"]),
    max_size=12,
  ).map("".join)
)
def test_extract_answer_matches_regex_reference(text):
  matches = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
  expected = matches[-1].strip() if matches else None
  assert countdown.extract_answer(text) == expected


# ---------------------------------------------------------------------------
# score


def test_score_correct():
  assert countdown.score(_answer("(3+5)*7"), NUMS, TARGET) == 1.0
  # Order of use and spacing do not matter: 7 * (5 + 3) = 56.
  assert countdown.score(_answer(" 7 * (5 + 3) "), NUMS, TARGET) == 1.0
  # nums given as a list work too.
  assert countdown.score(_answer("(3+5)*7"), list(NUMS), TARGET) == 1.0


def test_score_last_answer_wins():
  wrong, right = "<answer>3+5+7</answer>", "<answer>(3+5)*7</answer>"
  # 3 + 5 + 7 = 15 != 56, so order decides.
  assert countdown.score(wrong + right, NUMS, TARGET) == 1.0
  assert countdown.score(right + wrong, NUMS, TARGET) == 0.1


def test_score_wrong_value():
  # (3 + 5) - 7 = 1 != 56.
  assert countdown.score(_answer("(3+5)-7"), NUMS, TARGET) == 0.1


@pytest.mark.parametrize(
  "expression",
  [
    "8*7",  # 8 * 7 = 56 but 3 and 5 are missing and 8 is not given
    "(3+5)*7*1",  # = 56 with an extra 1
    "(3+5)*7+3-3",  # = 56 but 3 is used three times
    "(3+5)*(7+7)/2",  # 8 * 14 / 2 = 56 but 7 twice and an extra 2
    "(3.0+5)*7",  # = 56 but 3.0 is a float literal, not the number 3
  ],
)
def test_score_wrong_multiset(expression):
  assert countdown.score(_answer(expression), NUMS, TARGET) == 0.1


def test_score_unary_minus_keeps_literal():
  # -3 + 5 = 2 uses the numbers 3 and 5.
  assert countdown.score(_answer("-3+5"), (3, 5), 2) == 1.0


@pytest.mark.parametrize(
  "completion",
  [
    "(3+5)*7",  # no tags
    "<answer>(3+5)*7",  # unclosed
    "<answer>   </answer>",  # empty
    _answer("(3+5)*7**1"),  # Pow
    _answer("x"),  # name
    _answer("__import__('os').system('x')"),  # call, attribute, string
    _answer("abs(56)"),  # call
    _answer("(56).real"),  # attribute
    _answer("'56'"),  # string
    _answer("(3+5)*7 = 56"),  # equation rather than expression
    _answer("(3+5)×7"),  # odd character
  ],
)
def test_score_malformed_is_zero(completion):
  assert countdown.score(completion, NUMS, TARGET) == 0.0


def test_score_division_by_zero_is_format_only():
  # (3 + 5) * 7 / (5 - 5): divides by 0, well-formed but no value.
  assert countdown.score(_answer("(3+5)*7/(5-5)"), (3, 5, 5, 7), 56) == 0.1


def test_score_float_tolerance():
  # In doubles 1/49*49 = 0.9999999999999999, within 1e-5 of 1.
  assert countdown.score(_answer("1/49*49"), (1, 49, 49), 1) == 1.0
  # 1/3*3 is 1 with exact arithmetic (rounds to exactly 1.0 in doubles).
  assert countdown.score(_answer("1/3*3"), (1, 3, 3), 1) == 1.0
  # The tolerance is absolute: 1/1000000 = 1e-6 counts as 0 ...
  assert countdown.score(_answer("1/1000000"), (1, 1000000), 0) == 1.0
  # ... but 1/10000 = 1e-4 does not.
  assert countdown.score(_answer("1/10000"), (1, 10000), 0) == 0.1


def test_score_huge_literal_does_not_raise():
  # 5000 digits: over the 512-character limit, so not well-formed.
  assert countdown.score(_answer("9" * 5000), NUMS, TARGET) == 0.0
  # 400 digits: parses (well-formed), but is not in nums and overflows.
  assert countdown.score(_answer("9" * 400), NUMS, TARGET) == 0.1
  # A 400-digit target cannot be compared as a float: a miss, not an error.
  assert countdown.score(_answer("(3+5)*7"), NUMS, 10**400) == 0.1


def test_score_deep_nesting_does_not_raise():
  deep = "(" * 10000 + "1" + ")" * 10000
  assert countdown.score(_answer(deep), (1,), 1) == 0.0
  assert countdown.score(_answer("-" * 500 + "1"), (1,), 1) == 0.0


def test_score_non_string_is_zero():
  assert countdown.score(None, NUMS, TARGET) == 0.0


def test_score_never_evaluates_model_output(monkeypatch):
  calls = []
  real_compile = builtins.compile

  def forbidden(*args, **kwargs):
    calls.append(args)
    raise AssertionError("model output reached eval/exec")

  def parse_only_compile(source, filename, mode, flags=0, *args, **kwargs):
    # ast.parse is compile(..., flags=PyCF_ONLY_AST), which runs nothing.
    if not flags & ast.PyCF_ONLY_AST:
      calls.append(source)
      raise AssertionError("model output compiled to code")
    return real_compile(source, filename, mode, flags, *args, **kwargs)

  monkeypatch.setattr(builtins, "eval", forbidden)
  monkeypatch.setattr(builtins, "exec", forbidden)
  monkeypatch.setattr(builtins, "compile", parse_only_compile)
  scores = [
    countdown.score(_answer("(3+5)*7"), NUMS, TARGET),
    countdown.score(_answer("(3+5)-7"), NUMS, TARGET),
    countdown.score(_answer("__import__('os').system('x')"), NUMS, TARGET),
  ]
  monkeypatch.undo()  # Restore before asserting so pytest can report.
  assert scores == [1.0, 0.1, 0.0]
  assert not calls


def test_is_success():
  assert countdown.SUCCESS_THRESHOLD == 1.0
  assert countdown.is_success(1.0)
  assert countdown.is_success(1.0 - 1e-12)
  assert not countdown.is_success(0.1)
  assert not countdown.is_success(0.0)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.text(max_size=300))
def test_fuzz_score_arbitrary_text(text):
  assert countdown.score(text, NUMS, TARGET) in (0.0, 0.1, 1.0)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(
  st.lists(
    st.sampled_from(
      [
        "<answer>",
        "</answer>",
        "3",
        "5",
        "7",
        "+",
        "-",
        "*",
        "/",
        "(",
        ")",
        " ",
        "**",
        "x",
        "0",
        ".",
        "9" * 30,
      ]
    ),
    max_size=30,
  ).map("".join)
)
def test_fuzz_score_answer_like_text(text):
  assert countdown.score(text, NUMS, TARGET) in (0.0, 0.1, 1.0)


# ---------------------------------------------------------------------------
# Templates and prompts


def test_templates():
  assert countdown.TEMPLATES["short"] == (
    "Using the numbers {nums}, create an equation that equals {target}."
  )
  problem = countdown.Problem(nums=(44, 19, 35), target=98)
  assert countdown.prompt(problem) == (
    "Using the numbers [44, 19, 35], create an equation that equals 98."
  )
  tinyzero = countdown.prompt(problem, "tinyzero")
  assert tinyzero.startswith(countdown.prompt(problem) + " You can use")
  assert tinyzero.endswith("for example <answer> (1 + 2) / 3 </answer>.")
  with pytest.raises(ValueError, match="template"):
    countdown.prompt(problem, "nope")


def test_template_words():
  words = countdown.TEMPLATE_WORDS
  assert words == tuple(sorted(set(words)))
  for word in ("Using", "numbers", "equals", "answer", "think", "You"):
    assert word in words
  # Format field names are not prompt words.
  assert "nums" not in words and "target" not in words
  # Every word of every rendered prompt is covered.
  problem = countdown.Problem(nums=(1, 2), target=3)
  for name in countdown.TEMPLATES:
    for word in re.findall(r"[A-Za-z]+", countdown.prompt(problem, name)):
      assert word in words


def test_reference_completion():
  problem = countdown.Problem(nums=NUMS, target=TARGET, solution="(3+5)*7")
  completion = countdown.reference_completion(problem)
  assert completion == "<answer> (3+5)*7 </answer>"
  # Without a stored solution the solver supplies one.
  unsolved = countdown.Problem(nums=NUMS, target=TARGET)
  completion = countdown.reference_completion(unsolved)
  assert countdown.score(completion, NUMS, TARGET) == 1.0
  # Max over 1, 2, 3 is (1+2)*3 = 9, so 1000 is unreachable.
  with pytest.raises(ValueError, match="no solution"):
    countdown.reference_completion(countdown.Problem(nums=(1, 2, 3), target=1000))


# ---------------------------------------------------------------------------
# Solver


def test_solve():
  found = countdown_solver.solve(NUMS, TARGET)
  assert countdown.score(f"<answer>{found}</answer>", NUMS, TARGET) == 1.0
  # Needs a fractional intermediate: 5 * (5 - 1/5) = 5 * 24/5 = 24.
  found = countdown_solver.solve((1, 5, 5, 5), 24)
  assert found is not None
  assert countdown.score(f"<answer>{found}</answer>", (1, 5, 5, 5), 24) == 1.0
  assert countdown_solver.solve((1, 2, 3), 1000) is None  # max is (1+2)*3 = 9
  assert countdown_solver.solve((4,), 4) == "4"
  assert countdown_solver.solve((), 0) is None


# ---------------------------------------------------------------------------
# Generator


def test_config_validation_names_field():
  cases = [
    ({"num_numbers": 7}, "num_numbers"),
    ({"num_numbers": 1}, "num_numbers"),
    ({"num_numbers": True}, "num_numbers"),
    ({"min_number": 0}, "min_number"),
    ({"min_number": 10, "max_number": 5}, "max_number"),
    ({"max_number": 10**6}, "max_number"),
    ({"min_target": 50, "max_target": 10}, "max_target"),
    ({"max_target": 2.5}, "max_target"),
    ({"seed": -1}, "seed"),
    ({"eval_fraction": 0.0}, "eval_fraction"),
    ({"eval_fraction": 1.0}, "eval_fraction"),
    ({"eval_fraction": "0.1"}, "eval_fraction"),
  ]
  for kwargs, field in cases:
    with pytest.raises(ValueError, match=field):
      countdown.GeneratorConfig(**kwargs)


def test_generator_deterministic():
  config = countdown.GeneratorConfig(seed=3)
  first = [countdown.generate_problem(config, "train", i) for i in range(20)]
  again = [countdown.generate_problem(config, "train", i) for i in range(20)]
  assert first == again
  # Random access: index 17 alone equals index 17 of the batch.
  assert countdown.train_problems(config, 17, 1) == [first[17]]
  held_out = countdown.eval_problems(config, 5)
  assert held_out == countdown.eval_problems(config, 5)


def test_generator_seeds_differ():
  a = countdown.train_problems(countdown.GeneratorConfig(seed=0), 0, 20)
  b = countdown.train_problems(countdown.GeneratorConfig(seed=1), 0, 20)
  assert a != b


def test_generator_ranges_and_solutions():
  config = countdown.GeneratorConfig(min_number=2, max_number=30, min_target=10, max_target=60)
  problems = countdown.train_problems(config, 0, 100)
  problems += countdown.eval_problems(config, 50)
  for p in problems:
    assert len(p.nums) == 3
    assert all(type(n) is int and 2 <= n <= 30 for n in p.nums)
    assert type(p.target) is int and 10 <= p.target <= 60
    completion = countdown.reference_completion(p)
    assert completion == f"<answer> {p.solution} </answer>"
    assert countdown.score(completion, p.nums, p.target) == 1.0


def test_generated_problems_are_solvable():
  config = countdown.GeneratorConfig()
  for p in countdown.train_problems(config, 0, 50):
    assert countdown_solver.solve(p.nums, p.target) is not None, p


def _exact_value(node):
  """Exact value of a parsed solution; asserts every division is exact."""
  if isinstance(node, ast.Constant):
    return fractions.Fraction(node.value)
  if isinstance(node, ast.UnaryOp):
    return -_exact_value(node.operand)
  left, right = _exact_value(node.left), _exact_value(node.right)
  if isinstance(node.op, ast.Div):
    assert right != 0 and (left / right).denominator == 1
    return left / right
  if isinstance(node.op, ast.Mult):
    return left * right
  if isinstance(node.op, ast.Add):
    return left + right
  return left - right


def test_generated_solutions_use_exact_division():
  config = countdown.GeneratorConfig(num_numbers=4)
  divisions = 0
  for p in countdown.train_problems(config, 0, 200):
    assert _exact_value(arithmetic.parse_arithmetic(p.solution)) == p.target
    divisions += p.solution.count("/")
  assert divisions > 0  # The check above was exercised.


def test_train_test_disjoint():
  config = countdown.GeneratorConfig(eval_fraction=0.2)
  train = countdown.train_problems(config, 0, 300)
  test = countdown.eval_problems(config, 200)
  train_keys = {countdown.canonical_key(p.nums, p.target) for p in train}
  test_keys = {countdown.canonical_key(p.nums, p.target) for p in test}
  assert not train_keys & test_keys
  for problems, split in ((train, "train"), (test, "test")):
    for p in problems:
      assert countdown.split_of(p.nums, p.target, 0.2) == split


def test_canonical_key_and_split_are_order_independent():
  assert countdown.canonical_key((44, 5, 7), 56) == "5,7,44|56"
  assert countdown.split_of((44, 5, 7), 56, 0.5) == countdown.split_of((7, 44, 5), 56, 0.5)


def test_four_and_six_numbers():
  config = countdown.GeneratorConfig(num_numbers=4, seed=7)
  problems = countdown.train_problems(config, 0, 10)
  for p in problems:
    assert len(p.nums) == 4
    assert countdown_solver.solve(p.nums, p.target) is not None
  config = countdown.GeneratorConfig(num_numbers=6)
  six = countdown.generate_problem(config, "test", 0)
  assert len(six.nums) == 6
  reference = countdown.reference_completion(six)
  assert countdown.score(reference, six.nums, six.target) == 1.0


def test_generate_problem_errors(monkeypatch):
  config = countdown.GeneratorConfig()
  with pytest.raises(ValueError, match="split"):
    countdown.generate_problem(config, "validation", 0)
  with pytest.raises(ValueError, match="index"):
    countdown.generate_problem(config, "train", -1)
  # Two 1s reach at most 1 + 1 = 2, so a target of 100 is impossible.
  monkeypatch.setattr(countdown, "MAX_ATTEMPTS", 50)
  impossible = countdown.GeneratorConfig(
    num_numbers=2,
    min_number=1,
    max_number=1,
    min_target=100,
    max_target=100,
  )
  with pytest.raises(RuntimeError, match="reachable"):
    countdown.generate_problem(impossible, "train", 0)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
  seed=st.integers(0, 2**32),
  index=st.integers(0, 10**9),
  num_numbers=st.integers(2, 6),
  split=st.sampled_from(["train", "test"]),
)
def test_fuzz_reference_completion_scores_one(seed, index, num_numbers, split):
  config = countdown.GeneratorConfig(num_numbers=num_numbers, seed=seed)
  p = countdown.generate_problem(config, split, index)
  reference = countdown.reference_completion(p)
  assert countdown.score(reference, p.nums, p.target) == 1.0
  assert countdown.split_of(p.nums, p.target, config.eval_fraction) == split


# ---------------------------------------------------------------------------
# Loaders


def test_load_json_rows(tmp_path):
  path = tmp_path / "rows.json"
  path.write_text(
    json.dumps(
      [
        {"target": 98, "nums": [44, 19, 35]},
        {"target": 56, "nums": [3, 5, 7]},
        {"target": 1, "nums": []},  # empty nums
        {"target": True, "nums": [1]},  # bool target
        {"nums": [1, 2]},  # missing target
        "not a row",
      ]
    )
  )
  problems, skipped = countdown_files.load_problems(path)
  assert problems == [
    countdown.Problem(nums=(44, 19, 35), target=98),
    countdown.Problem(nums=(3, 5, 7), target=56),
  ]
  assert skipped == 4


def test_load_json_columns(tmp_path):
  path = tmp_path / "columns.json"
  path.write_text(
    json.dumps(
      {
        "target": [98, 56, 10, 4],
        # [1.5, 2] has a non-integer; the 4th target has no nums.
        "nums": [[44, 19, 35], [3, 5, 7], [1.5, 2]],
      }
    )
  )
  problems, skipped = countdown_files.load_problems(str(path))
  assert [p.target for p in problems] == [98, 56]
  assert skipped == 2


def test_load_json_bad_top_level(tmp_path):
  path = tmp_path / "bad.json"
  path.write_text(json.dumps({"rows": []}))
  with pytest.raises(ValueError, match="target"):
    countdown_files.load_problems(path)


def test_load_jsonl(tmp_path):
  path = tmp_path / "rows.jsonl"
  path.write_text(
    '{"target": 98, "nums": [44, 19, 35]}\n'
    "\n"  # blank: ignored, not counted
    "{not json\n"  # invalid JSON line: skipped
    '{"target": 5, "nums": "12"}\n'  # nums not a list: skipped
    '{"target": 56, "nums": [3, 5, 7]}\n'
  )
  problems, skipped = countdown_files.load_problems(path)
  assert [p.nums for p in problems] == [(44, 19, 35), (3, 5, 7)]
  assert skipped == 2


def test_load_parquet(tmp_path):
  pa = optional.require_or_skip("pyarrow")
  pq = optional.require_or_skip("pyarrow.parquet")
  path = tmp_path / "rows.parquet"
  table = pa.table({"target": [98, 56, 7], "nums": [[44, 19, 35], [3, 5, 7], []]})
  pq.write_table(table, path)
  problems, skipped = countdown_files.load_problems(path)
  assert problems == [
    countdown.Problem(nums=(44, 19, 35), target=98),
    countdown.Problem(nums=(3, 5, 7), target=56),
  ]
  assert skipped == 1  # the empty nums row


def test_load_names_the_first_malformed_row(tmp_path, caplog):
  path = tmp_path / "rows.jsonl"
  path.write_text('{"target": 56, "nums": [3, 5, 7]}\n'
                  '{"target": 5, "nums": ["a", 2]}\n'  # row 2: the first malformed one
                  '{"nums": [1, 2]}\n')
  with caplog.at_level(logging.WARNING):
    problems, skipped = countdown_files.load_problems(path)
  assert [p.target for p in problems] == [56] and skipped == 2
  assert (f"Skipped 2 malformed row(s) in {path} (first: row 2: 'nums' holds a non-integer: "
          "['a', 2])") in caplog.text


@pytest.mark.parametrize("name,content,message", [
    ("empty.jsonl", "\n\n", "no usable row (the file has no rows)"),
    ("empty.json", "", "is empty"),
    ("broken.json", "[{", "is not valid JSON (Expecting property name"),
    ("text.jsonl", "{oops\n" + '{"target": 1.5, "nums": [1]}\n',
     "no usable row (2 malformed; first: row 1: not valid JSON (Expecting property name"),
    ("bool.jsonl", '{"target": true, "nums": [1]}\n',
     "no usable row (1 malformed; first: row 1: 'target' is not an integer: True)"),
    ("nums.json", '[{"target": 3, "nums": "12"}, {"target": 3}]',
     "no usable row (2 malformed; first: row 1: 'nums' is not a non-empty list: '12')"),
])
def test_load_unusable_file_is_an_error_naming_why(tmp_path, name, content, message):
  path = tmp_path / name
  path.write_text(content)
  with pytest.raises(ValueError) as e:
    countdown_files.load_problems(path)
  assert str(e.value).startswith(f"{path}") and message in str(e.value)


def test_load_errors(tmp_path):
  missing = tmp_path / "missing.json"
  with pytest.raises(FileNotFoundError, match="missing.json"):
    countdown_files.load_problems(missing)
  other = tmp_path / "rows.csv"
  other.write_text("target,nums\n")
  with pytest.raises(ValueError, match=r"\.jsonl"):
    countdown_files.load_problems(other)


# ---------------------------------------------------------------------------
# CountdownTask


def test_task_generated():
  config = countdown.GeneratorConfig(seed=5)
  task = countdown.CountdownTask(config, template="tinyzero")
  assert task.name == "countdown"
  assert task.success_threshold == 1.0
  p = task.train_problem(12)
  assert p == countdown.generate_problem(config, "train", 12)
  assert task.eval_problems(3) == countdown.eval_problems(config, 3)
  assert task.prompt(p) == countdown.prompt(p, "tinyzero")
  reference = task.reference_completion(p)
  assert task.score(reference, p) == 1.0
  assert task.is_success(task.score(reference, p))
  assert not task.is_success(task.score("no answer", p))
  with pytest.raises(ValueError, match="template"):
    countdown.CountdownTask(template="missing")


def test_task_from_file(tmp_path):
  rows = [
    {"target": 56, "nums": [3, 5, 7]},
    {"target": 98, "nums": [44, 19, 35]},
  ]
  path = tmp_path / "rows.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in rows))
  config = countdown.GeneratorConfig(eval_fraction=0.01)
  # Only rows outside the held-out split are kept for training.
  kept = [r for r in rows if countdown.split_of(r["nums"], r["target"], 0.01) == "train"]
  assert kept
  task = countdown.CountdownTask.from_file(path, config)
  n = len(kept)
  # Random access wraps modulo the data size.
  assert task.train_problem(0) == task.train_problem(n)
  assert task.train_problem(0).target == kept[0]["target"]
  p = task.train_problem(0)
  assert task.score(task.reference_completion(p), p) == 1.0
