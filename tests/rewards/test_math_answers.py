"""math-verify in bounded worker processes: equivalences worked out by hand, answers that are
wrong, missing or hostile, a reference that does not parse, the bound on a whole batch, and the
workers' lives: they die with their parent, however it dies, and ignore the signals it owns."""

import json
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from grpo_jax.rewards import math_answers
from tests import optional

optional.require_or_skip("math_verify")

ROOT = pathlib.Path(__file__).parents[2]
HAS_PROC = os.path.isdir("/proc/self/task")  # the process checks read Linux's /proc
needs_proc = pytest.mark.skipif(not HAS_PROC, reason="reads processes from Linux's /proc")

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
    # MATH's currency, percents and thousands separators. "\$" is an escaped dollar, a currency
    # sign, never a math delimiter; "$" alone delimits (or, unpaired, is a currency sign too).
    ("\\$18.90", "\\boxed{\\$18.90}", "correct"),  # the reference's form, boxed
    ("\\$18.90", "\\boxed{18.90}", "correct"),  # the sign left out: 18.90 = 18.90
    ("\\$18.90", "\\boxed{18.9}", "correct"),  # a trailing zero: 18.9 = 18.90
    ("\\$18.90", "The total is \\$18.90.", "correct"),  # unboxed: the final expression, 18.90
    ("\\$18.90", "\\boxed{1890}", "wrong"),  # cents, not dollars: 1890 != 18.90
    ("\\$18.90", "\\boxed{\\$18.00}", "wrong"),  # 18.00 != 18.90
    ("\\$1,\\!000", "\\boxed{1000}", "correct"),  # ",\!" groups thousands: 1,000 = 1000
    ("\\$1,\\!000", "\\boxed{\\$1,000}", "correct"),  # the separator without its \! space
    ("\\$1,\\!000", "\\boxed{100}", "wrong"),  # 100 != 1000
    ("\\$5", "\\boxed{5}", "correct"),
    ("\\$5", "\\boxed{\\$5.00}", "correct"),  # 5.00 = 5
    ("\\$5", "\\boxed{6}", "wrong"),
    ("25\\%", "\\boxed{25\\%}", "correct"),
    ("25\\%", "\\boxed{25}", "correct"),  # "what percent": math-verify takes the number too
    ("25\\%", "\\boxed{0.25}", "correct"),  # 25% = 0.25
    ("25\\%", "\\boxed{2.5}", "wrong"),  # neither 25 nor 0.25
    ("25\\%", "\\boxed{26\\%}", "wrong"),
    ("1,\\!000", "\\boxed{1000}", "correct"),
    ("1,\\!000", "\\boxed{1}", "wrong"),  # a thousand, not the set {1, 0}
    ("10,000", "\\boxed{10000}", "correct"),  # the plain comma groups thousands as well
    ("10,000", "\\boxed{10,000}", "correct"),
    ("10,000", "\\boxed{10}", "wrong"),
    # References already delimited, boxed, or with a plain-text dollar: read as before.
    ("$\\frac12$", "\\boxed{0.5}", "correct"),  # $...$: 1/2 = 0.5
    ("$\\$18.90$", "\\boxed{18.90}", "correct"),  # an escaped dollar inside the delimiters
    ("\\boxed{\\$5}", "\\boxed{5}", "correct"),  # a boxed reference
    ("\\(\\frac{1}{2}\\)", "\\boxed{0.5}", "correct"),  # \( \) delimiters
    ("\\[\\frac{1}{2}\\]", "\\boxed{0.5}", "correct"),  # \[ \] delimiters
    ("$18.90", "\\boxed{18.90}", "correct"),  # an unpaired "$": currency in plain text
    ("$1,000", "\\boxed{1000}", "correct"),
    ("$1,000", "\\boxed{1}", "wrong"),
]


@pytest.fixture(scope="module")
def verifier():
  with math_answers.MathVerifier(workers=2, timeout_s=10.0) as v:
    yield v


