"""Multi-host training on one machine: two processes of 4 fake CPU devices each.

``jax.distributed`` joins them into one 8-device runtime (CPU collectives over gloo), exactly as
the hosts of a TPU pod slice or a multi-node GPU job are joined; every process runs the real
CLI with ``--config.mesh.distributed=true``. The run must be the single-process 8-device run (same
prompts from the same stream position, same completions and rewards, the same updates up to
the rounding of cross-process reductions), written once (process 0), and resumable from the
checkpoint both processes wrote. The single-process run is the TPU-VM notebook's POPO run
(``tests/test_notebooks.py``, once per test run): the same config on the same 2 x 2 x 2 mesh of
8 fake CPU devices, which the test checks from the ``config.json`` both runs wrote.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

from grpo_jax.bench import config_match
from tests import test_notebooks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow  # two launches of the CLI, two processes each

# The TPU-VM notebook's SMOKE config of its POPO run. Greedy evaluation off, and 4 held-out
# prompts x k = 2 samples: the evaluation's sampler is the rollouts' one (4 prompts x 2
# rollouts), so each process of the two launches compiles one sampler, not two (process 1
# compiles everything again when resumed: only process 0 writes the compilation cache, and
# process 1's cache keys differ from it).
SMOKE = ["--config=configs/popo.py:smoke", "--config.rollout.batch_prompts=4",
         "--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.mesh.tensor=2",
         "--config.eval.greedy=false", "--config.eval.num_prompts=4"]


def _env(devices: int) -> dict:
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  return {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu",  # fake CPU devices
          "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _two_processes(workdir, *extra):
  """The CLI as processes 0 and 1 of a 2-process run; returns their (stdout, stderr)."""
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, "-m", "grpo_jax.train", *SMOKE, f"--workdir={workdir}",
       "--config.mesh.distributed=true", f"--config.mesh.coordinator_address=localhost:{port}",
       "--config.mesh.num_processes=2", f"--config.mesh.process_id={i}", *extra],
      cwd=ROOT, env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  outs = [p.communicate(timeout=900) for p in procs]
  codes = [p.returncode for p in procs]
  # When one process fails the other aborts in a collective: show both, the first error lines.
  report = "\n".join(f"process {i} (exit {c}):\n" + "\n".join(
      [l for l in err.splitlines() if "Error" in l or "error" in l][:20] or err.splitlines()[-20:])
      for i, (c, (_, err)) in enumerate(zip(codes, outs)))
  assert codes == [0, 0], report
  return outs


def _steps(workdir) -> list:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f if line.strip()]
  timing = ("time_", "time/", "wall_s", "tokens_per_s")
  return [{k: v for k, v in r.items() if not k.startswith(timing)} for r in records if "loss" in r]


def _config(workdir) -> dict:
  """The run's config.json, flat: {"group.key": value}."""
  with open(os.path.join(workdir, "config.json"), encoding="utf-8") as f:
    return config_match.flatten(json.load(f))


def test_two_hosts_train_resume_and_equal_the_single_process_run(tmp_path):
  workdir = tmp_path / "multihost"
  (out0, _), (out1, _) = _two_processes(workdir, "--config.total_steps=1")
  assert "grpo_jax: run complete at step 1/1" in out0
  assert "grpo_jax" not in out1  # only process 0 prints, writes metrics and the report
  assert [r["step"] for r in _steps(workdir)] == [1]  # one record per step, not two
  assert os.listdir(workdir / "checkpoints") == ["1"]

  # Both processes restore their shards of the step-1 checkpoint and go on to step 2.
  (out0, _), (out1, _) = _two_processes(workdir, "--config.total_steps=2")
  assert "grpo_jax: resuming at step 1; 2 steps" in out0
  assert "grpo_jax: run complete at step 2/2" in out0 and "grpo_jax" not in out1

  # The single-process run: the notebook's POPO run, on 8 devices of one process, 2 steps.
  notebook = test_notebooks.tpu_vm_smoke_run()
  assert notebook["returncode"] == 0, notebook["stderr"]
  reference = os.path.join(notebook["workdir"], "popo")
  # The same config but for how the processes join (mesh.distributed and its address, count
  # and id); mesh.data, fsdp and tensor are the same 2 x 2 x 2.
  mesh = ("mesh.distributed", "mesh.coordinator_address", "mesh.num_processes",
          "mesh.process_id")
  ours, theirs = _config(workdir), _config(reference)
  assert {k: v for k, v in ours.items() if k not in mesh} == {
      k: v for k, v in theirs.items() if k not in mesh}
  assert ours["mesh.distributed"] and not theirs["mesh.distributed"]
  # The same program on the same global mesh, fed the same prompts and rewards on every host,
  # the resume included (a checkpoint restores exactly). Host counters are identical; device
  # metrics agree to float32 rounding: a cross-process all-reduce (gloo) sums in another order
  # than the in-process one (measured: 1 ulp of reward_mean, 2e-7 relative of a KL).
  multi, single = _steps(workdir), _steps(reference)
  assert [r["step"] for r in multi] == [r["step"] for r in single] == [1, 2]
  for a, b in zip(multi, single):
    assert set(a) == set(b)
    for key in ("rollouts", "completion_tokens", "reward_errors", "truncated_fraction"):
      assert a[key] == b[key], key
    for key, value in b.items():
      assert abs(a[key] - value) <= 1e-5 * max(1.0, abs(value)), key
