"""Reliability: preemption by a real signal, damaged checkpoints, a full disk, the non-finite
stop, unusable inputs."""

import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import popo
from grpo_jax import tasks as tasks_lib
from grpo_jax import train
from grpo_jax.run import checkpoint as checkpoint_lib
from grpo_jax.run import metrics
from grpo_jax.run import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 20 steps: the SIGTERM is sent once the first step record exists and lands within a step or
# two, so the run is stopped mid-way with ~17 steps to spare (40 before: half the steps for
# the same checks).
STEPS = 20
OVERRIDES = {"total_steps": STEPS, "eval.every": 1000, "checkpoint.every": 1000, "eval.greedy": False,
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


def _sigterm_once_training(workdir, program):
  """Runs ``program`` (argv after the interpreter) on the smoke config in ``workdir``, sends
  SIGTERM once a step record exists; returns (the command, stdout, stderr) of a run that
  exited 0."""
  cmd = [sys.executable, *program, "--config=configs/popo.py:smoke",
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
  return cmd, out, err


def test_sigterm_saves_exits_zero_and_the_resumed_run_is_exact(tmp_path):
  """A real SIGTERM to a real training process mid-run: it finishes the step, checkpoints,
  exits 0 saying where to resume; the same command then completes, and the result equals an
  uninterrupted run bit for bit (parameters, optimiser state, replay buffer, counters)."""
  workdir = tmp_path / "preempted"
  cmd, out, _ = _sigterm_once_training(workdir, ["-m", "grpo_jax.train"])
  assert "SIGTERM received" in out and "Run the same command to resume." in out
  stopped_at = checkpoint_lib.Checkpointer(os.fspath(workdir), 2).latest_step()
  assert 1 <= stopped_at < STEPS, out[-2000:]
  again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0 and f"run complete at step {STEPS}/{STEPS}" in again.stdout

  straight = tmp_path / "straight"
  train.train_and_evaluate(_config(), os.fspath(straight))
  a, b = _final_state(os.fspath(straight)), _final_state(os.fspath(workdir))
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b) > 0
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  rollouts = lambda w: [r["rollouts"] for r in metrics.read_metrics(os.fspath(w)) if "loss" in r]
  assert rollouts(workdir) == rollouts(straight) == [4 * s for s in range(1, STEPS + 1)]


# The CLI, with orbax's write of a checkpoint's host record wrapped: while the checkpoint is
# being written (its temporary folder exists), the process sends itself a second SIGTERM and a
# SIGINT, as a second `kill` or an impatient Ctrl-C would.
SIGNALS_DURING_THE_SAVE = """
import os, signal
import orbax.checkpoint as ocp
from absl import app
from grpo_jax import train

real = ocp.handlers.JsonCheckpointHandler.async_save

async def save_under_fire(self, directory, *args, **kwargs):
  folder = os.path.dirname(str(directory))
  print(f"signals while writing {os.path.basename(folder)}: folder present "
        f"{os.path.isdir(folder)}", flush=True)
  os.kill(os.getpid(), signal.SIGTERM)
  os.kill(os.getpid(), signal.SIGINT)
  return await real(self, directory, *args, **kwargs)

ocp.handlers.JsonCheckpointHandler.async_save = save_under_fire
train.define_flags()
app.run(train.main, flags_parser=train.parse_flags)
"""


def test_second_signals_during_the_save_change_nothing(tmp_path):
  """A real SIGTERM mid-run, then a second SIGTERM and a SIGINT while the checkpoint is being
  written: the save completes, the run exits 0 having reported only the first signal, and the
  checkpoint equals, leaf for leaf, an uninterrupted run of the same number of steps
  (parameters, optimiser state, replay buffer, host record)."""
  workdir = tmp_path / "preempted"
  _, out, err = _sigterm_once_training(workdir, ["-c", SIGNALS_DURING_THE_SAVE])
  stopped_at = checkpoint_lib.Checkpointer(os.fspath(workdir), 2).latest_step()
  assert 1 <= stopped_at < STEPS, out[-2000:]
  # Only the checkpoint of the stop was written (checkpoint.every = 1000), under the signals.
  assert re.findall(r"signals while writing (\S+): folder present (\w+)", out) == [
      (f"{stopped_at}.orbax-checkpoint-tmp", "True")]
  assert out.count("received; finishing this step") == 1 and "SIGTERM received" in out
  assert f"stopped by SIGTERM after step {stopped_at}; checkpoint saved" in out
  assert "Traceback" not in err

  straight = tmp_path / "straight"
  c = _config()
  c.total_steps = stopped_at
  train.train_and_evaluate(c, os.fspath(straight))
  ck_a = checkpoint_lib.Checkpointer(os.fspath(straight), 2)
  ck_b = checkpoint_lib.Checkpointer(os.fspath(workdir), 2)
  a, b = ck_a.manager.restore(stopped_at), ck_b.manager.restore(stopped_at)
  leaves_a, leaves_b = jax.tree.leaves(a.state), jax.tree.leaves(b.state)
  assert len(leaves_a) == len(leaves_b) > 0
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert dict(a.host) == dict(b.host)


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


def _file_digests(folder):
  """{relative path: sha256} of every file under ``folder``."""
  out = {}
  for root, _, files in os.walk(folder):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return out


def test_full_disk_during_a_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
  """ENOSPC raised inside orbax's write of checkpoint 2 (its host record, while the arrays are
  being written; step 2 is the last, so this is the final save): one error naming the problem,
  the step and the folder; checkpoint 1 is left byte for byte as it was and is the only one
  listed; the half-written folder is removed; the same run started again resumes from step 1
  and finishes. (A real full file system is the next test.)"""
  workdir = os.fspath(tmp_path)
  ckdir = os.path.join(workdir, "checkpoints")
  before = {}
  real = ocp.handlers.JsonCheckpointHandler.async_save

  async def full_disk(self, directory, *args, **kwargs):
    if os.path.basename(os.path.dirname(str(directory))).startswith("2.orbax-checkpoint-tmp"):
      before.update(_file_digests(os.path.join(ckdir, "1")))
      assert os.path.isdir(os.path.dirname(str(directory)))  # the save is under way
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return await real(self, directory, *args, **kwargs)

  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "async_save", full_disk)
  c = _config()
  c.total_steps, c.checkpoint.every = 2, 1
  from grpo_jax.models import CheckpointError  # pylint: disable=g-import-not-at-top
  with pytest.raises(CheckpointError) as e:
    train.train_and_evaluate(c, workdir)
  message = str(e.value)
  assert message.startswith(f"checkpoint of step 2 not written: no space left on device in "
                            f"{ckdir} (")
  assert message.endswith(" free); the last good checkpoint (step 1) is intact. Free some space "
                          "(each save needs room for one more checkpoint while checkpoint.keep "
                          "are kept) and run the same command to resume")
  assert os.listdir(ckdir) == ["1"]  # no half-written folder left to hold space
  assert before and _file_digests(os.path.join(ckdir, "1")) == before
  assert checkpoint_lib.Checkpointer(workdir, 2).latest_step() == 1
  monkeypatch.undo()  # space freed
  capsys.readouterr()
  train.train_and_evaluate(c, workdir)
  assert "resuming at step 1;" in capsys.readouterr().out
  assert checkpoint_lib.Checkpointer(workdir, 2).latest_step() == 2


