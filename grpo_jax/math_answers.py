"""Math answers checked with math-verify, in worker processes under a wall-clock bound.

math-verify (Hugging Face; ``math-verify==0.9.0``) extracts a completion's final answer (the
last ``\\boxed{}`` first, else a trailing expression), parses both it and the reference with
latex2sympy2_extended and compares them with sympy: fractions and decimals, radicals, intervals,
sets, ``x = 5`` against ``5``, ``\\dfrac``, ``\\text{}`` units. Two things make it unsafe to
call inline in a training loop: its timeouts use ``signal.alarm``, which only works in a
process's main thread, and a hostile answer such as ``9^{9^{9^9}}`` keeps sympy inside one C
call (a big-integer power) that no signal interrupts. So ``MathVerifier`` runs every check in
worker processes, one answer at a time each, with math-verify's own alarms off; the
parent watches the clock, and a worker still busy ``timeout_s`` after it took an answer is
killed (that answer is a timeout) and replaced; a whole batch can be bounded as well
(``batch_timeout_s``). Model output is only parsed, never executed.

A worker is ``python -m grpo_jax.math_answers FD``: a fresh interpreter that imports this module
and math-verify only, speaking ``multiprocessing.connection`` over one end of a socket pair.
(multiprocessing's own "spawn" would re-import the parent's main module in every worker, e.g.
``grpo_jax.train`` with JAX and transformers: a second per worker and its memory; "fork" is
unsafe in a process that runs JAX threads.)

Verdicts: ``correct``, ``wrong``, ``unparseable`` (no answer could be extracted), ``bad_gold``
(the reference itself does not parse: the row must stay out of "success"), ``timeout``.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
import subprocess
import sys
import time
from multiprocessing import connection

VERDICTS = ("correct", "wrong", "unparseable", "bad_gold", "timeout")
_START_S = 120.0  # seconds a worker may take to start (spawn, import math-verify)


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

  A killed worker's replacement is started without waiting for it: it takes no answer until it
  reports ready (it has imported math-verify), and the other workers go on meanwhile. One that
  is not ready 120 s after it was started, or that dies while starting, raises RuntimeError
  when a batch next needs it; the whole pool is then stopped, and the next ``verify`` starts it
  afresh. The first start of the pool waits for every worker, before any clock runs.

  Args:
    workers: processes (spawned on first use, kept between batches).
    timeout_s: wall-clock seconds one answer may take; then its worker is killed and the answer
      is a timeout. A batch of R answers with k hostile ones takes about
      (R / workers) x the normal time + k x (timeout_s + a worker's start) / workers.
    batch_timeout_s: wall-clock seconds one ``verify`` call may take (None: no bound). When they
      have passed, every answer not yet verified, waiting or in a worker, is a timeout, the
      workers still busy are killed and replaced as above, and ``verify`` returns: a batch
      holds the caller for batch_timeout_s plus the milliseconds those kills take, whatever its
      answers (the first call also waits for the pool to start). Waiting for a replacement to
      start counts against it.
  """

  def __init__(self, workers: int = 2, timeout_s: float = 5.0,
               batch_timeout_s: float | None = None):
    if workers < 1 or timeout_s <= 0:
      raise ValueError(f"need workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
    if batch_timeout_s is not None and batch_timeout_s <= 0:
      raise ValueError(f"need batch_timeout_s > 0 or None, got {batch_timeout_s}")
    self.workers, self.timeout_s, self.batch_timeout_s = workers, timeout_s, batch_timeout_s
    self._procs: list = []  # [(process, parent end of its connection)]
    self._starting: dict[int, float] = {}  # worker index -> when it was started, until ready
    atexit.register(self._stop, True)  # no worker outlives the run (a busy one is killed)

  @staticmethod
  def _start():
    """A worker process and the parent's end of its connection (the worker reports ready)."""
    parent, child = socket.socketpair()
    # The folder that holds the grpo_jax package, first on the worker's path: it imports this
    # very module whatever the parent's working directory or sys.path.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [root, os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.Popen([sys.executable, "-m", "grpo_jax.math_answers", str(child.fileno())],
                            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
    child.close()
    return proc, connection.Connection(parent.detach())

  @staticmethod
  def _ready(worker, wait_s: float = 0.0) -> None:
    """Reads the worker's "ready" (waiting up to wait_s for it); RuntimeError if none comes."""
    proc, conn = worker
    try:
      ok = conn.poll(wait_s) and conn.recv() == "ready"
    except (EOFError, OSError):  # it died while starting (e.g. math-verify does not import)
      ok = False
    if not ok:
      proc.kill()
      raise RuntimeError("a math-verify worker did not start (is math-verify installed? "
                         "pip install 'math-verify==0.9.0')")

  def verify(self, golds: list[str], completions: list[str]) -> list[str]:
    """One verdict per (reference, completion) pair, in order."""
    if len(golds) != len(completions):
      raise ValueError(f"{len(golds)} references for {len(completions)} completions")
    verdicts = [""] * len(golds)
    todo = list(range(len(golds)))[::-1]  # popped from the end: in order
    busy = {}  # worker index -> (item, started)
    try:
      if not self._procs:
        self._procs = [self._start() for _ in range(self.workers)]
        for worker in self._procs:
          self._ready(worker, _START_S)
      end = math.inf if self.batch_timeout_s is None else time.monotonic() + self.batch_timeout_s
      while (todo or busy) and time.monotonic() < end:
        for w in range(len(self._procs)):
          if w not in busy and w not in self._starting and todo:
            item = todo.pop()
            self._procs[w][1].send((golds[item], completions[item]))
            busy[w] = (item, time.monotonic())
        starting = list(self._starting) if todo else []  # only waited for while needed
        limits = [end] + [started + self.timeout_s for _, started in busy.values()]
        limits += [self._starting[w] + _START_S for w in starting]
        ready = connection.wait([self._procs[w][1] for w in [*busy, *starting]],
                                timeout=max(0.0, min(limits) - time.monotonic()))
        for w in starting:
          if self._procs[w][1] in ready or time.monotonic() >= self._starting[w] + _START_S:
            self._ready(self._procs[w])
            del self._starting[w]
        for w in list(busy):
          conn = self._procs[w][1]
          item, started = busy[w]
          if conn in ready:
            try:
              verdicts[item] = conn.recv()
            except (EOFError, OSError):  # the worker died (e.g. out of memory): it scores 0
              verdicts[item] = "timeout"
              self._replace(w)
            del busy[w]
          elif time.monotonic() - started >= self.timeout_s:
            verdicts[item] = "timeout"
            self._replace(w)
            del busy[w]
    except BaseException:  # workers may be mid-answer: none of them can serve the next batch
      self._stop(kill=True)
      raise
    for w, (item, _) in busy.items():  # the batch ran out of time
      verdicts[item] = "timeout"
      self._replace(w)
    for item in todo:
      verdicts[item] = "timeout"
    return verdicts

  def _replace(self, w: int) -> None:
    """Kills worker w and starts its replacement, which takes answers once it is ready."""
    proc, conn = self._procs[w]
    proc.kill()
    proc.wait()
    conn.close()
    self._procs[w] = self._start()
    self._starting[w] = time.monotonic()

  def _stop(self, kill: bool) -> None:
    """Stops every worker: idle ones by closing their pipe unless kill, the others by a kill."""
    for w, (proc, conn) in enumerate(self._procs):
      conn.close()  # an idle worker's recv ends: it exits
      if not kill and w not in self._starting:
        try:
          proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
          pass
      if proc.poll() is None:
        proc.kill()
      proc.wait()
    self._procs, self._starting = [], {}

  def close(self) -> None:
    """Stops the workers (also at interpreter exit)."""
    self._stop(kill=False)
    atexit.unregister(self._stop)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


if __name__ == "__main__":  # a worker: python -m grpo_jax.math_answers FD (MathVerifier._start)
  _worker(connection.Connection(int(sys.argv[1])))
