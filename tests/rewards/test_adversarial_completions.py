"""Hostile completions against the Countdown and GSM8K verifiers: every one is scored (never an
exception), with bounded work, and none is ever run as code.

Problems: Countdown nums (3, 5, 7), target 56; GSM8K reference answer 72. Each payload is scored
as ``<answer>payload</answer>`` by Countdown and as ``#### payload`` by GSM8K (the number right
after the last ``####`` is the answer), through ``task.score`` as the rollout loop calls it, and
through the parsing functions the verifiers use.

Payloads that would leave a trace if executed: files created in the working directory (the
test's empty tmp_path) and an attribute set on ``builtins``; ``eval`` / ``exec`` / ``compile``
(other than parse-only ``ast.parse``) are replaced by functions that record any call.
"""

import ast
import builtins
import os
import time

import pytest

from grpo_jax.tasks import arithmetic, countdown, gsm8k

COUNTDOWN = countdown.Problem(nums=(3, 5, 7), target=56)
GSM8K = gsm8k.Problem(question="?", answer="72")
BIG = 3_000_000  # characters: three times the verifiers' MAX_COMPLETION_CHARS

# (name, payload, Countdown score of <answer>payload</answer>, GSM8K score of "#### payload").
# Countdown: 1.0 correct, 0.1 well-formed arithmetic over the wrong numbers or with no value,
# 0.0 no well-formed answer (characters outside 0-9 . + - * / ( ) and space, a node outside
# the grammar, over 512 characters / 128 nodes / depth 64, or a completion over 1M characters).
# GSM8K: 1.0 when the first ASCII number after "####" equals 72, else 0.0.
CORPUS = [
    ("control_countdown", "(3+5)*7", 1.0, 0.0),  # (3 + 5) * 7 = 56; GSM8K reads 3
    ("control_gsm8k", "72", 0.1, 1.0),  # Countdown: uses 72, not 3, 5, 7
    ("power_tower", "9**9**9**9", 0.0, 0.0),  # ** is outside the grammar; GSM8K reads 9
    ("big_power", "2**10000000", 0.0, 0.0),  # GSM8K reads 2
    ("paren_nesting_100k", "(" * 100_000 + "3+5*7" + ")" * 100_000, 0.0, 0.0),  # 200,005 chars
    ("paren_nesting_250", "(" * 250 + "7" + ")" * 250, 0.0, 0.0),  # 501 chars, parser limit 200
    ("unary_minus_300", "-" * 300 + "56", 0.0, 0.0),  # depth 301 > 64; GSM8K reads -56
    ("sum_chain_250", "+".join(["1"] * 250), 0.0, 0.0),  # 499 chars, left-deep depth 250 > 64
    ("three_million_sevens", "7" * BIG, 0.0, 0.0),  # over MAX_COMPLETION_CHARS: not read
    # 999,981 characters: just under the cap, so both verifiers scan it all. Countdown: an answer
    # over 512 characters; GSM8K reads 1.
    ("just_under_the_cap", "1+" * 499_990 + "1", 0.0, 0.0),
    # GSM8K: one 499,001-digit number (commas dropped): float() gives inf, not a number.
    ("comma_number", "1," * 499_000 + "1", 0.0, 0.0),
    ("long_exact_72", "72." + "0" * 500_000, 0.0, 1.0),  # GSM8K: 72.000... == 72
    ("digits_5000", "9" * 5000, 0.0, 0.0),  # Countdown: over 512; GSM8K: 10^5000 -> inf
    ("digits_400", "9" * 400, 0.1, 0.0),  # Countdown: one literal, not (3, 5, 7)
    ("fullwidth_digits", "(３+５)*７", 0.0, 0.0),  # no ASCII digit for GSM8K
    ("fullwidth_72", "７２", 0.0, 0.0),  # float() alone would read 72
    ("arabic_indic_72", "٧٢", 0.0, 0.0),
    ("mixed_script_72", "7٢", 0.0, 0.0),  # GSM8K reads 7, not 72
    ("devanagari", "(३+५)*७", 0.0, 0.0),
    ("nul_inside", "(3+5)\x00*7", 0.0, 0.0),  # GSM8K reads 3
    ("nul_after", "72\x00", 0.0, 1.0),  # Countdown: NUL is not allowed; GSM8K reads 72
    ("nul_flood", "\x00" * 100_000, 0.0, 0.0),
    ("import_system", "__import__('os').system('touch pwned_system')", 0.0, 0.0),
    ("exec_call", "exec(\"open('pwned_exec', 'w').close()\")", 0.0, 0.0),
    ("eval_call", "eval('(3+5)*7')", 0.0, 0.0),  # GSM8K reads 3
    ("lambda", "(lambda: __import__('os').mkdir('pwned_lambda'))()", 0.0, 0.0),
    ("attribute_walk", "(56).__class__.__mro__[-1].__subclasses__()", 0.0, 0.0),  # GSM8K: 56
    ("f_string", "f\"{__import__('os').mkdir('pwned_fstring')}\"", 0.0, 0.0),
    ("names", "nums[0]*target", 0.0, 0.0),  # GSM8K reads 0
    ("comprehension", "[__import__('os').mkdir('pwned_comp') for _ in 'a']", 0.0, 0.0),
    ("walrus", "(x := 56)", 0.0, 0.0),  # GSM8K reads 56
    ("builtins_write",
     "__import__('builtins').setattr(__import__('builtins'), 'PWNED_BY_MODEL', 1)", 0.0, 0.0),
    ("open_write", "open('pwned_open', 'w').write('x')", 0.0, 0.0),
    ("division_by_zero", "1/0", 0.1, 0.0),  # well-formed, literals 1, 0; GSM8K reads 1
    ("float_exponent", "1e308*10", 0.0, 0.0),  # 'e' is not allowed; GSM8K reads 1
    ("float_literal_overflow", "9" * 300 + ".0*" + "9" * 200, 0.1, 0.0),  # 504 chars
    ("hex_56", "0x38", 0.0, 0.0),  # GSM8K reads 0
    ("underscore_56", "5_6", 0.0, 0.0),  # GSM8K reads 5
    ("complex_56", "56j", 0.0, 0.0),  # GSM8K reads 56
    ("bool", "True", 0.0, 0.0),
    ("string_concat", "'5'+'6'", 0.0, 0.0),  # GSM8K reads 5
    ("newline_then_code", "(3+5)*7\nimport os", 0.0, 0.0),  # GSM8K reads 3
    ("rtl_override", "\u202e(3+5)*7", 0.0, 0.0),
    ("lone_surrogate", "\ud800", 0.0, 0.0),
    ("answer_tag_flood", "<answer>" * 100_000, 0.0, 0.0),  # an 800,000-character answer
    ("hash_flood", "####" * 200_000, 0.0, 0.0),  # nothing after the last ####
    ("boxed_flood", "\\boxed{" * 100_000, 0.0, 0.0),
]