def test_hand_worked_equivalences(verifier):
  golds, completions, expected = zip(*CASES)
  got = verifier.verify(list(golds), list(completions))
  mismatches = [f"{g!r} {c!r}: {v}, not {e}" for (g, c, e), v in zip(CASES, got) if v != e]
  assert not mismatches, "\n".join(mismatches)


def test_a_reference_that_does_not_parse_is_named_apart(verifier):
  """An empty ground truth (a broken row) parses to nothing: not "wrong", so the caller can keep
  the row out of "success" and count it."""
  assert verifier.verify(["", " "], ["\\boxed{1}", "1"]) == ["bad_gold", "bad_gold"]
  with pytest.raises(ValueError, match="2 references for 1 completions"):
    verifier.verify(["1", "2"], ["1"])


def test_a_hostile_answer_times_out_and_the_batch_goes_on():
  """9^(9^(9^9)) keeps sympy inside one big-integer power that no signal interrupts: its
  worker is killed after the bound, replaced, and the answers after it are still checked. No
  process of the pool outlives the kill at the bound, nor ``close``."""
  with math_answers.MathVerifier(workers=1, timeout_s=2.0) as v:
    v.verify(["1"], ["1"])
    first = _pool(v)
    got = v.verify(["7", "\\frac{1}{2}", "3"],
                   ["\\boxed{9^{9^{9^9}}}", "\\boxed{0.5}", "\\boxed{4}"])
    assert got == ["timeout", "correct", "wrong"]
    assert _alive(first) == []  # the killed worker, and its watchdog with it
    # The replacement started without blocking the batch; the next batch is served by it.
    assert v.verify(["7"], ["\\boxed{7}"]) == ["correct"]
    second = _pool(v)
  assert _alive(second) == []


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


def test_a_pool_started_from_another_thread_outlives_that_thread():
  """PR_SET_PDEATHSIG fires when the *thread* that started a process exits: a pool first used
  from a thread that then ends (a thread pool's, say) is not tied to it, and goes on serving."""
  with math_answers.MathVerifier(workers=1, timeout_s=10.0) as v:
    got = []
    thread = threading.Thread(target=lambda: got.extend(v.verify(["1"], ["1"])))
    thread.start()
    thread.join()
    assert got == ["correct"]
    time.sleep(0.5)  # a PR_SET_PDEATHSIG tied to that thread would have fired by now
    assert v.verify(["7"], ["\\boxed{7}"]) == ["correct"]


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="workers >= 1 and timeout_s > 0"):
    math_answers.MathVerifier(workers=0)
  for bound in (0, -1.0):
    with pytest.raises(ValueError, match="need batch_timeout_s > 0 or None"):
      math_answers.MathVerifier(batch_timeout_s=bound)


def _stat(pid: int):
  """(state, parent pid, start time) of a process from /proc, None when there is none."""
  try:
    text = pathlib.Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return None
  fields = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
  return fields[0], int(fields[1]), fields[19]


def _descendants(root: int) -> dict[int, str]:
  """Every process below root, pid -> start time (a pid reused later is not the same one)."""
  stats = {int(n): _stat(int(n)) for n in os.listdir("/proc") if n.isdigit()}
  found, todo = {}, [root]
  while todo:
    parent = todo.pop()
    for pid, stat in stats.items():
      if stat and stat[1] == parent and pid not in found:
        found[pid] = stat[2]
        todo.append(pid)
  return found


def _pool(verifier) -> dict[int, str]:
  """The processes of a verifier's pool: each one it started and every one below it."""
  if not HAS_PROC:
    return {}
  pool = {}
  for worker in verifier._procs:  # pylint: disable=protected-access
    pool[worker[0].pid] = _stat(worker[0].pid)[2]
    pool.update(_descendants(worker[0].pid))
  return pool


