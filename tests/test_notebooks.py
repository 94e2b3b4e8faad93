"""Notebooks stay runnable: their code cells run in order in a fresh process."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests import run_once

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cells(name):
  """The code cells of notebooks/<name>.ipynb."""
  nb = json.load(open(os.path.join(ROOT, "notebooks", f"{name}.ipynb"), encoding="utf-8"))
  return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _run_notebook(tmp_path, name, code, timeout=600, env_set=None):
  """Runs ``code`` (a notebook's cells, joined) as a script from notebooks/, as after
  ``pip install -e .`` whether or not this environment installed the package."""
  script = tmp_path / f"{name}.py"
  script.write_text(code)
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
         **(env_set or {})}
  return subprocess.run([sys.executable, str(script)], cwd=os.path.join(ROOT, "notebooks"),
                        capture_output=True, text=True, timeout=timeout, env=env)


def _code(cells):
  return "\n\n".join("".join(c["source"]) for c in cells)


def test_quickstart_notebook_runs(tmp_path):
  code = _code(_cells("quickstart")).replace("/tmp/grpo_jax_notebook", str(tmp_path / "run"))
  proc = _run_notebook(tmp_path, "quickstart", code)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "->" in proc.stdout  # sampled completions were printed with their scores
  assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_custom_task_notebook_runs(tmp_path):
  """The own-task notebook: TRL rows in JSONL, a reward function in TRL's form from its .py
  file plus the built-in format reward, two named held-out files; the per-set evaluation keys,
  each reward's mean in the step records and the plot. Stored without outputs."""
  cells = _cells("custom_task")
  assert all(not c["outputs"] and c["execution_count"] is None for c in cells)
  code = _code(cells)
  assert "/tmp/grpo_jax_custom_task" in code
  code = code.replace("/tmp/grpo_jax_custom_task", str(tmp_path / "nb"))
  # 10 of the notebook's 40 steps: the same cells and checks, a quarter of the training.
  assert "config.total_steps = 40" in code
  code = code.replace("config.total_steps = 40", "config.total_steps = 10")
  proc = _run_notebook(tmp_path, "custom_task", code)
  assert proc.returncode == 0, proc.stderr[-3000:]
  records = _records(tmp_path / "nb" / "run")
  evals = [r for r in records if "eval/mean_at_4" in r]
  assert [r["step"] for r in evals] == [0, 10]
  for name in ("heldout_a", "heldout_b"):
    assert all(0.0 <= r[f"eval/{name}/mean_at_4"] <= 1.0 for r in evals)
    assert f"{name}: mean@4" in proc.stdout  # the per-set numbers were printed
  steps = [r for r in records if "loss" in r]
  assert len(steps) == 10
  for fn in ("countdown_accuracy", "format"):
    assert all(f"reward/{fn}_mean" in r and r[f"reward/{fn}_failures"] == 0 for r in steps)
  assert (tmp_path / "nb" / "heldout.png").stat().st_size > 0


def tpu_vm_smoke_run() -> dict:
  """The TPU-VM notebook with its SMOKE switch on (the default), run once per test run
  (``tests/run_once.py``): {"returncode", "stdout", "stderr", "workdir"}. Its POPO run is also
  the single-process 8-device reference of ``tests/run/test_multihost.py``."""
  def make(folder):
    code = _code(_cells("tpu_vm"))
    assert "SMOKE = True" in code
    workdir = folder / "run"
    code = code.replace("/tmp/grpo_jax_tpu_vm", str(workdir))
    # No device count from outside (the notebook's first cell sets it); the suite's compile
    # flags (tests/conftest.py) kept.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    proc = _run_notebook(folder, "tpu_vm", code, timeout=900,
                         env_set={"XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"})
    return {"returncode": proc.returncode, "stdout": proc.stdout,
            "stderr": proc.stderr[-3000:], "workdir": str(workdir)}
  return run_once.once_per_run("tpu_vm_notebook", make)


@pytest.mark.slow
def test_tpu_vm_notebook_runs_on_eight_fake_cpu_devices():
  """The TPU-VM notebook with its SMOKE switch on (the default): 8 fake CPU devices set by
  its first cell, the embedded model loaded into its shards, sampling, two steps of GRPO and
  of POPO on a 2 x 2 x 2 mesh, the plot."""
  proc = tpu_vm_smoke_run()
  assert proc["returncode"] == 0, proc["stderr"]
  stdout, workdir = proc["stdout"], pathlib.Path(proc["workdir"])
  assert "8 devices" in stdout
  assert "Mesh('data': 2, 'fsdp': 2, 'tensor': 2" in stdout
  # q_proj [L=4, D=128, H*Dh=128] split fsdp x tensor: a [4, 64, 64] block per device.
  assert "laid out as P(None, 'fsdp', 'tensor'), (4, 64, 64) per device" in stdout
  assert stdout.count("grpo_jax: run complete at step 2/2") == 2
  for method in ("grpo", "popo"):
    steps = [r for r in _records(workdir / method) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
  assert (workdir / "metrics.png").exists()


def _records(workdir):
  with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