# CPU seconds one completion may take through every function below. A safety bound, not a
# benchmark: the worst payload here takes ~0.2 s on a loaded 2-core machine (linear scans of
# at most 1M characters; parsing capped at 512 characters), while evaluating 2**10000000 or
# 9**9**9**9, or a parser that backtracked, would take seconds to forever. CPU time of this
# thread (every function below runs in it), so neither other processes sharing the machine nor
# this process's other threads (an earlier test's checkpoint writer) count.
CPU_SECONDS = 2.0


@pytest.fixture
def guarded(tmp_path, monkeypatch):
  """Runs the test in an empty folder with eval / exec / compile-to-code recording any call;
  afterwards checks that nothing was created, set or called."""
  calls = []
  real_compile = builtins.compile

  def forbidden(*args, **kwargs):
    calls.append(args)
    raise AssertionError("model output reached eval / exec")

  def parse_only_compile(source, filename, mode, flags=0, *args, **kwargs):
    # ast.parse is compile(..., flags=PyCF_ONLY_AST), which runs nothing.
    if not flags & ast.PyCF_ONLY_AST:
      calls.append(source)
      raise AssertionError("model output compiled to code")
    return real_compile(source, filename, mode, flags, *args, **kwargs)

  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(builtins, "eval", forbidden)
  monkeypatch.setattr(builtins, "exec", forbidden)
  monkeypatch.setattr(builtins, "compile", parse_only_compile)
  yield
  monkeypatch.undo()  # before asserting, so pytest can report
  assert not calls
  assert os.listdir(tmp_path) == []  # no pwned_* file or folder
  assert not hasattr(builtins, "PWNED_BY_MODEL")


