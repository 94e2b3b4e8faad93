"""Config files by name or path: what the benchmarks load, from any working directory.

A spec is ``NAME[:PRESETS]`` (a method's file in the repository's ``configs/``: ``popo:kl``
is ``configs/popo.py`` with the preset ``kl``) or ``PATH.py[:PRESETS]`` (any config file,
relative to the working directory). The file is loaded by its path, as ``--config=`` loads
it, so neither the working directory nor ``sys.path`` has to hold the repository: after
``pip install -e .`` every ``python -m grpo_jax.bench.*`` finds the method files next to the
package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys

import ml_collections

# The repository's method files: configs/ beside the package (a checkout, or pip install -e).
CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "configs")


def path_of(name: str) -> str:
  """The file a config name or path stands for. Raises FileNotFoundError (one line)."""
  if name.endswith(".py") or os.sep in name or "/" in name:
    path = os.path.abspath(name)
  else:
    path = os.path.join(CONFIGS, f"{name}.py")
  if not os.path.isfile(path):
    where = ("" if name.endswith(".py") or "/" in name else
             f" (the method files are in the repository's configs/, {CONFIGS}: install the "
             "package from a checkout with pip install -e, or give the file's path)")
    raise FileNotFoundError(f"config file {path} not found{where}")
  return path


def module(name: str):
  """The config file's module, loaded from its path once per path."""
  path = path_of(name)
  key = "_grpo_jax_config_" + hashlib.sha1(path.encode()).hexdigest()[:12]
  if key not in sys.modules:
    spec = importlib.util.spec_from_file_location(key, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[key] = loaded
    try:
      spec.loader.exec_module(loaded)
    except BaseException:
      del sys.modules[key]
      raise
  return sys.modules[key]


def load(spec: str) -> ml_collections.ConfigDict:
  """The config of ``NAME[:PRESETS]`` or ``PATH.py[:PRESETS]`` (module doc)."""
  name, _, presets = spec.partition(":")
  return module(name).get_config(presets or None)
