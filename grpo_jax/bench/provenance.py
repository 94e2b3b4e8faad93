"""What a sweep record ran on besides its config: the code's git commit and the platform.

Two records of one config differ only if one of these does; a re-run that parts from its record
after some steps (``carry_over.agreed_until``) is told apart by them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess


def code_version() -> str:
  """The git commit of the code the cells run (``+dirty`` with uncommitted changes to it)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  try:
    head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "grpo_jax",
                            "configs"], capture_output=True, text=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+dirty" if dirty.strip() else "")


def platform_info() -> dict[str, str]:
  """What besides the code and config moves a run's float rounding: the jax, jaxlib and numpy
  builds, Python and the CPU (XLA compiles for its features; the flags as a short hash)."""
  versions = {}
  for name in ("jax", "jaxlib", "numpy"):
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = "none"
  cpu, flags = platform.processor() or platform.machine(), ""
  try:
    with open("/proc/cpuinfo") as f:
      info = dict((k.strip(), v.strip()) for k, v in (
          line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line))
    cpu = info.get("model name", cpu)
    flags = hashlib.sha256(info.get("flags", "").encode()).hexdigest()[:8]
  except OSError:
    pass
  return dict(versions, python=platform.python_version(), cpu=cpu, cpu_flags=flags)
