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

Each worker comes with a watchdog. ``python -m grpo_jax.rewards.math_answers`` (a fresh interpreter
that imports this module; multiprocessing's own "spawn" would re-import the parent's main module,
e.g. ``grpo_jax.train`` with JAX, in every worker, and "fork" is unsafe in a process that runs
JAX threads) starts as the watchdog, in a session of its own, and forks the worker, which
imports math-verify and speaks ``multiprocessing.connection`` to the parent over one end of a
socket pair. The parent owns shutdown:

- Both ignore SIGINT and SIGTERM, and their own session keeps a terminal's Ctrl-C (sent to the
  parent's process group) away from them: a run that catches the signal to finish its step
  (``preemption.StopSignals``) gets real verdicts for the answers in flight, not timeouts.
- They die with the parent, however it dies (SIGKILL, out of memory): the watchdog blocks on
  the read end of a pipe whose only write end the parent holds; end of file means the parent
  closed it or is gone, and the watchdog kills the worker, reaps it and exits. That watchdog is a
  process, not a thread in the worker: a worker in a big-integer power holds the GIL inside one
  C call, and a thread waiting beside it never runs (tried: still alive after 20 s). On Linux,
  PR_SET_PDEATHSIG also has the kernel kill the watchdog when the parent dies and the worker
  when the watchdog does. It fires when the parent's *thread* that started the process exits, so
  it is set only for processes started from the main thread; the pipe covers the others.
- The parent stops a worker (at its time bound, on ``close()``, at interpreter exit) by closing
  that pipe and waiting for the watchdog; one that does not exit in a few seconds is killed
  with its session. Every process is reaped by its own parent: none is left to init.

Verdicts: ``correct``, ``wrong``, ``unparseable`` (no answer could be extracted), ``bad_gold``
(the reference itself does not parse: the row must stay out of "success"), ``timeout``.

Dollars: math-verify reads LaTeX between math delimiters, and takes every ``$`` for one, so
MATH's currency (``\\$18.90``, ``\\$1,\\!000``) would make a reference unparseable. An escaped
``\\$`` is a currency sign, which says nothing about the value: it is dropped, from the
reference and from the completion (math-verify reads ``\\$5`` inside delimiters or a box but
not in an unboxed final answer), so ``\\$18.90`` is 18.90 and ``\\boxed{18.90}`` matches it. A
reference with an unpaired ``$`` (``$18.90`` in plain text) has its dollars dropped too. Percents
and thousands separators (``25\\%``, ``1,\\!000``) are math-verify's own: ``25\\%`` matches 25\\%,
25 and 0.25.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import connection

VERDICTS = ("correct", "wrong", "unparseable", "bad_gold", "timeout")
_START_S = 120.0  # seconds a worker may take to start (spawn, import math-verify)
_STOP_S = 5.0  # seconds a watchdog may take to kill and reap its worker before it is killed
_PDEATHSIG = sys.platform.startswith("linux")  # off: the pipe watchdog alone (tests set it)

# "\$" after an even run of backslashes (none, or "\\" line breaks): an escaped dollar.
_ESCAPED_DOLLAR = re.compile(r"(?<!\\)((?:\\\\)*)\\\$")
# What math-verify's LaTeX extraction reads as is: a "$" (once escaped ones are gone), a box,
# or an unescaped "\(" or "\[".
_DELIMITED = re.compile(r"\$|\\boxed|(?<!\\)(?:\\\\)*\\[(\[]")


def _drop_escaped_dollars(text: str) -> str:
  """text without its ``\\$``: a currency sign, never a delimiter, and no part of a value."""
  return _ESCAPED_DOLLAR.sub(r"\1", text)


def _as_math(gold: str) -> str:
  """A reference as math-verify's LaTeX extraction reads it: escaped dollars dropped, and an
  unpaired ``$`` (plain-text currency, ``$18.90``) as well; then a bare reference
  (``\\frac{5}{6}``, ``18.90``) goes in math delimiters, while one already delimited (``$..$``,
  ``\\(..\\)``, ``\\[..\\]``) or boxed stays as it is."""
  gold = _drop_escaped_dollars(gold)
  if gold.count("$") % 2:
    gold = gold.replace("$", "")
  return gold if _DELIMITED.search(gold) else f"${gold}$"


def verify_one(gold: str, completion: str) -> str:
  """The verdict on one completion against one reference (no time bound: call it in a worker).

  Escaped dollars (``\\$``, currency) are dropped from both, as the module's docstring says.

  Args:
    gold: the reference answer (LaTeX or plain, delimited or not).
    completion: the model's decoded completion.
  """
  from math_verify import parse, verify  # pylint: disable=g-import-not-at-top
  expected = parse(_as_math(gold), parsing_timeout=None)
  if not expected:
    return "bad_gold"
  answer = parse(_drop_escaped_dollars(completion), parsing_timeout=None)
  if not answer:
    return "unparseable"
  return "correct" if verify(expected, answer, timeout_seconds=None) else "wrong"


def _worker(conn) -> None:
  """A worker's loop: (gold, completion) in, verdict out, until the connection closes."""
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


def _die_with(parent: int) -> None:
  """Has the kernel SIGKILL this process when its parent (the thread that started it) exits,
  on Linux; exits at once if that parent is gone already (before the call could see it)."""
  if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
  if os.getppid() != parent:
    os._exit(1)


