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
  # Useful tokens are those decoded inside the window: never more than it generated. The
  # pipeline at staleness 4 (warm-up 1 + 4 steps) trains rows begun in its warm-up, whose
  # tokens from then are not credited to the window.
  for key in ("static", "pipeline_staleness_1", "pipeline_staleness_4"):
    mode = full[key]
    assert mode["tokens_trained"] <= mode["tokens_trained_all"], key
    assert mode["tokens_trained"] <= mode["tokens_generated"], key
    assert mode["useful_fraction"] <= 1
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


def test_only_tokens_decoded_in_the_window_are_credited(split):
  # The producer of tests/generate/test_producer.py's first test: 2 slots, one decode step a
  # step; group 1 (8 tokens, versions [0, 0, 1, 2, 3, 4, 5, 6]) spans steps 0-6 beside a short
  # group (2 tokens, both of the step's version) each step; steps take tags 0, 2, 3, 4, 5, 6,
  # 7, 1. Warm-up: steps 0-1; window: steps 2-7 (first version 2).
  from grpo_jax.bench.rollouts import run_mode  # pylint: disable=g-import-not-at-top
  from tests.generate.test_producer import P, _producer  # pylint: disable=g-import-not-at-top
  producer = _producer(split, stops=(2, 8, 2, 2, 2, 2, 2, 2))
  mode = run_mode(producer, split[1], b=1, warmup=2, steps=6)
  # Generated in the window: groups 3-7's prefill tokens (5) and steps 2-6's decode steps, 2
  # tokens each (10): 15. Positions: 5 decode steps x 2 slots + 5 prefills x P = 10 + 30.
  assert mode["tokens_generated"] == 15 and mode["positions"] == 10 + 5 * P
  # Trained: groups 3-7 (10 tokens) and group 1, 5 of whose tokens (versions 2..6) were
  # decoded in the window: 15, not 10 + 8 = 18 (which would exceed the 15 generated).
  assert mode["tokens_trained_all"] == 18 and mode["tokens_trained"] == 15
  assert mode["useful_fraction"] == round(15 / 40, 4)


def test_a_row_in_flight_when_the_window_ends_is_credited_once_trained(split):
  # The same producer, window steps 1-5 (versions 1..5): groups 2-6 are taken in it (10
  # tokens); group 1 is still in flight at its end, its tokens 2-6 decoded at versions 1..5.
  # It is taken at step 7, after the window (step 6 takes group 7): the drain credits its 5
  # window tokens (not its tokens of versions 0 and 6): 10 + 5 = 15, all 15 generated in the
  # window (5 prefills + 5 decode steps x 2). Without the drain, 10 (a third short).
  from grpo_jax.bench.rollouts import run_mode  # pylint: disable=g-import-not-at-top
  from tests.generate.test_producer import P, _producer  # pylint: disable=g-import-not-at-top
  producer = _producer(split, stops=(2, 8, 2, 2, 2, 2, 2, 2))
  mode = run_mode(producer, split[1], b=1, warmup=1, steps=5)
  assert mode["tokens_generated"] == 15 and mode["positions"] == 10 + 5 * P
  assert mode["in_flight_at_end"] == 1 and mode["tokens_trained_all"] == 10
  assert mode["tokens_trained"] == 15
  assert mode["useful_fraction"] == round(15 / (10 + 5 * P), 4)
