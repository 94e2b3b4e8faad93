"""The accelerator check (grpo_jax/bench/accelerator.py) runs end to end at toy shapes here: the
script a device session starts with must not fail for the first time on the device."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_accelerator_check_runs_on_cpu_at_tiny_shapes(tmp_path):
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.run(
      [sys.executable, "-m", "grpo_jax.bench.accelerator", "--tiny", "--notests",
       "--attention=xla,blocked", f"--out_dir={tmp_path}"],
      cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads((tmp_path / "accelerator.json").read_text())
  assert not result["skipped"], result["skipped"]
  # GRPO with each kernel, then POPO with auto, at T = 16.
  assert [(pt["method"], pt["attention"]) for pt in result["steps"]] == [
      ("grpo", "xla"), ("grpo", "blocked"), ("popo", "auto")]
  for pt in result["steps"]:
    assert pt["T"] == 16 and pt["gen_tokens_per_s"] > 0 and pt["train_tokens_per_s"] > 0
    assert pt["planned_step_bytes"] > 0
  if result["backend"] == "cpu":  # no chip peak, no device memory statistics
    assert all(pt["device_peak_bytes"] is None for pt in result["steps"])
    # The splash kernel, interpreted, against blocked in bf16.
    (splash,) = result["parity"]
    assert splash["kernel"] == "splash (interpreted)"
    assert splash["max_out_diff"] <= 0.05 * splash["ref_out_scale"]
    assert splash["max_grad_diff"] <= 0.05 * splash["ref_grad_scale"]
    assert splash["max_at_padding"] == 0 and splash["finite"]
  table = (tmp_path / "accelerator.md").read_text()
  assert "| grpo | blocked (blocked) | 16 |" in table and "| popo | auto (xla) | 16 |" in table
