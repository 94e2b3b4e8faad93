"""The train loop end to end: the real CLI on :smoke, exact resume, config validation."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import dapo, drgrpo, grpo, headroom, popo, rloo, rollout_replay
from grpo_jax import checkpoint as checkpoint_lib
from grpo_jax import configuration, metrics, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_smoke_end_to_end(tmp_path):
  cmd = [sys.executable, "-m", "grpo_jax.train", "--config=configs/grpo.py:smoke",
         f"--workdir={tmp_path}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "metrics ->" in proc.stdout and "checkpoints ->" in proc.stdout
  records = metrics.read_metrics(os.fspath(tmp_path))
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2]
  # smoke: 2 prompts x 2 rollouts per step -> 4 rollouts per step.
  assert [r["rollouts"] for r in steps] == [4, 8]
  assert any("eval/mean_at_2" in r for r in records)
  assert checkpoint_lib.Checkpointer(os.fspath(tmp_path), 2).latest_step() == 2


def _final_state(workdir):
  ck = checkpoint_lib.Checkpointer(workdir, 2)
  return ck.manager.restore(ck.latest_step()).state


@pytest.mark.parametrize("module", [popo, rollout_replay, headroom])
def test_resume_gives_exactly_the_uninterrupted_run(tmp_path, module):
  """N steps + resume + N steps == 2N steps: parameters, optimiser state, the replay buffer.

  The replay methods only: their steps are GRPO's plus the buffer, and the GRPO loop runs end
  to end in the CLI smoke test, so a GRPO copy of these three runs would add time and no
  coverage. Advantages and effectiveness on the score (0 / 0.1 / 1), so that the tiny smoke
  batches do have mixed groups to store; rollout replay starts replaying at step 1.
  """

  def config(total):
    c = module.get_config("smoke")
    c.rl.reward_signal = c.rl.effective_signal = "score"
    c.replay.warmup_steps = 1
    c.total_steps = total
    c.eval.every = 100  # evaluations never change the trajectory; keep them out of the way
    c.checkpoint.every = 2
    return c

  straight, resumed = os.fspath(tmp_path / "straight"), os.fspath(tmp_path / "resumed")
  train.train_and_evaluate(config(4), straight)
  train.train_and_evaluate(config(2), resumed)   # "killed" after 2 steps...
  train.train_and_evaluate(config(4), resumed)   # ...and started again with the same command
  a, b = _final_state(straight), _final_state(resumed)
  assert "replay" in a
  assert int(np.asarray(a["replay"]["num_inserted"])) > 0  # the buffer really was used
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b) > 0
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The data position and counters were restored too: the same rollouts were generated.
  ra = [r["rollouts"] for r in metrics.read_metrics(straight) if "loss" in r]
  rb = [r["rollouts"] for r in metrics.read_metrics(resumed) if "loss" in r]
  assert ra == rb == [4, 8, 12, 16]


@pytest.mark.parametrize("module", [grpo, drgrpo, rloo, dapo, popo, rollout_replay, headroom])
def test_every_config_validates(module):
  configuration.validate(module.get_config())
  configuration.validate(module.get_config("smoke"))


@pytest.mark.parametrize("module,preset", [
    (popo, p) for p in ("kl", "filter", "ineff", "stale=10", "pi_old", "align_mu", "kl,smoke")] +
    [(headroom, p) for p in ("headroom_only", "drift_only", "decoupled")] +
    [(rollout_replay, "decoupled")])
def test_method_presets_validate(module, preset):
  configuration.validate(module.get_config(preset))


@pytest.mark.parametrize("field,value,message", [
    ("rollout.group_size", 1, "rollout.group_size"),
    ("rl.num_minibatches", 3, "rl.num_minibatches"),
    ("rl.estimator", "ppo", "rl.estimator"),
    ("model.path", "/nonexistent/model", "model.path"),
    ("rl.aggregation", "sum", "aggregation"),
    ("opt.schedule", "linear", "opt.schedule"),
    ("rollout.top_k", 20, "rollout.top_k: 20: RL rollouts must sample the full distribution"),
    ("rollout.top_p", 0.95, "rollout.top_p"),
    ("rl.effective_signal", "reward", "rl.effective_signal"),
    ("rl.prox_pass", "fresh", "rl.prox_pass"),
    ("rl.logprob_chunk", -1, "rl.logprob_chunk"),
    ("replay.objective", "on_policy", "objective"),
])
def test_invalid_values_name_the_field(field, value, message):
  c = grpo.get_config()
  group, name = field.split(".")
  c[group][name] = value
  with pytest.raises(configuration.ConfigError, match=message):
    configuration.validate(c)


def test_real_model_preset_needs_a_path():
  c = grpo.get_config("qwen3_1p7b")
  with pytest.raises(configuration.ConfigError, match="model.path.*--config.model.path"):
    configuration.validate(c)
  with pytest.raises(ValueError, match="unknown config preset 'qwen9'"):
    grpo.get_config("qwen9")


def test_cli_bad_value_is_one_readable_line(tmp_path):
  cmd = [sys.executable, "-m", "grpo_jax.train", "--config=configs/grpo.py",
         "--config.rollout.group_size=1", f"--workdir={tmp_path}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      "grpo_jax.train: config.rollout.group_size: 1: group-relative advantages need >= 2 "
      "rollouts per prompt")


def test_k1_is_rejected_as_a_loss_term():
  c = grpo.get_config()
  c.rl.kl_estimator = "k1"
  configuration.validate(c)  # no KL term: k1 is only a diagnostic, fine
  c.rl.kl_coef = 0.04
  with pytest.raises(configuration.ConfigError, match="k1.*zero expected gradient"):
    configuration.validate(c)


def test_prox_pass_auto_follows_the_matmul_dtype():
  c = grpo.get_config()
  assert configuration.prox_pass(c) == "replayed"
  c.model.dtype = "bfloat16"
  assert configuration.prox_pass(c) == "all"
  c.rl.prox_pass = "replayed"
  assert configuration.prox_pass(c) == "replayed"