def test_what_counts_as_a_full_disk_and_how_it_is_told():
  enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/x")
  try:  # orbax re-raising Python's error from a worker: the cause is in the chain
    try:
      raise enospc
    except OSError as e:
      raise RuntimeError("save failed") from e
  except RuntimeError as e:
    chained = e
  # Tensorstore's own error: a ValueError whose text alone carries the cause.
  tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing "train.w/0" in OCDBT database: '
                           "Failed to write 127793 bytes to file 7: No space left on device "
                           "[os_error_code='28']")
  assert [checkpoint_lib.is_disk_full(e) for e in (enospc, chained, tensorstore)] == [True] * 3
  others = (OSError(errno.EACCES, "Permission denied"), ValueError("NOT_FOUND: no such file"))
  assert [checkpoint_lib.is_disk_full(e) for e in others] == [False, False]
  # 999 bytes; 1536 / 1000 = 1.536 -> 1.5 KB; 2.6e6 -> 2.6 MB; 3.2e12 -> 3.2 TB.
  assert [checkpoint_lib._size(n) for n in (999, 1536, 2.6e6, 3.2e12)] == [  # pylint: disable=protected-access
      "999 bytes", "1.5 KB", "2.6 MB", "3.2 TB"]


def test_orbax_reports_held_during_a_save_are_dropped_or_passed_on():
  """absl ERROR records and unraisable exceptions raised while a save runs: passed on
  unchanged when the save is fine, dropped when the one-line error replaces them; afterwards
  only asyncio's "Event loop is closed" stays silenced."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  seen = []

  class Keep(logging.Handler):
    def emit(self, record):
      seen.append(record.getMessage())

  handler = Keep(logging.ERROR)
  logging.getLogger("absl").addHandler(handler)
  previous = sys.unraisablehook
  unraisable = []
  sys.unraisablehook = lambda report: unraisable.append(str(report.exc_value))
  try:
    for drop in (False, True):
      with checkpoint_lib._HeldReports() as held:  # pylint: disable=protected-access
        absl_logging.error("writer failed (%s)", drop)
        sys.unraisablehook(type("R", (), {"exc_value": RuntimeError(f"late ({drop})")})())
        assert seen == (["writer failed (False)"] if drop else [])  # held, not shown yet
        held.release(drop=drop)
    assert seen == ["writer failed (False)"]
    assert unraisable == ["late (False)"]
    for text in ("Event loop is closed", "another"):
      sys.unraisablehook(type("R", (), {"exc_value": RuntimeError(text)})())
    assert unraisable == ["late (False)", "another"]
  finally:
    sys.unraisablehook = previous
    logging.getLogger("absl").removeHandler(handler)


def test_abandoned_full_disk_writes_are_not_reported_after_the_one_line_error():
  """A failed save's other array writes end as asyncio futures whose error nobody retrieves;
  collected later (after the one-line error), asyncio would log each as "exception was never
  retrieved" with tensorstore's traceback (seen in the real-disk test below). From a dropped
  save on, such full-disk reports stay silent; any other unretrieved error is still logged."""
  import asyncio  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  import logging  # pylint: disable=g-import-not-at-top
  seen = []

  class Keep(logging.Handler):
    def emit(self, record):
      seen.append(record.exc_info[1] if record.exc_info else record.getMessage())

  full = ValueError('RESOURCE_EXHAUSTED: Error writing "train.w/0": Failed to write 98304 '
                    "bytes to file 20: No space left on device [os_error_code='28']")
  other = ValueError("NOT_FOUND: no such file")

  def abandon(loop, error):
    future = loop.create_future()
    future.set_exception(error)
    del future  # its error never retrieved: asyncio reports it when it is collected
    gc.collect()

  handler = Keep(logging.ERROR)
  asyncio_logger = logging.getLogger("asyncio")
  # As in a fresh process: no failed save yet (an earlier test's may have installed the filter).
  asyncio_logger.removeFilter(checkpoint_lib._FULL_DISK_FUTURES)  # pylint: disable=protected-access
  asyncio_logger.addHandler(handler)
  loop = asyncio.new_event_loop()
  try:
    abandon(loop, full)  # no failed save yet: reported, as asyncio always does
    assert seen == [full]
    with checkpoint_lib._HeldReports() as held:  # pylint: disable=protected-access
      abandon(loop, other)
      assert seen == [full]  # held during the save
      held.release(drop=True)
    abandon(loop, full)
    assert seen == [full]  # after the failed save: silent
    abandon(loop, other)
    assert seen == [full, other]  # not a full disk: still reported
  finally:
    loop.close()
    asyncio_logger.removeHandler(handler)


def _small_tmpfs_possible(folder) -> bool:
  """Whether this machine lets an unprivileged user mount a tmpfs in a new user + mount
  namespace (``unshare -rm``), as most Linux machines do."""
  if shutil.which("unshare") is None:
    return False
  os.makedirs(folder, exist_ok=True)
  probe = subprocess.run(["unshare", "-rm", "sh", "-c",
                          f"mount -t tmpfs -o size=1m none {shlex.quote(os.fspath(folder))}"],
                         capture_output=True, timeout=60)
  return probe.returncode == 0


def test_real_full_disk_is_one_line_and_the_last_checkpoint_survives(tmp_path):
  """The CLI on a real file system that fills up: a tmpfs in a user + mount namespace, filled
  (by dd, with the run stopped meanwhile) as soon as checkpoint 2 exists, leaving half a
  checkpoint free, so checkpoint 4 cannot be written. stderr is exactly one line naming the problem (none of orbax's or tensorstore's
  tracebacks); exit status 1; checkpoint 2 is byte for byte as it was and restores; no
  half-written folder is left."""
  small, out = tmp_path / "small", tmp_path / "out"
  if not _small_tmpfs_possible(small):
    pytest.skip("unprivileged user namespaces (unshare -rm) are not available here")
  out.mkdir()
  run = small / "run"
  # The other tests' signals and evaluation: the steps they compiled.
  overrides = {**OVERRIDES, "total_steps": 4, "checkpoint.every": 2}
  train_cmd = shlex.join([sys.executable, "-m", "grpo_jax.train",
                          "--config=configs/popo.py:smoke", f"--workdir={run}"] +
                         [f"--config.{k}={v}" for k, v in overrides.items()])
  q = lambda p: shlex.quote(os.fspath(p))
  ckpt2 = run / "checkpoints" / "2"
  script = f"""
