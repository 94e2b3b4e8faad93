"""math-verify in bounded worker processes: equivalences worked out by hand, answers that are
wrong, missing or hostile, a reference that does not parse, and the bound on a whole batch."""

import time

import pytest

from grpo_jax import math_answers

pytest.importorskip("math_verify")

# (reference, completion, verdict); every pair checked by hand.
CASES = [
    ("\\frac{1}{2}", "so the answer is \\boxed{0.5}", "correct"),  # fraction = decimal
    ("\\frac{1}{2}", "\\boxed{\\dfrac{2}{4}}", "correct"),  # \dfrac, unreduced
    ("\\frac{1}{2}", "\\boxed{0.6}", "wrong"),
    ("\\frac{1}{2}", "\\boxed{0.25}", "wrong"),  # a decimal: 0.25 != 0.5
    ("2\\sqrt{2}", "\\boxed{\\sqrt{8}}", "correct"),  # sqrt(8) = 2 sqrt(2)
    ("2\\sqrt{2}", "\\boxed{2\\sqrt{3}}", "wrong"),
    ("5", "x + 2 = 7, so \\boxed{x = 5}", "correct"),  # an equation's right side
    ("5", "so \\boxed{x = 6}", "wrong"),  # the right side is 6, not 5
    ("(1, 2]", "\\boxed{(1,2]}", "correct"),  # intervals, open / closed ends
    ("(1, 2]", "\\boxed{[1,2]}", "wrong"),
    ("\\{1, 2\\}", "\\boxed{\\{2, 1\\}}", "correct"),  # sets: order does not matter
    ("\\{1, 2\\}", "\\boxed{\\{1, 3\\}}", "wrong"),  # 3 is not in {1, 2}, 2 is missing
    ("10", "\\boxed{10\\text{ cm}}", "correct"),  # a unit in \text{}
    ("10", "\\boxed{12\\text{ cm}}", "wrong"),  # the unit dropped, 12 != 10
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
    # The replacement started without blocking the batch; the next batch is served by it.
    assert v.verify(["7"], ["\\boxed{7}"]) == ["correct"]


HOSTILE = "\\boxed{9^{9^{9^9}}}"


def test_a_batch_is_bounded_as_a_whole():
  """One worker, 1 s an answer, 1.5 s a batch, 4 hostile answers: the first is killed at 1 s and
  its replacement started; at 1.5 s the other 3 (not begun, or one begun by the replacement) are
  timeouts too. Without the batch bound: 4 x (1 s + a worker's start), over 4 s."""
  with math_answers.MathVerifier(workers=1, timeout_s=1.0, batch_timeout_s=1.5) as v:
    v.verify(["1"], ["1"])  # the pool's first start, which the batch bound does not cover
    began = time.monotonic()
    got = v.verify(["7"] * 4, [HOSTILE] * 4)
    took = time.monotonic() - began
    assert got == ["timeout"] * 4
    assert took < 4.0, took
    v.batch_timeout_s = None  # so that the next batch may wait for the replacement to start
    assert v.verify(["7", "2"], ["\\boxed{7}", "\\boxed{3}"]) == ["correct", "wrong"]


def test_a_worker_that_does_not_start_is_an_error_not_a_hang(monkeypatch):
  """With the start limit at 0 s, the replacement of the killed worker is past it as soon as the
  batch needs it for the second answer: RuntimeError, and the pool is stopped."""
  with math_answers.MathVerifier(workers=1, timeout_s=1.0) as v:
    v.verify(["1"], ["1"])  # started under the normal limit
    monkeypatch.setattr(math_answers, "_START_S", 0.0)
    with pytest.raises(RuntimeError, match="a math-verify worker did not start"):
      v.verify(["7", "7"], [HOSTILE, "\\boxed{7}"])
    monkeypatch.undo()
    assert v.verify(["7"], ["\\boxed{7}"]) == ["correct"]  # started afresh


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="workers >= 1 and timeout_s > 0"):
    math_answers.MathVerifier(workers=0)
  for bound in (0, -1.0):
    with pytest.raises(ValueError, match="need batch_timeout_s > 0 or None"):
      math_answers.MathVerifier(batch_timeout_s=bound)
