"""Safe parsing and evaluation of arithmetic expressions written by a model.

Model output is untrusted, so it is never handed to ``eval``, ``exec`` or a
compiled code object. Instead the text is parsed into a Python AST (parsing
does not run anything), checked against a tiny whitelist grammar, and then
evaluated by an explicit recursive walker over that whitelist:

        expr := number | "-" expr | expr op expr | "(" expr ")"
    op   := "+" | "-" | "*" | "/"

Numbers are plain decimal integer or float literals. Everything else (names,
calls, attribute access, ``**``, ``//``, ``%``, strings, comparisons, ...) is
rejected. Size guards bound the work done on adversarial input: the text length,
the number of nodes and the nesting depth are all capped, so both the parser
and our own recursive walkers stay far from Python's recursion limit.
"""

from __future__ import annotations

import ast
import math
import re

# Countdown answers are a handful of numbers; these caps are orders of
# magnitude above anything legitimate yet keep worst-case work tiny.
MAX_TEXT_LENGTH = 512
MAX_NODES = 128
MAX_DEPTH = 64

# Characters a well-formed answer may contain. Checking this before parsing
# keeps names, strings, hex/complex/underscore/exponent literals and odd
# Unicode away from the parser entirely (defence in depth: the AST whitelist
# below would reject most of them anyway).
_ALLOWED_TEXT = re.compile(r"[0-9.+\-*/() \t\r\n]*")

_BINARY_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)


def _is_number_literal(node: ast.AST) -> bool:
  """Whether `node` is an int or float constant (bool excluded on purpose)."""
  # `type(...) in` rather than isinstance: True/False are ints in Python.
  return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _count_valid(node: ast.AST, depth: int) -> int | None:
  """Counts the nodes of a whitelisted expression tree.

  Args:
      node: The expression node to check.
      depth: Nesting depth of `node` (the root has depth 1).

  Returns:
      The number of expression nodes, or None if the tree uses anything
      outside the whitelist or is deeper than MAX_DEPTH.
  """
  # Bail out before recursing further so recursion depth stays <= MAX_DEPTH.
  if depth > MAX_DEPTH:
    return None
  if _is_number_literal(node):
    return 1
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    inner = _count_valid(node.operand, depth + 1)
    return None if inner is None else inner + 1
  if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY_OPS):
    left = _count_valid(node.left, depth + 1)
    if left is None or left > MAX_NODES:
      return None
    right = _count_valid(node.right, depth + 1)
    return None if right is None else left + right + 1
  return None


def parse_arithmetic(text: str) -> ast.expr | None:
  """Parses `text` as a whitelisted arithmetic expression.

  Args:
      text: Candidate expression, e.g. ``"(3 + 5) * 7"``. Surrounding
          whitespace is ignored.

  Returns:
      The root expression node (the body of the parsed ``ast.Expression``), or
      None if the text is not a valid expression under the grammar in the
      module docstring, is longer than MAX_TEXT_LENGTH characters, has more
      than MAX_NODES nodes or is nested deeper than MAX_DEPTH. Never raises.
  """
  if not isinstance(text, str) or len(text) > MAX_TEXT_LENGTH:
    return None
  text = text.strip()
  if not text or _ALLOWED_TEXT.fullmatch(text) is None:
    return None
  try:
    tree = ast.parse(text, mode="eval")
  # SyntaxError (incl. "too many nested parentheses"), ValueError (int literal
  # over the digit limit), RecursionError/MemoryError from the parser itself.
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return None
  count = _count_valid(tree.body, depth=1)
  if count is None or count > MAX_NODES:
    return None
  return tree.body


def _evaluate(node: ast.AST, depth: int) -> float | None:
  """Recursive float evaluator of whitelisted nodes (evaluate_arithmetic)."""
  if depth > MAX_DEPTH:
    return None
  if _is_number_literal(node):
    try:
      value = float(node.value)
    except OverflowError:  # An int literal too large for a float.
      return None
  elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    operand = _evaluate(node.operand, depth + 1)
    if operand is None:
      return None
    value = -operand
  elif isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY_OPS):
    left = _evaluate(node.left, depth + 1)
    if left is None:
      return None
    right = _evaluate(node.right, depth + 1)
    if right is None:
      return None
    if isinstance(node.op, ast.Add):
      value = left + right
    elif isinstance(node.op, ast.Sub):
      value = left - right
    elif isinstance(node.op, ast.Mult):
      value = left * right
    else:
      if right == 0.0:
        return None
      value = left / right
  else:
    return None
  # Float ops overflow to inf silently; treat any non-finite value as failure
  # so callers never have to reason about inf/nan.
  return value if math.isfinite(value) else None


def evaluate_arithmetic(node: ast.AST | None) -> float | None:
  """Evaluates a tree returned by parse_arithmetic in float arithmetic.

  Args:
      node: An expression node from parse_arithmetic (an ``ast.Expression``
          wrapper is also accepted). Nodes outside the whitelist are not
          executed; they make the result None.

  Returns:
      The value as a float, or None on division by zero, a non-finite
      intermediate or final value (overflow, inf, nan), an unsupported node
      or a tree deeper than MAX_DEPTH. Never raises.
  """
  if isinstance(node, ast.Expression):
    node = node.body
  if node is None:
    return None
  try:
    return _evaluate(node, depth=1)
  # Only reachable for hand-built trees; parsed ones are depth-checked.
  except (RecursionError, MemoryError):
    return None


def literal_numbers(node: ast.AST | None) -> list[int | float]:
  """Returns the numeric literals of an expression, left to right.

  A unary minus is an operation, not part of the literal: ``-3`` uses the
  number 3. Values keep their literal type (``3`` -> int 3, ``3.0`` -> float
  3.0) so callers can tell an integer literal from a float one, and huge int
  literals are returned exactly instead of overflowing a float.

  Args:
      node: An expression node from parse_arithmetic (an ``ast.Expression``
          wrapper is also accepted).

  Returns:
      The literal values; nodes outside the whitelist contribute nothing.
  """
  if isinstance(node, ast.Expression):
    node = node.body
  found: list[int | float] = []
  # Explicit stack instead of recursion; children are pushed right-first so
  # they are popped (and recorded) left-to-right.
  stack = [node] if node is not None else []
  while stack:
    current = stack.pop()
    if _is_number_literal(current):
      found.append(current.value)
    elif isinstance(current, ast.UnaryOp):
      stack.append(current.operand)
    elif isinstance(current, ast.BinOp):
      stack.append(current.right)
      stack.append(current.left)
  return found
