"""Math answers checked with math-verify, in worker processes under a wall-clock bound.

math-verify (Hugging Face; ``math-verify==0.9.0``) extracts a completion's final answer (the
last ``\\boxed{}`` first, else a trailing expression), parses both it and the reference with
latex2sympy2_extended and compares them with sympy: fractions and decimals, radicals, intervals,
sets, ``x = 5`` against ``5``, ``\\dfrac``, ``\\text{}`` units. Two things make it unsafe to
call inline in a training loop: its timeouts use ``signal.alarm``, which only works in a
process's main thread, and a hostile answer such as ``9^{9^{9^9}}`` keeps sympy inside one C
call (a big-integer power) that no signal interrupts. So ``MathVerifier`` runs every check in
spawned worker processes, one answer at a time each, with math-verify's own alarms off; the
parent watches the clock, and a worker still busy ``timeout_s`` after it took an answer is
killed (that answer is a timeout) and replaced. Model output is only parsed, never executed.

Verdicts: ``correct``, ``wrong``, ``unparseable`` (no answer could be extracted), ``bad_gold``
(the reference itself does not parse: the row must stay out of "success"), ``timeout``.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from multiprocessing import connection

VERDICTS = ("correct", "wrong", "unparseable", "bad_gold", "timeout")


def _as_math(gold: str) -> str:
  """A bare reference (``\\frac{5}{6}``, ``7``) in math delimiters, so that math-verify's LaTeX
  extraction reads it; references already delimited or boxed stay as they are."""
  return gold if "$" in gold or "\\boxed" in gold else f"${gold}$"


def verify_one(gold: str, completion: str) -> str:
  """The verdict on one completion against one reference (no time bound: call it in a worker).

  Args:
    gold: the reference answer (LaTeX or plain, delimited or not).
    completion: the model's decoded completion.
  """
  from math_verify import parse, verify  # pylint: disable=g-import-not-at-top
  expected = parse(_as_math(gold), parsing_timeout=None)
  if not expected:
    return "bad_gold"
  answer = parse(completion, parsing_timeout=None)
  if not answer:
    return "unparseable"
  return "correct" if verify(expected, answer, timeout_seconds=None) else "wrong"


def _worker(conn) -> None:
  """A worker's loop: (gold, completion) in, verdict out, until the pipe closes."""
  # math-verify warns on every call that its alarms are off: the parent's clock bounds us.
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  import math_verify  # pylint: disable=g-import-not-at-top,unused-import  (before the clock runs)
  conn.send("ready")
  while True:
    try:
      gold, completion = conn.recv()
    except EOFError:
      return
    try:
      verdict = verify_one(gold, completion)
    except Exception:  # pylint: disable=broad-except  (sympy / antlr raise many kinds)
      verdict = "unparseable"
    conn.send(verdict)


class MathVerifier:
  """math-verify over batches of completions in ``workers`` processes, each answer bounded.

  Args:
    workers: processes (spawned on first use, kept between batches).
    timeout_s: wall-clock seconds one answer may take; then its worker is killed and the answer
      is a timeout. A batch of R answers with k hostile ones takes about
      (R / workers) x the normal time + k x timeout_s / workers.
  """

  def __init__(self, workers: int = 2, timeout_s: float = 5.0):
    if workers < 1 or timeout_s <= 0:
      raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
    self.workers, self.timeout_s = workers, timeout_s
    self._ctx = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
    self._procs: list = []  # [(process, parent end of its pipe)]

  def _start(self):
    parent, child = self._ctx.Pipe()
    proc = self._ctx.Process(target=_worker, args=(child,), daemon=True)
    proc.start()
    child.close()
    return proc, parent

  @staticmethod
  def _ready(worker):
    """Waits until the worker has imported math-verify, so no answer's clock counts that."""
    proc, conn = worker
    if not conn.poll(120.0) or conn.recv() != "ready":
      proc.kill()
      raise RuntimeError("a math-verify worker did not start (is math-verify installed? "
                         "pip install 'math-verify==0.9.0')")
    return worker

  def _spawn(self):
    return self._ready(self._start())

  def verify(self, golds: list[str], completions: list[str]) -> list[str]:
    """One verdict per (reference, completion) pair, in order."""
    if len(golds) != len(completions):
      raise ValueError(f"{len(golds)} references for {len(completions)} completions")
    if not self._procs:
      self._procs = [self._ready(w) for w in [self._start() for _ in range(self.workers)]]
    verdicts = [""] * len(golds)
    todo = list(range(len(golds)))[::-1]  # popped from the end: in order
    busy = {}  # worker index -> (item, started)
    while todo or busy:
      for w in range(len(self._procs)):
        if w not in busy and todo:
          item = todo.pop()
          self._procs[w][1].send((golds[item], completions[item]))
          busy[w] = (item, time.monotonic())
      now = time.monotonic()
      wait_s = max(0.0, min(started + self.timeout_s - now for _, started in busy.values()))
      ready = connection.wait([self._procs[w][1] for w in busy], timeout=wait_s)
      for w in list(busy):
        proc, conn = self._procs[w]
        item, started = busy[w]
        if conn in ready:
          try:
            verdicts[item] = conn.recv()
          except EOFError:  # the worker died (e.g. out of memory): that answer scores 0
            verdicts[item] = "timeout"
            self._replace(w)
          del busy[w]
        elif time.monotonic() - started >= self.timeout_s:
          verdicts[item] = "timeout"
          self._replace(w)
          del busy[w]
    return verdicts

  def _replace(self, w: int) -> None:
    proc, conn = self._procs[w]
    proc.kill()
    proc.join()
    conn.close()
    self._procs[w] = self._spawn()

  def close(self) -> None:
    """Stops the workers (also at garbage collection: they are daemons)."""
    for proc, conn in self._procs:
      conn.close()
      proc.join(timeout=1.0)
      if proc.is_alive():
        proc.kill()
    self._procs = []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