mount -t tmpfs -o size=64m none {q(small)} || exit 99
{train_cmd} > {q(out / "stdout")} 2> {q(out / "stderr")} &
pid=$!
while [ ! -d {q(ckpt2)} ] && kill -0 $pid 2>/dev/null; do sleep 0.02; done
# The run is paused while the disk fills, so that checkpoint 4 always meets a full disk.
kill -STOP $pid 2>/dev/null
(cd {q(ckpt2)} && find . -type f -exec sha256sum {{}} +) > {q(out / "before.sha256")}
used=$(du -sk {q(ckpt2)} | cut -f1)
avail=$(df -k {q(small)} | awk 'NR == 2 {{print $4}}')
dd if=/dev/zero of={q(small / "filler")} bs=1k count=$((avail - used / 2)) 2>/dev/null
kill -CONT $pid 2>/dev/null
wait $pid
echo $? > {q(out / "rc")}
cp -a {q(run)} {q(out / "run")}
"""
  proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  stderr = (out / "stderr").read_text()
  ckdir = run / "checkpoints"
  assert (out / "rc").read_text().strip() == "1", stderr[-3000:]
  assert re.fullmatch(
      rf"grpo_jax.train: checkpoint of step 4 not written: no space left on device in "
      rf"{re.escape(os.fspath(ckdir))} \([\d.]+ (KB|MB|bytes) free\); the last good checkpoint "
      rf"\(step 2\) is intact. Free some space \(each save needs room for one more checkpoint "
      rf"while checkpoint.keep are kept\) and run the same command to resume\n", stderr), stderr
  copied = out / "run" / "checkpoints"
  assert sorted(os.listdir(copied)) == ["2"]
  before = dict(reversed(line.split("  ./", 1)) for line in
                (out / "before.sha256").read_text().splitlines())
  assert before and _file_digests(copied / "2") == before
  assert checkpoint_lib.Checkpointer(os.fspath(out / "run"), 2).latest_step() == 2
  _final_state(os.fspath(out / "run"))  # restores


def test_too_many_non_finite_steps_stop_with_the_last_good_state(tmp_path, monkeypatch):
  """Every reward NaN: the device skips each update; after max_consecutive_skips = 2 the run
  stops with a message and a checkpoint whose parameters are the initial ones."""
  real = tasks_lib.make_task

  def nan_task(config):
    task = real(config)
    task.score = lambda text, problem: float("nan")
    return task

  monkeypatch.setattr(tasks_lib, "make_task", nan_task)
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


def test_truncated_safetensors_is_named(tmp_path):
  from grpo_jax import assets  # pylint: disable=g-import-not-at-top
  from grpo_jax.models import CheckpointError, from_pretrained  # pylint: disable=g-import-not-at-top
  folder = tmp_path / "model"
  shutil.copytree(assets.EMBEDDED_MODEL, folder)
  weights = folder / "model.safetensors"
  data = weights.read_bytes()
  weights.write_bytes(data[:len(data) // 2])  # an interrupted download
  with pytest.raises(CheckpointError, match="model.safetensors.*truncated or corrupt"):
    from_pretrained(os.fspath(folder))
  weights.write_bytes(b"not safetensors at all")
  with pytest.raises(CheckpointError, match="not a readable safetensors file"):
    from_pretrained(os.fspath(folder))


def test_tokenizer_that_does_not_match_the_model_is_refused(tmp_path):
  from grpo_jax import assets  # pylint: disable=g-import-not-at-top
  from grpo_jax.models import CheckpointError  # pylint: disable=g-import-not-at-top
  from grpo_jax.models import from_pretrained, save_pretrained  # pylint: disable=g-import-not-at-top
  from grpo_jax.models.qwen3 import Qwen3  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  # A model with 64 embedding rows next to the embedded tokenizer's 1,072 tokens (its model has
  # 1,088 rows: the vocabulary is padded, which is fine the other way round).
  small = from_pretrained(assets.EMBEDDED_MODEL).config.replace(vocab_size=64)
  folder = tmp_path / "model"
  save_pretrained(Qwen3(small, rngs=nnx.Rngs(0)), os.fspath(folder))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(assets.EMBEDDED_MODEL, name), folder / name)
  c = _config()
  c.model.path = os.fspath(folder)
  with pytest.raises(CheckpointError, match="1,072 tokens but the model's embedding has 64 rows"):
    train.train_and_evaluate(c, os.fspath(tmp_path / "run"))
  assert not (tmp_path / "run" / "checkpoints").exists()  # nothing written


def test_workdir_of_another_config_is_not_resumed(tmp_path):
  from grpo_jax import configuration  # pylint: disable=g-import-not-at-top
  c = _config()
  c.total_steps = 1
  workdir = os.fspath(tmp_path)
  train.train_and_evaluate(c, workdir)
  other = _config()
  other.total_steps = 2
  # Another seed changes the trajectory (other prompts and draws) but not one compiled
  # program: the resume below reuses the steps the other tests here compile.
  other.seed = 1
  with pytest.raises(configuration.ConfigError,
                     match=r"holds a run with another config: seed \(0 -> 1\); use another"):
    train.train_and_evaluate(other, workdir)
  assert checkpoint_lib.Checkpointer(workdir, 2).latest_step() == 1  # nothing lost or written
  other.checkpoint.allow_config_change = True
  train.train_and_evaluate(other, workdir)
  assert checkpoint_lib.Checkpointer(workdir, 2).latest_step() == 2


def test_config_record_is_replaced_whole_never_truncated(tmp_path, monkeypatch):
  """In a multi-host resume the other processes read ``config.json`` while the primary rewrites
  it. While the new record is being written the file at the path must still be the old one,
  whole. (Written with ``open(path, "w")`` it was empty at that moment: process 1 of the
  two-process test failed with a JSONDecodeError on a loaded machine.)"""
  c = _config()
  workdir = os.fspath(tmp_path)
  workdir_lib.check_same_run(c, workdir)
  path = tmp_path / "config.json"
  before = path.read_text()
  seen, real_dump = [], json.dump

  def dump(obj, f, **kwargs):
    seen.append(path.read_text())
    real_dump(obj, f, **kwargs)

  monkeypatch.setattr(json, "dump", dump)
  workdir_lib.check_same_run(c, workdir)
  assert seen == [before] and json.loads(before)
  assert path.read_text() == before
  assert os.listdir(workdir) == ["config.json"]  # no temporary file left


def test_unreadable_config_record_is_one_clear_error(tmp_path):
  from grpo_jax import configuration  # pylint: disable=g-import-not-at-top
  (tmp_path / "config.json").write_text('{"total_steps": 2')  # torn
  with pytest.raises(configuration.ConfigError, match=r"config.json is not readable JSON .*"
                     r"allow_config_change=true to resume without the check"):
    workdir_lib.check_same_run(_config(), os.fspath(tmp_path))
  c = _config()
  c.checkpoint.allow_config_change = True
  workdir_lib.check_same_run(c, os.fspath(tmp_path))
  assert json.loads((tmp_path / "config.json").read_text())["total_steps"] == c.total_steps


@pytest.mark.parametrize("task,name,content,message", [
    ("countdown", "rows.jsonl", "", "no usable row (the file has no rows)"),
    ("countdown", "rows.jsonl", '{"target": 5, "nums": ["five", 2]}\n',
     "no usable row (1 malformed; first: row 1: 'nums' holds a non-integer: ['five', 2])"),
    ("countdown", "rows.jsonl", '{"nums": [1, 2]}\n',
     "no usable row (1 malformed; first: row 1: missing field 'target')"),
    ("jsonl", "qa.jsonl", '{"question": "2+2?"}\n[1]\n',
     "no usable row (2 rows: 1 not a JSON object, 1 without a question and a numeric answer)"),
])
def test_unusable_data_file_is_named_and_nothing_is_written(tmp_path, task, name, content,
                                                            message):
  from grpo_jax import configuration  # pylint: disable=g-import-not-at-top
  data = tmp_path / name
  data.write_text(content)
  c = _config()
  c.task.name, c.task.data_path = task, os.fspath(data)
  with pytest.raises(configuration.ConfigError) as e:
    train.train_and_evaluate(c, os.fspath(tmp_path / "run"))
  assert str(e.value) == f"config.task.data_path: {data}: {message}"
  assert not (tmp_path / "run").exists()


def test_a_field_added_since_the_run_started_is_no_change(tmp_path):
  """A run's config.json from before a field existed (here rollout.sampler_rows) resumes: the
  new field's default is the old behaviour. A changed value still refuses, as does a field the
  code no longer has."""
  import json  # pylint: disable=g-import-not-at-top
  from grpo_jax import configuration  # pylint: disable=g-import-not-at-top
  from grpo_jax.run import workdir as workdir_lib
  c = _config()
  workdir_lib.check_same_run(c, os.fspath(tmp_path))  # writes config.json
  path = tmp_path / "config.json"
  saved = json.loads(path.read_text())
  del saved["rollout"]["sampler_rows"]
  path.write_text(json.dumps(saved))
  workdir_lib.check_same_run(c, os.fspath(tmp_path))
  saved["rollout"]["gone_field"] = 1
  saved["seed"] = 7
  path.write_text(json.dumps(saved))
  with pytest.raises(configuration.ConfigError,
                     match=r"rollout.gone_field \(1 -> None\), seed \(7 -> 0\)"):
    workdir_lib.check_same_run(c, os.fspath(tmp_path))


def test_a_workdir_from_before_the_policy_loss_groups_resumes(tmp_path):
  """tests/data/config_json_before_policy_losses.json is the config.json that the code before
  the policy losses had their groups wrote for ``configs/dapo.py:smoke`` (rl.clip_low 0.2,
  rl.clip_high 0.28, rl.dual_clip 0, rl.aggregation token-mean; no rl.loss group; model.path
  replaced by a placeholder). The same run configured today (rl.loss.ppo.clip_high 0.28)
  resumes it; a run whose
  PPO clip differs is refused, naming the key at its new place."""
  import json  # pylint: disable=g-import-not-at-top
  from configs import dapo  # pylint: disable=g-import-not-at-top
  from grpo_jax import assets, configuration  # pylint: disable=g-import-not-at-top
  from grpo_jax.run import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  old = os.path.join(ROOT, "tests", "data", "config_json_before_policy_losses.json")
  saved = json.loads(open(old, encoding="utf-8").read())
  assert "loss" not in saved["rl"] and saved["rl"]["clip_high"] == 0.28
  saved["model"]["path"] = assets.EMBEDDED_MODEL
  (tmp_path / "config.json").write_text(json.dumps(saved))
  c = dapo.get_config("smoke")
  configuration.validate(c)
  workdir_lib.check_same_run(c, os.fspath(tmp_path))  # resumes, and rewrites config.json
  rewritten = json.loads((tmp_path / "config.json").read_text())["rl"]
  assert rewritten["loss"]["policy"] == "ppo" and rewritten["loss"]["ppo"]["clip_high"] == 0.28
  assert rewritten["loss"]["aggregation"] == "token-mean"
  saved["rl"]["clip_high"] = 0.2
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(configuration.ConfigError, match=r"rl.loss.ppo.clip_high \(0.2 -> 0.28\)"):
    workdir_lib.check_same_run(c, os.fspath(tmp_path))


def test_a_workdir_from_before_the_prox_group_resumes(tmp_path, capsys):
  """tests/data/config_json_before_prox_group.json is the config.json that the code before
  pi_prox's keys had their group wrote for ``configs/popo.py:smoke,partial`` (rl.prox_pass auto,
  replay.prox exact, replay.prox_chunks 4, rollout.correction decoupled; no prox group;
  model.path replaced by a placeholder). The same run configured today resumes it; one whose
  continued rows were corrected otherwise is refused, naming the key at its new place; an old
  key set today moves to its new place with one line."""
  import json  # pylint: disable=g-import-not-at-top
  from configs import popo  # pylint: disable=g-import-not-at-top
  from grpo_jax import assets, configuration  # pylint: disable=g-import-not-at-top
  from grpo_jax.run import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  old = os.path.join(ROOT, "tests", "data", "config_json_before_prox_group.json")
  saved = json.loads(open(old, encoding="utf-8").read())
  assert "prox" not in saved and saved["rollout"]["correction"] == "decoupled"
  saved["model"]["path"] = assets.EMBEDDED_MODEL
  (tmp_path / "config.json").write_text(json.dumps(saved))
  c = popo.get_config("smoke,partial")
  configuration.validate(c)
  workdir_lib.check_same_run(c, os.fspath(tmp_path))  # resumes, and rewrites config.json
  rewritten = json.loads((tmp_path / "config.json").read_text())
  assert rewritten["prox"] == {"rows": "auto", "estimate": "exact", "chunks": 4,
                               "continued": "decoupled"}
  assert rewritten["rollout"]["correction"] is None and rewritten["rl"]["prox_pass"] is None
  saved["rollout"]["correction"], saved["replay"]["prox_chunks"] = "naive", 2
  (tmp_path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(configuration.ConfigError, match=r"prox.chunks \(2 -> 4\), "
                     r"prox.continued \('naive' -> 'decoupled'\)"):
    workdir_lib.check_same_run(c, os.fspath(tmp_path))
  c = popo.get_config("smoke,partial")
  c.rollout.correction = "naive"  # the old key, set today
  configuration.validate(c)
  assert c.prox.continued == "naive" and configuration.step_config(c).continued is False
  assert capsys.readouterr().err == (
      "grpo_jax: config.rollout.correction is deprecated: use config.prox.continued (applied)\n")


def test_checkpoint_with_per_layer_parameters_is_one_clear_error_and_kept(tmp_path):
  """A checkpoint written before the decoder layers were stacked (``params/layers/0/...``, one
  subtree per layer) is refused in one line saying so, and is not moved aside as damaged."""
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from grpo_jax import assets
  from grpo_jax.models import CheckpointError, from_pretrained
  from grpo_jax.rl import step as step_lib
  from grpo_jax.rl.replay import init_replay
  from grpo_jax.run import workdir as workdir_lib
  params = nnx.split(from_pretrained(assets.EMBEDDED_MODEL))[1]
  num_layers = params["layers"]["mlp"]["up_proj"]["kernel"].shape[0]
  per_layer = {i: jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(num_layers)}
  tx = optax.adam(1e-3)
  replay = init_replay(0, 2, 4, 4)
  ckpt = checkpoint_lib.Checkpointer(os.fspath(tmp_path), keep=1)
  ckpt.save(1, step_lib.init_train_state(nnx.State({**params, "layers": per_layer}), tx), replay,
            {"data_position": 0})
  with pytest.raises(CheckpointError, match=(
      r"^checkpoint 1 in .* holds its parameters layer by layer \(params/layers/0, .*written "
      r"before grpo_jax stacked the decoder layers.*start the run in a new workdir$")) as e:
    workdir_lib.restore_newest_readable(ckpt, step_lib.init_train_state(params, tx), replay)
  assert "\n" not in str(e.value)
  assert ckpt.manager.all_steps() == [1] and not os.path.exists(tmp_path / "checkpoints_unreadable")
  ckpt.close()


def test_a_buffer_saved_with_one_version_per_row_resumes_with_it_on_every_token(tmp_path):
  """Buffers written before each token carried its own version store rollouts.version [C, E]:
  they restore into today's [C, E, T], each row's version on each of its tokens."""
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from grpo_jax import assets
  from grpo_jax.models import from_pretrained
  from grpo_jax.rl import step as step_lib
  from grpo_jax.rl.replay import init_replay
  params = nnx.split(from_pretrained(assets.EMBEDDED_MODEL))[1]
  tx = optax.adam(1e-3)
  state = step_lib.init_train_state(params, tx)
  replay = init_replay(3, 2, 4, 5)
  rows = jnp.asarray([[7, 8], [9, 10], [11, 12]], jnp.int32)
  old = replay.replace(rollouts=replay.rollouts.replace(version=rows))  # [C, E]
  ckpt = checkpoint_lib.Checkpointer(os.fspath(tmp_path), keep=1)
  ckpt.save(1, state, old, {"data_position": 0})
  ckpt.manager.wait_until_finished()
  _, restored, _ = ckpt.restore(1, state, replay)
  assert restored.rollouts.version.shape == (3, 2, 5)
  np.testing.assert_array_equal(restored.rollouts.version[:, :, 3], rows)
  np.testing.assert_array_equal(restored.rollouts.version[2, 1], [12] * 5)
  ckpt.close()


def test_host_arrays_are_written_beside_the_json_and_read_back_as_they_were(tmp_path):
  """NumPy arrays in the host record (partial rollouts' pool) go to the checkpoint's "arrays"
  item, each replaced in the JSON by a reference; restore gives them back with their dtype and
  shape, empty ones as lists, the rest of the record unchanged. A record without arrays has
  no such item."""
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from grpo_jax import assets
  from grpo_jax.models import from_pretrained
  from grpo_jax.rl import step as step_lib
  from grpo_jax.rl.replay import init_replay
  state = step_lib.init_train_state(nnx.split(from_pretrained(assets.EMBEDDED_MODEL))[1],
                                    optax.sgd(0.1))
  replay = init_replay(0, 2, 4, 5)
  tokens = np.arange(12, dtype=np.int32).reshape(3, 4)
  host = {"data_position": 3,
          "allocator": {"pool": {"tokens": tokens, "live": np.asarray([True, False]),
                                 "logp": np.full((2, 2), -0.5, np.float32)},
                        "rows": [[np.asarray([1, 2], np.int32), np.zeros((0,), np.int32)]]}}
  ckpt = checkpoint_lib.Checkpointer(os.fspath(tmp_path), keep=2)
  ckpt.save(1, state, replay, host)
  ckpt.save(2, state, replay, {"data_position": 4})
  assert os.path.isdir(tmp_path / "checkpoints" / "1" / "arrays")
  assert not os.path.exists(tmp_path / "checkpoints" / "2" / "arrays")
  saved = ckpt.host(1)["allocator"]
  assert saved["pool"]["tokens"] == {"__array__": "a0"} and saved["rows"][0][1] == []
  _, _, back = ckpt.restore(1, state, replay)
  pool = back["allocator"]["pool"]
  np.testing.assert_array_equal(pool["tokens"], tokens)
  assert pool["tokens"].dtype == np.int32 and pool["live"].dtype == bool
  assert pool["logp"].dtype == np.float32 and pool["logp"][1, 1] == -0.5
  np.testing.assert_array_equal(back["allocator"]["rows"][0][0], [1, 2])
  assert back["allocator"]["rows"][0][1] == [] and back["data_position"] == 3
  assert ckpt.restore(2, state, replay)[2] == {"data_position": 4}
  ckpt.close()
