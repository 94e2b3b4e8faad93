"""Reliability: preemption by a real signal, damaged checkpoints, the non-finite stop."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs import popo
from grpo_jax import checkpoint as checkpoint_lib
from grpo_jax import metrics, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {"total_steps": 40, "eval.every": 1000, "checkpoint.every": 1000,
             "rl.reward_signal": "score", "rl.effective_signal": "score"}


def _config():
  c = popo.get_config("smoke")
  for key, value in OVERRIDES.items():
    group, _, name = key.rpartition(".")
    (c[group] if group else c)[name] = value
  return c


def _final_state(workdir):
  ck = checkpoint_lib.Checkpointer(workdir, 2)
  return ck.manager.restore(ck.latest_step()).state


def test_sigterm_saves_exits_zero_and_the_resumed_run_is_exact(tmp_path):
  """A real SIGTERM to a real training process mid-run: it finishes the step, checkpoints,
  exits 0 saying where to resume; the same command then completes, and the result equals an
  uninterrupted run bit for bit (parameters, optimiser state, replay buffer, counters)."""
  workdir = tmp_path / "preempted"
  cmd = [sys.executable, "-m", "grpo_jax.train", "--config=configs/popo.py:smoke",
         f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
  deadline = time.time() + 300
  while time.time() < deadline:  # wait until training is under way (a step record exists)
    path = workdir / "metrics.jsonl"
    if path.exists() and '"loss"' in path.read_text():
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-2000:]
  assert "SIGTERM received" in out and "Run the same command to resume." in out
  stopped_at = checkpoint_lib.Checkpointer(os.fspath(workdir), 2).latest_step()
  assert 1 <= stopped_at < 40, out[-2000:]
  again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and "run complete at step 40/40" in again.stdout

  straight = tmp_path / "straight"
  train.train_and_evaluate(_config(), os.fspath(straight))
  a, b = _final_state(os.fspath(straight)), _final_state(os.fspath(workdir))
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b) > 0
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  rollouts = lambda w: [r["rollouts"] for r in metrics.read_metrics(os.fspath(w)) if "loss" in r]
  assert rollouts(workdir) == rollouts(straight) == [4 * s for s in range(1, 41)]


def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
  """The newest checkpoint's files corrupted, and a half-written save folder left behind: the
  run says which checkpoint it could not read, resumes from the one before, and finishes."""
  c = _config()
  c.total_steps, c.checkpoint.every, c.checkpoint.keep = 3, 1, 2
  workdir = os.fspath(tmp_path)
  train.train_and_evaluate(c, workdir)
  ckdir = os.path.join(workdir, "checkpoints")
  assert sorted(int(d) for d in os.listdir(ckdir) if d.isdigit()) == [2, 3]
  damaged = 0
  for root, _, files in os.walk(os.path.join(ckdir, "3")):
    for name in files:
      path = os.path.join(root, name)
      if os.path.getsize(path) > 0:
        with open(path, "r+b") as f:
          f.write(b"\0garbage" * 8)  # overwrite the head of every file
        damaged += 1
  assert damaged
  os.makedirs(os.path.join(ckdir, "4.orbax-checkpoint-tmp-12345", "state"))  # killed mid-save
  capsys.readouterr()
  c.total_steps = 4
  train.train_and_evaluate(c, workdir)
  out = capsys.readouterr().out
  assert "checkpoint 3 is unreadable" in out
  assert "resuming from checkpoint 2 (the newest readable one)" in out
  assert checkpoint_lib.Checkpointer(workdir, 2).latest_step() == 4
  # The damaged checkpoint was kept for inspection, out of the way.
  assert os.listdir(os.path.join(workdir, "checkpoints_unreadable"))[0].startswith("3-")


def test_too_many_non_finite_steps_stop_with_the_last_good_state(tmp_path, monkeypatch):
  """Every reward NaN: the device skips each update; after max_consecutive_skips = 2 the run
  stops with a message and a checkpoint whose parameters are the initial ones."""
  real = train.make_task

  def nan_task(config):
    task = real(config)
    task.score = lambda text, problem: float("nan")
    return task

  monkeypatch.setattr(train, "make_task", nan_task)
  c = _config()
  c.total_steps, c.rl.max_consecutive_skips = 10, 2
  workdir = os.fspath(tmp_path)
  with pytest.raises(train.TrainingStopped, match="2 consecutive steps skipped"):
    train.train_and_evaluate(c, workdir)
  records = [r for r in metrics.read_metrics(workdir) if "loss" in r]
  assert [r["skipped"] for r in records] == [1.0, 1.0]
  ck = checkpoint_lib.Checkpointer(workdir, 2)
  assert ck.latest_step() == 2
  saved = ck.manager.restore(2).state["train"]["params"]
  from grpo_jax.models import from_pretrained  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  initial = nnx.split(from_pretrained(c.model.path))[1]
  for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(initial)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
