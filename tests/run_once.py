"""Work a test run does once, however many xdist workers need it.

A module's fixture runs once per worker that runs any of its tests: under ``worksteal`` a
subprocess-backed fixture (the 8-device checks, the CLI's smoke run) would run on both workers.
Everything here lives in the run's folder (``RUN_DIR``, made by the process that starts the run
and removed at its end, ``tests/conftest.py``), which the workers share.

* ``once_per_run``: the first worker to ask computes the value (under an exclusive file lock)
  and writes it beside the folder; the others wait and read it.
* ``start`` / ``wait``: a command started in the background as soon as a worker collects a test
  that needs it, so it runs beside the other tests instead of blocking a worker when its tests
  come up; its tests wait for its exit status. It dies with the worker that started it.
"""

import ctypes
import fcntl
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

ENV = "GRPO_JAX_TEST_RUN_DIR"


def run_dir() -> pathlib.Path:
  """The run's shared folder (``$GRPO_JAX_TEST_RUN_DIR``)."""
  return pathlib.Path(os.environ[ENV])


def once_per_run(name: str, make):
  """``make(folder)``'s JSON-able result, computed once per test run. A failing ``make``
  raises in the worker that ran it; the next one to ask tries again."""
  root = run_dir()
  result = root / f"{name}.json"
  with open(root / f"{name}.lock", "w", encoding="utf-8") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if result.exists():
      return json.loads(result.read_text(encoding="utf-8"))
    folder = root / name
    folder.mkdir(exist_ok=True)
    value = make(folder)
    result.write_text(json.dumps(value), encoding="utf-8")
    return value


def _die_with_parent():
  """In the child, before exec: SIGKILL when the process that started it dies (Linux)."""
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except OSError:
    pass


def start(name: str, make_cmd, **kwargs) -> None:
  """Starts ``make_cmd(folder)`` unless this run already did; its stdout and stderr go to files
  in ``folder`` (``<run dir>/<name>/``), its exit status to ``rc``. ``kwargs``: ``Popen``'s."""
  folder = run_dir() / name
  try:
    folder.mkdir()  # atomic: one worker wins
  except FileExistsError:
    return
  waiter = ("import ctypes, os, signal, subprocess, sys\n"
            "def die():\n"
            "  try:\n"
            "    ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\n"
            "  except OSError:\n"
            "    pass\n"
            "linux = sys.platform.startswith('linux')\n"
            "with open(sys.argv[2], 'w') as out, open(sys.argv[3], 'w') as err:\n"
            "  rc = subprocess.call(sys.argv[4:], stdout=out, stderr=err,\n"
            "                       preexec_fn=die if linux else None)\n"
            "with open(sys.argv[1] + '.tmp', 'w') as f:\n"
            "  f.write(str(rc))\n"
            "os.replace(sys.argv[1] + '.tmp', sys.argv[1])\n")
  preexec = _die_with_parent if sys.platform.startswith("linux") else None
  subprocess.Popen([sys.executable, "-c", waiter, str(folder / "rc"), str(folder / "stdout"),
                    str(folder / "stderr"), *make_cmd(folder)], preexec_fn=preexec,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kwargs)


def wait(name: str, timeout: float) -> pathlib.Path:
  """The folder of ``start``'s command once it has exited 0 (AssertionError with its stderr's
  tail otherwise, or when it runs past ``timeout`` seconds)."""
  folder = run_dir() / name
  deadline = time.monotonic() + timeout
  while not (folder / "rc").exists():
    assert time.monotonic() < deadline, f"{name}: not done after {timeout:.0f} s"
    time.sleep(0.5)
  rc = int((folder / "rc").read_text())
  assert rc == 0, f"{name} exited {rc}:\n" + (folder / "stderr").read_text()[-4000:]
  return folder
