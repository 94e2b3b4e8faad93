"""Tests for grpo_jax.tasks.arithmetic."""

import ast
import builtins

import hypothesis
from hypothesis import strategies as st
import pytest

from grpo_jax.tasks import arithmetic


def _value(text):
  return arithmetic.evaluate_arithmetic(arithmetic.parse_arithmetic(text))


@pytest.mark.parametrize(
  "text, expected",
  [
    ("(3+5)*7", 56.0),  # 8 * 7 = 56
    ("3+5*7", 38.0),  # 3 + 35 = 38 (precedence)
    ("  44 - 19 + 35 ", 60.0),  # 25 + 35 = 60; outer whitespace ignored
    ("(1 + 2) / 3", 1.0),  # 3 / 3 = 1
    ("7/2", 3.5),  # true division, not floor
    ("-3+10", 7.0),  # -3 + 10 = 7
    ("-(2-5)", 3.0),  # -(-3) = 3
    ("2.5*4", 10.0),  # float literals parse: 2.5 * 4 = 10
    ("((((6))))", 6.0),  # redundant parentheses are fine
    ("(1\n+ 2)", 3.0),  # newline inside parentheses: 1 + 2 = 3
  ],
)
def test_evaluates_allowed_expressions(text, expected):
  assert _value(text) == pytest.approx(expected)


@pytest.mark.parametrize(
  "text",
  [
    "",
    "   ",
    "2**3",  # Pow
    "7//2",  # FloorDiv
    "7%2",  # Mod
    "x+1",  # name
    "abs(-1)",  # call
    "__import__('os').system('x')",  # call + attribute + string
    "(1).real",  # attribute
    "'12'",  # string
    "[1, 2][0]",  # subscript
    "1 < 2",  # comparison
    "lambda: 1",  # lambda
    "True+1",  # bool constant
    "1j",  # complex literal
    "0x10",  # hex literal (odd characters)
    "1e3",  # exponent literal (odd characters)
    "1_000",  # underscore literal
    "+3",  # unary plus is not part of the grammar
    "1 2",  # syntax error
    "1\n+2",  # newline outside parentheses ends the expression
    "3 = 3",
    "١+٢",  # non-ASCII digits
    "(",
  ],
)
def test_rejects_disallowed_syntax(text):
  assert arithmetic.parse_arithmetic(text) is None


def test_rejects_text_over_length_limit():
  # 1+1+...: 257 ones and 256 pluses = 513 characters > 512.
  text = "+".join(["1"] * 257)
  assert len(text) == 513
  assert arithmetic.parse_arithmetic(text) is None


def test_huge_literal_does_not_raise():
  # 5000 digits: over the length limit (and Python's 4300-digit int limit).
  assert arithmetic.parse_arithmetic("9" * 5000) is None
  # 400 digits fits the text limit but ~1e400 overflows a float: the tree
  # is valid, its value is not.
  node = arithmetic.parse_arithmetic("9" * 400)
  assert node is not None
  assert arithmetic.evaluate_arithmetic(node) is None
  assert arithmetic.literal_numbers(node) == [int("9" * 400)]


def test_deep_nesting_does_not_raise():
  # 10000 levels: rejected by the length limit before parsing.
  assert arithmetic.parse_arithmetic("(" * 10000 + "1" + ")" * 10000) is None
  # 250 levels fit in 512 characters but exceed the parser's nesting limit.
  assert arithmetic.parse_arithmetic("(" * 250 + "1" + ")" * 250) is None
  # 500 unary minuses: a chain 501 nodes deep, over MAX_DEPTH.
  assert arithmetic.parse_arithmetic("-" * 500 + "1") is None
  # 10 unary minuses (even count) is fine: value +1.
  assert _value("-" * 10 + "1") == 1.0


def test_node_limit():
  # 1+1+...+1 with 65 ones: 65 constants + 64 BinOps = 129 nodes > 128, and
  # the left-leaning chain is 65 deep > 64.
  assert arithmetic.parse_arithmetic("+".join(["1"] * 65)) is None
  # Balanced tree of 64 ones: 127 nodes, depth 7 -> accepted, value 64.
  text = "1"
  for _ in range(6):
    text = f"({text})+({text})"
  assert _value(text) == 64.0


