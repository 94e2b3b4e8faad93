"""math-verify in bounded worker processes: equivalences worked out by hand, answers that are
wrong, missing or hostile, and a reference that does not parse."""

import pytest

from grpo_jax import math_answers

pytest.importorskip("math_verify")

# (reference, completion, verdict); every pair checked by hand.
CASES = [
    ("\\frac{1}{2}", "so the answer is \\boxed{0.5}", "correct"),  # fraction = decimal
    ("\\frac{1}{2}", "\\boxed{\\dfrac{2}{4}}", "correct"),  # \dfrac, unreduced
    ("\\frac{1}{2}", "\\boxed{0.6}", "wrong"),
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", "correct"),  # sqrt(8) = 2 sqrt(2)
    ("2\\sqrt{2}", "\\boxed{2\\sqrt{3}}", "wrong"),
    ("5", "x + 2 = 7, so \\boxed{x = 5}", "correct"),  # an equation's right side
    ("(1, 2]", "\\boxed{(1,2]}", "correct"),  # intervals, open / closed ends
    ("(1, 2]", "\\boxed{[1,2]}", "wrong"),
    ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}", "correct"),  # sets: order does not matter
    ("10", "\\boxed{10\\text{ cm}}", "correct"),  # a unit in \text{}
    ("7", "The answer is 7.", "correct"),  # no box: the final expression
    ("3", "I do not know.", "unparseable"),
]


@pytest.fixture(scope="module")
def verifier():
  with math_answers.MathVerifier(workers=2, timeout_s=10.0) as v:
    yield v


def test_hand_worked_equivalences(verifier):
  golds, completions, expected = zip(*CASES)
  assert verifier.verify(list(golds), list(completions)) == list(expected)


def test_a_reference_that_does_not_parse_is_named_apart(verifier):
  """An empty ground truth (a broken row) parses to nothing: not "wrong", so the caller can keep
  the row out of "success" and count it."""
  assert verifier.verify(["", " "], ["\\boxed{1}", "1"]) == ["bad_gold", "bad_gold"]
  with pytest.raises(ValueError, match="2 references for 1 completions"):
    verifier.verify(["1", "2"], ["1"])


def test_a_hostile_answer_times_out_and_the_batch_goes_on():
  """9^(9^(9^9)) keeps sympy inside one big-integer power that no signal interrupts: its
  worker is killed after the bound, replaced, and the answers after it are still checked."""
  with math_answers.MathVerifier(workers=1, timeout_s=2.0) as v:
    got = v.verify(["7", "\\frac{1}{2}", "3"],
                   ["\\boxed{9^{9^{9^9}}}", "\\boxed{0.5}", "\\boxed{4}"])
  assert got == ["timeout", "correct", "wrong"]


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="workers >= 1 and timeout_s > 0"):
    math_answers.MathVerifier(workers=0)