@pytest.mark.parametrize("name,payload,countdown_score,gsm8k_score", CORPUS,
                         ids=[c[0] for c in CORPUS])
def test_hostile_completion_is_scored_bounded_and_never_run(guarded, name, payload,
                                                            countdown_score, gsm8k_score):
  del name
  countdown_task = countdown.CountdownTask()
  gsm8k_task = gsm8k._QATask([GSM8K], [])  # pylint: disable=protected-access
  as_answer, after_hashes = f"<answer>{payload}</answer>", f"#### {payload}"
  t0 = time.thread_time()
  got_countdown = countdown_task.score(as_answer, COUNTDOWN)
  got_gsm8k = gsm8k_task.score(after_hashes, GSM8K)
  # The verifiers' parts, on the raw payload and its wrappings: none raises.
  countdown.extract_answer(as_answer)
  node = arithmetic.parse_arithmetic(payload)
  arithmetic.evaluate_arithmetic(node)
  arithmetic.literal_numbers(node)
  gsm8k.extract_final_answer(after_hashes)
  gsm8k.parse_number(payload)
  bare = (countdown_task.score(payload, COUNTDOWN), gsm8k_task.score(payload, GSM8K))
  spent = time.thread_time() - t0
  assert (got_countdown, got_gsm8k) == (countdown_score, gsm8k_score)
  # Well-formed arithmetic is exactly what Countdown does not score 0.0.
  assert (node is None) == (countdown_score == 0.0)
  assert bare[0] == 0.0 and bare[1] in (0.0, 1.0)  # no tags: Countdown finds no answer
  assert spent < CPU_SECONDS, f"{spent:.2f} CPU s"


def test_completions_over_the_cap_are_not_read(guarded):
  """A correct answer padded past MAX_COMPLETION_CHARS scores 0.0: the verifiers stop before
  reading it, which is what bounds their work; one character less and it is read."""
  for module, answer in ((countdown, "<answer>(3+5)*7</answer>"), (gsm8k, "#### 72")):
    cap = module.MAX_COMPLETION_CHARS
    assert cap == 1_000_000
    padding = " " * (cap - len(answer))
    fits, over = padding + answer, padding + " " + answer  # cap and cap + 1 characters
    score = ((lambda t: module.score(t, COUNTDOWN.nums, COUNTDOWN.target))
             if module is countdown else (lambda t: module.score(t, GSM8K.answer)))
    assert (score(fits), score(over)) == (1.0, 0.0)


def test_float_overflow_with_the_right_numbers_is_format_only(guarded):
  """The literals match the problem's numbers, so the product is evaluated: 10^200 * 10^200 =
  10^400 overflows a double (max ~1.8e308) to inf, which is no value: 0.1, not an error."""
  big = "9" * 200
  problem = countdown.Problem(nums=(int(big), int(big)), target=1)
  assert countdown.CountdownTask().score(f"<answer>{big}*{big}</answer>", problem) == 0.1
  assert arithmetic.evaluate_arithmetic(arithmetic.parse_arithmetic(f"{big}*{big}")) is None


def test_non_text_completions_score_zero(guarded):
  for value in (None, b"<answer>(3+5)*7</answer>", 56, ["#### 72"]):
    assert countdown.score(value, COUNTDOWN.nums, COUNTDOWN.target) == 0.0
    assert gsm8k.score(value, GSM8K.answer) == 0.0
