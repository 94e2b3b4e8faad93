"""Exact expression building and a brute-force solver for Countdown.

``combine`` / ``leaf`` build expressions with exact ``Fraction`` values and render them with
minimal parentheses (shared by the generator in countdown.py and the solver here); ``solve``
searches every pairing and operator, and ``reaches`` checks a text the way ``score`` does.
"""

from __future__ import annotations

import fractions
from collections.abc import Sequence

from grpo_jax.tasks import arithmetic

# Absolute tolerance on an answer's value, as in countdown.score.
VALUE_TOLERANCE = 1e-5


# An expression under construction: exact value, text, precedence of its top
# operator (1 for + -, 2 for * /, 3 for a bare number).
Expr = tuple[fractions.Fraction, str, int]
_PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}


def combine(left: Expr, op: str, right: Expr) -> Expr | None:
  """Applies `op` exactly and renders with minimal parentheses.

  Returns None on division by zero.
  """
  left_value, left_text, left_prec = left
  right_value, right_text, right_prec = right
  prec = _PRECEDENCE[op]
  if op == "+":
    value = left_value + right_value
  elif op == "-":
    value = left_value - right_value
  elif op == "*":
    value = left_value * right_value
  else:
    if right_value == 0:
      return None
    value = left_value / right_value
  # The left operand needs parentheses only if it binds looser than `op`.
  # The right one also when it binds equally and `op` is not associative
  # with it: a-(b+c), a/(b*c). For + and * the regrouping a+(b-c) -> a+b-c
  # and a*(b/c) -> a*b/c keeps the exact value.
  if left_prec < prec:
    left_text = f"({left_text})"
  if right_prec < prec or (right_prec == prec and op in "-/"):
    right_text = f"({right_text})"
  return value, f"{left_text}{op}{right_text}", prec


def leaf(number: int) -> Expr:
  return fractions.Fraction(number), str(number), 3



def reaches(text: str, target: int) -> bool:
  """Whether `text` evaluates (in float, as scored) to `target`."""
  value = arithmetic.evaluate_arithmetic(arithmetic.parse_arithmetic(text))
  return value is not None and abs(value - target) <= VALUE_TOLERANCE





def solve(nums: Sequence[int], target: int) -> str | None:
  """Finds an expression using every number once that equals `target`.

  Exhaustive search over pairs and operators with exact Fraction arithmetic
  (fractional intermediates allowed, so it is complete for the rules that
  `score` applies), memoising multisets of values already known to fail.
  Fast for up to 4 numbers; 5-6 can take seconds.

  Args:
      nums: Non-negative integers.
      target: The value to reach.

  Returns:
      An expression in the same compact style as generated solutions, or
      None if the target is unreachable.
  """
  goal = fractions.Fraction(target)
  failed: set[tuple[fractions.Fraction, ...]] = set()

  def search(items: list[Expr]) -> str | None:
    if len(items) == 1:
      return items[0][1] if items[0][0] == goal else None
    key = tuple(sorted(item[0] for item in items))
    if key in failed:
      return None
    for i in range(len(items)):
      for j in range(len(items)):
        # Commutative ops need only one order of each pair.
        if i == j:
          continue
        rest = [items[k] for k in range(len(items)) if k not in (i, j)]
        ops = "+-*/" if i < j else "-/"
        for op in ops:
          merged = combine(items[i], op, items[j])
          if merged is None:
            continue
          found = search(rest + [merged])
          if found is not None:
            return found
    failed.add(key)
    return None

  if not nums:
    return None
  found = search([leaf(int(n)) for n in nums])
  # Fractional intermediates can in principle drift in float evaluation;
  # only return answers that `score` accepts.
  if found is not None and not reaches(found, target):
    return None
  return found