def _watchdog(worker: int, death_fd: int) -> None:
  """Blocks until the parent's end of the pipe closes (the parent closed it, or died), then
  kills the worker, its child (unreaped, so its pid cannot belong to another process yet)."""
  while os.read(death_fd, 1):  # nothing is written: only the end of the pipe wakes us
    pass
  try:
    os.kill(worker, signal.SIGKILL)
  except ProcessLookupError:
    pass
  os.waitpid(worker, 0)


def _main(conn_fd: int, death_fd: int, parent: int) -> None:
  """A watchdog and its worker (MathVerifier._start). parent: the pid PR_SET_PDEATHSIG ties the
  watchdog to (and the worker to the watchdog), or 0 for neither: the pipe alone."""
  for sig in (signal.SIGINT, signal.SIGTERM):  # the parent owns shutdown (inherited by the fork)
    signal.signal(sig, signal.SIG_IGN)
  if parent:
    _die_with(parent)
  watchdog = os.getpid()
  worker = os.fork()  # safe: no thread runs yet, math-verify is not imported
  if worker == 0:
    os.close(death_fd)
    if parent:
      _die_with(watchdog)
    _worker(connection.Connection(conn_fd))
  else:
    os.close(conn_fd)  # else a dead worker's connection would not close for the parent
    _watchdog(worker, death_fd)


class MathVerifier:
  """math-verify over batches of completions in ``workers`` processes, each answer bounded.

  A worker is a process with a watchdog process (the module's docstring): both ignore SIGINT and
  SIGTERM, and both die with this one. Start the pool (the first ``verify``, and a replacement)
  from the main thread for Linux's PR_SET_PDEATHSIG as well; from another thread, the pipe
  watchdog alone stops them when this process dies.

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
    self._procs: list = []  # [(watchdog process, the worker's connection, the pipe's write end)]
    self._starting: dict[int, float] = {}  # worker index -> when it was started, until ready
    atexit.register(self._stop)  # no worker outlives the run (a busy one is killed)

  @staticmethod
  def _start():
    """A watchdog and its worker, the parent's end of the worker's connection (the worker
    reports ready on it) and the write end of the watchdog's pipe."""
    parent, child = socket.socketpair()
    # Not inheritable: no program this process runs holds the write end open (a child it merely
    # forks does, until it exits: PR_SET_PDEATHSIG covers that case on Linux).
    death_r, death_w = os.pipe()
    # The folder that holds the grpo_jax package, first on the worker's path: it imports this
    # very module whatever the parent's working directory or sys.path.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [root, os.environ.get("PYTHONPATH", "")]))}
    # PR_SET_PDEATHSIG follows the starting thread: from any but the main one, it could kill
    # the pool while this process lives on.
    main = threading.current_thread() is threading.main_thread()
    owner = os.getpid() if _PDEATHSIG and main else 0
    try:
      proc = subprocess.Popen(
          [sys.executable, "-m", "grpo_jax.rewards.math_answers", str(child.fileno()), str(death_r),
           str(owner)],
          pass_fds=(child.fileno(), death_r), env=env, stdin=subprocess.DEVNULL,
          start_new_session=True)  # a terminal's Ctrl-C goes to our process group, not theirs
    except BaseException:
      parent.close()
      os.close(death_w)
      raise
    finally:
      child.close()
      os.close(death_r)
    return proc, connection.Connection(parent.detach()), open(death_w, "wb", buffering=0)

  @staticmethod
  def _end(workers) -> None:
    """Stops workers and their watchdogs: closing a watchdog's pipe has it kill its worker (busy
    or idle), reap it and exit; one that has not exited after _STOP_S is killed with its session
    (the watchdog, unreaped until then, still holds the session's id). Safe to repeat."""
    for _, conn, death in workers:
      conn.close()
      death.close()
    for proc, _, _ in workers:
      try:
        proc.wait(timeout=_STOP_S)
      except subprocess.TimeoutExpired:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        proc.wait()

  @classmethod
  def _ready(cls, worker, wait_s: float = 0.0) -> None:
    """Reads the worker's "ready" (waiting up to wait_s for it); RuntimeError if none comes."""
    conn = worker[1]
    try:
      ok = conn.poll(wait_s) and conn.recv() == "ready"
    except (EOFError, OSError):  # it died while starting (e.g. math-verify does not import)
      ok = False
    if not ok:
      cls._end([worker])
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
      self._stop()
      raise
    for w, (item, _) in busy.items():  # the batch ran out of time
      verdicts[item] = "timeout"
      self._replace(w)
    for item in todo:
      verdicts[item] = "timeout"
    return verdicts

  def _replace(self, w: int) -> None:
    """Kills worker w and starts its replacement, which takes answers once it is ready."""
    self._end([self._procs[w]])
    self._procs[w] = self._start()
    self._starting[w] = time.monotonic()

  def _stop(self) -> None:
    """Stops every worker and watchdog (an idle worker has nothing to finish: it is killed too)."""
    self._end(self._procs)
    self._procs, self._starting = [], {}

  def close(self) -> None:
    """Stops the workers (also at interpreter exit)."""
    self._stop()
    atexit.unregister(self._stop)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


if __name__ == "__main__":  # python -m grpo_jax.rewards.math_answers CONN_FD PIPE_FD PARENT (_start)
  _main(*map(int, sys.argv[1:4]))
