"""The command-line entry points' persistent compilation cache: where it goes and how to turn
it off (in subprocesses: the suite's own process keeps the run's cache)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROBE = ("from grpo_jax.run import compilation_cache; import jax; "
          "print(repr(compilation_cache.enable()), repr(jax.config.jax_compilation_cache_dir))")


def _enable(env_updates: dict, home) -> tuple[str, str]:
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME")}
  env.update(HOME=str(home), PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **env_updates)
  out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       env=env, timeout=120, check=True).stdout.split()
  return tuple(eval(x) for x in out)  # pylint: disable=eval-used  (our own repr of two strings)


@pytest.mark.parametrize("setting", ["default", "xdg", "named", "off"])
def test_the_cache_folder(tmp_path, setting):
  """Unset: ~/.cache/grpo_jax/jax (under XDG_CACHE_HOME when set); JAX's own variable names
  another folder; set empty, no cache."""
  updates, expected = {
      "default": ({}, str(tmp_path / ".cache" / "grpo_jax" / "jax")),
      "xdg": ({"XDG_CACHE_HOME": str(tmp_path / "xdg")}, str(tmp_path / "xdg" / "grpo_jax" / "jax")),
      "named": ({"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")}, str(tmp_path / "mine")),
      "off": ({"JAX_COMPILATION_CACHE_DIR": ""}, ""),
  }[setting]
  returned, configured = _enable(updates, tmp_path)
  assert returned == expected
  assert (configured or "") == expected
  if expected:
    assert os.path.isdir(expected)
