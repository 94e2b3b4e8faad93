"""Measurements in processes of their own, each bounded in time, results written as they come.

A command with a hard limit (a lent accelerator's 10-minute command, a CI job) loses
everything when a single measurement outlives it: one long compile, one shape that runs for
minutes. Here each measurement runs in a child process with its own deadline, and the parent
keeps everything on disk after every one:

* ``run_point``: the child is the leader of its own process group, so a timeout kills it and
  anything it started (``os.killpg``); it also gets SIGKILL when the parent dies (Linux
  ``PR_SET_PDEATHSIG``), so a parent killed from outside leaves no child running on the device.
* ``exit_at``: called in the child, ends it at its deadline by itself, should no parent be
  left to do it.
* ``write_atomic``: a temporary file renamed over the old one, so that a kill at any moment
  leaves the previous complete file or the new one, never half of one.

No JAX here: the parent never touches the device, which belongs to one child at a time (and a
child's peak memory is then its own, not the process's cumulative one).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_running: list[subprocess.Popen] = []  # the child in flight, for the parent's SIGTERM handler


def write_atomic(path: str, text: str) -> None:
  """``text`` into ``path`` through a temporary file in the same folder and ``os.replace``."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def _child_setup() -> None:
  """In the child before exec: its own process group, and SIGKILL when the parent dies."""
  os.setpgid(0, 0)
  if sys.platform.startswith("linux"):
    try:
      ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
      pass  # the parent's kill and the child's own deadline (exit_at) still bound it


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
  proc.wait()


def kill_running() -> None:
  """Kills the child in flight (for a parent that is itself being stopped)."""
  for proc in list(_running):
    _kill_group(proc)


def run_point(argv: list[str], timeout_s: float, log_path: str, env: dict | None = None,
              title: str = "") -> dict:
  """Runs ``argv`` in its own process group, stdout and stderr appended to ``log_path``.

  Args:
    argv: the child's command line.
    timeout_s: wall-clock bound; past it the whole process group is killed.
    log_path: the log file (the child's output is appended after a header line).
    env: the child's environment (None: this process's).
    title: the header line's name of the child.

  Returns:
    {"status": "ok" | "failed" | "timeout", "seconds", "returncode" (None after a kill),
    "last_line": the last non-empty line the child wrote (a failure's exception)}.
  """
  with open(log_path, "ab") as log:
    log.write(f"\n=== {title or argv[-1]} (timeout {timeout_s:.0f} s)\n".encode())
    log.flush()
    start_offset = log.tell()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                            stdin=subprocess.DEVNULL, preexec_fn=_child_setup)
    _running.append(proc)
    try:
      try:
        returncode = proc.wait(timeout=max(timeout_s, 0.01))
        status = "ok" if returncode == 0 else "failed"
      except subprocess.TimeoutExpired:
        _kill_group(proc)
        returncode, status = None, "timeout"
    finally:
      _running.remove(proc)
    seconds = time.perf_counter() - t0
  with open(log_path, "rb") as log:
    log.seek(start_offset)
    lines = [ln.strip() for ln in log.read().decode(errors="replace").splitlines()]
  last = next((ln for ln in reversed(lines) if ln), f"exit status {returncode}")[:400]
  return {"status": status, "seconds": seconds, "returncode": returncode, "last_line": last}


def exit_at(deadline: float, code: int = 124) -> None:
  """Ends this process at ``deadline`` (``time.time()``) from a daemon thread, whatever it is
  doing (a compile, a device call): the child's own bound, when no parent kills it."""
  def watch():
    time.sleep(max(deadline - time.time(), 0.0))
    os._exit(code)  # pylint: disable=protected-access
  threading.Thread(target=watch, daemon=True).start()
