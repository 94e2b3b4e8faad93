"""Optional test dependencies that a CI run must have.

``pytest.importorskip`` turns a missing package into a skip, so a check that CI installs a
package for (PEFT, PyTorch) passes there unseen when that install silently fails. With the
environment variable ``CI`` set to "true" (any case, as GitHub Actions and most CI services set
it) ``require_or_skip`` fails the test instead; elsewhere it skips, like ``importorskip``.
"""

import importlib
import os
import types

import pytest


def in_ci(environ=None) -> bool:
  """Whether ``environ`` (default ``os.environ``) has ``CI`` set to "true", in any case."""
  return (os.environ if environ is None else environ).get("CI", "").strip().lower() == "true"


def require_or_skip(module: str, environ=None) -> types.ModuleType:
  """Imports ``module``; if that fails, fails the test under CI (``in_ci``), else skips it.

  Args:
    module: a dotted module name (``"peft"``).
    environ: the environment to read ``CI`` from (default ``os.environ``).

  Returns:
    The module.
  """
  try:
    return importlib.import_module(module)
  except ImportError as e:
    if in_ci(environ):
      pytest.fail(f"CI=true requires {module!r}, which does not import ({e})", pytrace=False)
    pytest.skip(f"could not import {module!r}: {e}", allow_module_level=True)
