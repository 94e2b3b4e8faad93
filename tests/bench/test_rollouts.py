"""``python -m grpo_jax.bench.rollouts``: the command runs at a tiny shape and its last line is
the JSON the docs quote (no time is asserted)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_the_command_ends_with_its_summary_json():
  cmd = [sys.executable, "-m", "grpo_jax.bench.rollouts", "--completion_len=32", "--groups=2",
         "--group_size=2", "--prompt_len=8", "--steps=2", "--warmup=1", "--chunk=4",
         "--staleness=1,4", "--default_staleness=4", "--nocheck_sampler", "--compare_cache",
         "--train_step_methods=popo"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [json.loads(line) for line in proc.stdout.strip().splitlines()]
  summary = lines[-1]
  assert summary["completion_len"] == 32 and summary["default_staleness"] == 4
  for key in ("static_useful_fraction", "pipeline_useful_fraction",
              "generation_speedup_per_useful_token", "step_speedup_per_useful_token"):
    assert summary[key] > 0, key
  # The static batch decodes to its longest row; the pool keeps its slots busier.
  assert summary["static_useful_fraction"] < summary["pipeline_useful_fraction"] <= 1
  full = [r for r in lines if "update_s" in r][0]
  assert full["static"]["groups_trained"] == 2 * 2  # B groups per measured step
  # --compare_cache: the re-prefilling pipeline beside the one keeping its cache, and its
  # re-prefill positions counted (the keeping one computes none).
  assert summary["reprefill_useful_fraction"] > 0 and summary["reprefill_generation_time_ratio"] > 0
  assert full["pipeline_staleness_4_reprefill"]["reprefill_positions"] > 0
  assert full["pipeline_staleness_4"]["reprefill_positions"] == 0
  # The update at the real tokens (--packing, on by default): the packed loss pass computes
  # fewer padding positions than the padded one, and both times are there.
  assert 0 < summary["update_useful_fraction_none"] < summary["update_useful_fraction"] <= 1
  assert summary["update_speedup_per_token"] > 0
  assert summary["step_speedup_per_useful_token_packed"] > 0
  # --train_step_methods: POPO's own step, padded and packed, on the same rows: one of the two
  # groups is ineffective and its slot is filled from the group the first call stored (G = 2
  # replayed rows); the two layouts compute the same loss, the packed one on fewer positions.
  step = [r for r in lines if "update_s" in r][0]["train_step_popo"]
  assert step["none"]["replay_rows"] == step["tokens"]["replay_rows"] == 2
  assert step["tokens"]["loss"] == pytest.approx(step["none"]["loss"], rel=1e-4, abs=1e-6)
  assert summary["popo_step_useful_fraction_none"] < summary["popo_step_useful_fraction"] <= 1
  assert summary["popo_step_speedup_per_token"] > 0