def _alive(processes: dict[int, str], within_s: float = 5.0) -> list[int]:
  """The processes still running after up to within_s (a zombie, which runs nothing and only
  waits for its parent's wait, counts as gone)."""
  end = time.monotonic() + within_s
  while True:
    alive = [pid for pid, start in processes.items()
             if (stat := _stat(pid)) and stat[0] not in "ZX" and stat[2] == start]
    if not alive or time.monotonic() > end:
      return alive
    time.sleep(0.05)


def _kill(processes: dict[int, str]) -> None:
  """A failed test's leftovers, killed (a hostile answer would otherwise spin forever)."""
  for pid in _alive(processes, within_s=0.0):
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


class _Parent:
  """tests/math_verifier_parent.py in a session of its own (its process group is not this
  one's), its stdout read line by line."""

  def __init__(self, *args: str):
    self.proc = subprocess.Popen([sys.executable, "-m", "tests.math_verifier_parent", *args],
                                 cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                 start_new_session=True)
    self._lines = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()
    self.pool = {}  # filled by the test: killed at the end if a test failed

  def _read(self) -> None:
    for line in self.proc.stdout:
      self._lines.put(line.strip())
    self._lines.put(None)  # end of output: the parent exited

  def line(self, timeout_s: float = 120.0) -> str | None:
    return self._lines.get(timeout=timeout_s)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.proc.kill()
    self.proc.wait()
    _kill(self.pool)


@needs_proc
@pytest.mark.parametrize("death", ["pdeathsig", "no-pdeathsig"])
def test_no_worker_outlives_a_killed_parent(death):
  """A parent SIGKILLed mid-batch (nothing of it runs: no atexit, no close) takes its pool with
  it, the worker deep in 9^(9^(9^9)) too. Each way alone: PR_SET_PDEATHSIG, with a forked child
  of the parent holding the watchdogs' pipes open; and the portable watchdog, a process that sees
  the parent's end of a pipe close, with PR_SET_PDEATHSIG off."""
  with _Parent("kill", death) as parent:
    started, holder = parent.line().split()
    assert started == "started"
    assert parent.line() == "busy"
    time.sleep(1.0)  # the hostile answer is in its worker's big-integer power
    parent.pool = _descendants(parent.proc.pid)  # the holder too: killed at the end
    pool = {pid: start for pid, start in parent.pool.items() if pid != int(holder)}
    assert len(pool) >= 2, pool  # at least the two workers
    parent.proc.kill()
    parent.proc.wait()
    assert _alive(pool) == []


@needs_proc
def test_sigint_and_sigterm_leave_the_batch_to_finish():
  """Ctrl-C reaches the parent's process group, and a process manager may signal every process:
  the parent owns shutdown. Here it sets a flag (as preemption.StopSignals does) and finishes
  its batch, whose answer in flight (a two-second power) gets its real verdict from the same
  worker, not "timeout" from a killed one. The parent then exits without close(): atexit stops
  the pool."""
  with _Parent("interrupt") as parent:
    assert parent.line() == "started 0"
    assert parent.line() == "busy"
    parent.pool = _descendants(parent.proc.pid)
    time.sleep(0.5)  # the first answer, 9^(9^7), is in flight
    os.killpg(parent.proc.pid, signal.SIGINT)  # the terminal's Ctrl-C
    # Each of the parent's processes still running as listed (same start time): a listed
    # process that has ended may have its pid reused by another process, this test run's own
    # workers included, which must never get the signal.
    signalled = 0
    for pid in _alive(parent.pool, within_s=0.0):
      try:
        os.kill(pid, signal.SIGINT)
        os.kill(pid, signal.SIGTERM)
        signalled += 1
      except ProcessLookupError:
        pass
    assert signalled >= 2, parent.pool  # at least the two workers
    out = json.loads(parent.line())
    assert out["signals"] == ["SIGINT"]
    assert out["verdicts"] == ["wrong", "correct", "correct"]
    assert out["after"] == out["before"]  # no worker was replaced
    assert parent.proc.wait(timeout=30) == 0
    assert _alive(parent.pool) == []
