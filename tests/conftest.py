"""Shared fixtures (tiny models built once per session), the worker count and the run's
compilation cache.

The suite runs on pytest-xdist workers (``-n auto`` in pyproject.toml, capped here at
``_MAX_WORKERS``: each worker holds its own compiled steps, ~5 GiB at peak), tests handed out
in blocks and stolen by an idle worker (``--dist worksteal``: the slow files do not all end up
at the tail of one worker; a module's fixtures that both workers build compile once, through
the cache below). ``-n 0`` runs everything in this process. Every process of the
run — both workers and the subprocesses tests start (multi-host, signals, 8 fake devices) —
shares one JAX persistent compilation cache in a directory made for this run and removed at
its end, so a train step that several tests or subprocesses build compiles once. A
``JAX_COMPILATION_CACHE_DIR`` already in the environment is used instead (and kept).
"""

import os
import pathlib
import shutil
import sys
import tempfile

import pytest

from tests import run_once

DATA = pathlib.Path(__file__).parent / "data"
_MAX_WORKERS = 2
# The controller (or a run without workers) makes the directory; the workers it starts inherit
# the variable. A directory the user set is neither replaced nor removed.
_OWN_CACHE = ("JAX_COMPILATION_CACHE_DIR" not in os.environ
              and "PYTEST_XDIST_WORKER" not in os.environ)
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="grpo_jax_test_jit_cache_")
# The run's shared folder (tests/run_once.py), made and removed the same way.
_OWN_RUN_DIR = (run_once.ENV not in os.environ and "PYTEST_XDIST_WORKER" not in os.environ)
if _OWN_RUN_DIR:
  os.environ[run_once.ENV] = tempfile.mkdtemp(prefix="grpo_jax_test_run_")
# XLA:CPU's LLVM back end without optimisation, and its older loop emitters for fusions: the
# suite's programs are tiny and compiled once each, so compiling is most of their cost (at
# -O0, 73% of the POPO and step tests' time is XLA's backend compile). -O0 halves a train
# step's compile (POPO's on the tiny model: 9.0 s to 4.8 s) and changes no HLO (the fusion and
# layout passes, buffer assignment and memory analysis are the same). The loop emitters
# (``--xla_cpu_use_fusion_emitters=false``) emit the same fusions' code in less time: 4.0 s to
# 2.4 s for that step, and 165 s to 114 s for tests/rl/test_popo.py + tests/rl/test_step.py; every
# test, the exact-equality ones included, passes unchanged under them. Subprocesses inherit the
# flags; a test that sets XLA_FLAGS for its own subprocess appends to them. Three more cut
# compile time and change no result: one LLVM module per program instead of splitting it for
# parallel codegen (the two workers already keep both cores busy), the default scheduler
# instead of the concurrency-optimised one, and copy insertion without region analysis;
# tests/rl/test_step.py alone (one process, fresh cache, 7 December): 47.7 s -> 38.2 s.
for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
              "--xla_cpu_parallel_codegen_split_count=1",
              "--xla_cpu_enable_concurrency_optimized_scheduler=false",
              "--xla_cpu_copy_insertion_use_region_analysis=false"):
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), _flag]))
# On an accelerator: float32 matmuls at full precision (Hopper's default is TF32, ~1e-3
# relative, and the suite's float32 tolerances are 1e-5; on a CPU this changes nothing), and no
# worker preallocating 75% of the device (two xdist workers and their subprocesses share it).
# Tests that fake CPU devices pin their subprocesses to the CPU (JAX_PLATFORMS=cpu).
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Cache every compilation, however small: the tests' steps are small and compiled many times.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
if "jax" in sys.modules:  # a plugin imported JAX before this file: set its config directly
  import jax
  jax.config.update("jax_default_matmul_precision", os.environ["JAX_DEFAULT_MATMUL_PRECISION"])
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_xdist_auto_num_workers(config):
  """``-n auto``: the CPU count, at most ``_MAX_WORKERS`` (memory, not cores, bounds it)."""
  del config
  return max(1, min(_MAX_WORKERS, os.cpu_count() or 1))


def pytest_collection_finish(session):
  """Starts each 8-device checks' subprocess in the background when a selected test needs it
  (``tests/test_multidevice.py``, ``tests/test_async_devices.py``), once per run: they run
  beside the other tests."""
  if session.config.option.collectonly:
    return
  root = str(pathlib.Path(__file__).parent.parent)
  env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
  for name, module, checks in (("multidevice", "test_multidevice.py", "multidevice_checks.py"),
                               ("async", "test_async_devices.py", "async_checks.py")):
    if any(item.nodeid.startswith(f"tests/{module}::") for item in session.items):
      run_once.start(name, lambda folder, checks=checks: [
          sys.executable, os.path.join(root, "tests", checks), str(folder / "report.json")],
                     cwd=root, env=env)


def pytest_sessionfinish(session, exitstatus):
  """The process that made the run's cache and folder removes them at the end."""
  del session, exitstatus
  if _OWN_CACHE:
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
  if _OWN_RUN_DIR:
    shutil.rmtree(os.environ[run_once.ENV], ignore_errors=True)


@pytest.fixture(scope="session")
def data_dir() -> pathlib.Path:
  return DATA


@pytest.fixture(scope="session")
def tiny_qwen3():
  from grpo_jax.models import from_pretrained
  return from_pretrained(os.fspath(DATA / "tiny_qwen3"))


@pytest.fixture(scope="module")
def split(tiny_qwen3):
  """(graphdef, params) of the tiny Qwen3; per module, so a module may donate its params."""
  from flax import nnx
  return nnx.split(tiny_qwen3)


@pytest.fixture(scope="session")
def tiny_qwen2():
  from grpo_jax.models import from_pretrained
  return from_pretrained(os.fspath(DATA / "tiny_qwen2"))


@pytest.fixture(scope="session")
def golden():
  import numpy as np
  return dict(np.load(DATA / "golden_logits.npz"))
