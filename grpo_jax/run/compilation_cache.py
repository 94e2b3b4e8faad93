"""JAX's persistent compilation cache, on by default for the command-line entry points.

A restart of the same command (a resumed run, a sweep's next cell, the accelerator check run
again) then compiles nothing: XLA's executables are read back from disk, keyed by the program,
the backend and the compiler flags. The folder is ``$JAX_COMPILATION_CACHE_DIR`` when set (JAX's
own variable, which also names the tests' cache; empty: no cache), else
``$XDG_CACHE_HOME/grpo_jax/jax`` (``~/.cache/grpo_jax/jax``). Programs that compile in under a
second are not written (JAX's ``jax_persistent_cache_min_compile_time_secs``).
"""

from __future__ import annotations

import os

ENV = "JAX_COMPILATION_CACHE_DIR"


def default_dir() -> str:
  """``$XDG_CACHE_HOME/grpo_jax/jax``, or ``~/.cache/grpo_jax/jax``."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "grpo_jax", "jax")


def enable() -> str:
  """Turns the persistent cache on (``$JAX_COMPILATION_CACHE_DIR``, else ``default_dir()``);
  returns the folder, or "" when the variable is set empty (off). Call before the first
  compilation; a folder that cannot be made leaves the cache off (compiling still works)."""
  import jax  # pylint: disable=g-import-not-at-top

  path = os.environ.get(ENV)
  if path is None:
    path = default_dir()
  if not path:
    return ""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return ""
  jax.config.update("jax_compilation_cache_dir", path)
  return path