@pytest.mark.parametrize("text", ["1/0", "5/(3-3)", "1/(0.0)", "2/(1-1)*3"])
def test_division_by_zero_is_none(text):
  assert arithmetic.parse_arithmetic(text) is not None
  assert _value(text) is None


def test_overflow_is_none():
  # 10**200 written out (201 chars) squared is 1e400, which overflows a
  # float to inf; the text (403 chars) is within the length limit.
  big = "1" + "0" * 200
  assert arithmetic.parse_arithmetic(f"{big}*{big}") is not None
  assert _value(f"{big}*{big}") is None
  # 400-digit literal in a sum: the literal itself does not fit a float.
  assert _value("9" * 400 + "-1") is None


def test_float_semantics():
  # 1/49 rounds down, so (1/49)*49 is 0.9999999999999999 in IEEE doubles.
  assert _value("1/49*49") == pytest.approx(1.0, abs=1e-12)
  assert _value("1/49*49") != 1.0


def test_literal_numbers_order_and_unary_minus():
  node = arithmetic.parse_arithmetic("-3 + (5 * -(7)) / 2.5")
  # Source order; the minus signs are operations, so 3 and 7 stay positive.
  assert arithmetic.literal_numbers(node) == [3, 5, 7, 2.5]
  # int literals stay ints, float literals floats.
  assert [type(v) for v in arithmetic.literal_numbers(node)] == [
    int,
    int,
    int,
    float,
  ]


def test_accepts_expression_wrapper_and_none():
  tree = ast.parse("2*3", mode="eval")
  assert arithmetic.evaluate_arithmetic(tree) == 6.0
  assert arithmetic.literal_numbers(tree) == [2, 3]
  assert arithmetic.evaluate_arithmetic(None) is None
  assert arithmetic.literal_numbers(None) == []


def test_unvalidated_tree_is_not_executed():
  # A hand-built tree with a Call node is refused, not run.
  tree = ast.parse("__import__('os').getcwd()", mode="eval")
  assert arithmetic.evaluate_arithmetic(tree) is None


def test_never_uses_eval_exec_compile(monkeypatch):
  calls = []

  def forbidden(*args, **kwargs):
    calls.append(args)
    raise AssertionError("model output reached eval/exec")

  real_compile = builtins.compile

  def parse_only_compile(source, filename, mode, flags=0, *args, **kwargs):
    # ast.parse is compile(..., flags=PyCF_ONLY_AST): it builds a tree and
    # runs nothing. Any compile to a code object is refused.
    if not flags & ast.PyCF_ONLY_AST:
      calls.append(source)
      raise AssertionError("model output compiled to code")
    return real_compile(source, filename, mode, flags, *args, **kwargs)

  monkeypatch.setattr(builtins, "eval", forbidden)
  monkeypatch.setattr(builtins, "exec", forbidden)
  monkeypatch.setattr(builtins, "compile", parse_only_compile)
  value = _value("(3+5)*7")  # 8 * 7 = 56
  rejected = arithmetic.parse_arithmetic("__import__('os')")
  monkeypatch.undo()  # Restore before asserting so pytest can report.
  assert value == 56.0
  assert rejected is None
  assert not calls


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.text(max_size=600))
def test_fuzz_arbitrary_text_never_raises(text):
  node = arithmetic.parse_arithmetic(text)
  value = arithmetic.evaluate_arithmetic(node)
  assert value is None or isinstance(value, float)
  arithmetic.literal_numbers(node)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.text(alphabet="0123456789.+-*/() ", max_size=80))
def test_fuzz_arithmetic_alphabet_never_raises(text):
  node = arithmetic.parse_arithmetic(text)
  value = arithmetic.evaluate_arithmetic(node)
  assert value is None or isinstance(value, float)
  for literal in arithmetic.literal_numbers(node):
    assert type(literal) in (int, float)
