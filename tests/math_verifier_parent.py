"""A training process in miniature, for tests/rewards/test_math_answers.py: a MathVerifier in a process
that the test kills or interrupts. ``python -m tests.math_verifier_parent MODE [no-pdeathsig]``.

Modes (each prints ``started HOLDER`` once the pool is up, then ``busy`` just before its batch):
  kill: a batch of one hostile answer (a minute's bound) and one quick one, which never returns
    in a test's time: the test SIGKILLs this process meanwhile. With PR_SET_PDEATHSIG on, a
    forked child (HOLDER; else 0) keeps this process's ends of the watchdogs' pipes open after
    it dies, as any child forked by a trainer would: only PR_SET_PDEATHSIG can then stop the
    pool. The test kills the holder.
  interrupt: SIGINT / SIGTERM only set a flag, as ``preemption.StopSignals`` does (the step under
    way finishes); a batch of about two seconds with one worker, then one JSON line: the
    verdicts, the signals received and the worker pids before and after. It then exits without
    ``close()``: the pool is stopped at interpreter exit.
``no-pdeathsig`` turns Linux's PR_SET_PDEATHSIG off, leaving the portable watchdog alone.
"""

import json
import os
import signal
import sys
import time

from grpo_jax.rewards import math_answers

HOSTILE = "\\boxed{9^{9^{9^9}}}"
# Answers that do end: 9^(9^7), a 4.5-million-digit power, takes sympy about 2 s.
SLOW_GOLDS = ["7", "7", "\\frac{1}{2}"]
SLOW_COMPLETIONS = ["\\boxed{9^{9^{7}}}", "\\boxed{7}", "\\boxed{0.5}"]
SLOW_VERDICTS = ["wrong", "correct", "correct"]


def _pids(verifier) -> list[int]:
  return [worker[0].pid for worker in verifier._procs]  # pylint: disable=protected-access


def main(mode: str, pdeathsig: bool) -> None:
  if not pdeathsig:
    math_answers._PDEATHSIG = False  # pylint: disable=protected-access
  received = []
  if mode == "interrupt":
    for sig in (signal.SIGINT, signal.SIGTERM):
      signal.signal(sig, lambda signum, frame: received.append(signal.Signals(signum).name))
  verifier = math_answers.MathVerifier(workers=2 if mode == "kill" else 1, timeout_s=60.0)
  verifier.verify(["1"], ["1"])  # the pool is up: its processes can be listed
  before = _pids(verifier)
  holder = 0
  if mode == "kill" and pdeathsig:
    holder = os.fork()
    if holder == 0:  # holds the inherited pipes' write ends, and nothing the test reads
      os.closerange(0, 3)
      time.sleep(120)
      os._exit(0)
  print(f"started {holder}", flush=True)
  print("busy", flush=True)
  if mode == "kill":
    verifier.verify(["7", "7"], [HOSTILE, "\\boxed{7}"])
    return
  verdicts = verifier.verify(SLOW_GOLDS, SLOW_COMPLETIONS)
  print(json.dumps({"verdicts": verdicts, "signals": received, "before": before,
                    "after": _pids(verifier)}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1], "no-pdeathsig" not in sys.argv[2:])
