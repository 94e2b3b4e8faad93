"""The train loop end to end: the real CLI on :smoke, exact resume, config validation."""

import functools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import types

import hypothesis
import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import strategies as st

from configs import dapo, drgrpo, grpo, headroom, popo, rloo, rollout_replay, sara
from grpo_jax import assets, configuration, train
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.models import from_pretrained
from grpo_jax import report as report_cli
from grpo_jax import timing
from grpo_jax.run import checkpoint as checkpoint_lib
from grpo_jax.run import metrics, report_writer
from tests.cli_output import THIRD_PARTY_LOG
from tests.run_once import once_per_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def smoke_run():
  """The main command (POPO) on its smoke preset, in a subprocess, as a user runs it (once per
  test run, ``run_once.once_per_run``): (its workdir, its stdout and stderr)."""

  def make(folder):
    workdir = folder / "workdir"
    cmd = [sys.executable, "-m", "grpo_jax.train", "--config=configs/popo.py:smoke",
           f"--workdir={workdir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"workdir": os.fspath(workdir), "stdout": proc.stdout, "stderr": proc.stderr}

  run = once_per_run("smoke_run", make)
  return pathlib.Path(run["workdir"]), types.SimpleNamespace(stdout=run["stdout"],
                                                             stderr=run["stderr"])


def test_cli_smoke_terminal_metrics_and_checkpoints(smoke_run):
  workdir, proc = smoke_run
  out = proc.stdout + proc.stderr
  assert not THIRD_PARTY_LOG.search(out), THIRD_PARTY_LOG.search(out).group(0)
  # Piped, not a terminal: no progress bar, whose carriage returns would share lines with the
  # evaluation lines; the plots are drawn (matplotlib is a dependency).
  assert "\r" not in proc.stdout and "it/s" not in out
  assert "pip install matplotlib" not in proc.stdout
  # One formatted line per evaluation (steps 0 and 2 on :smoke), then the summary.
  evals = re.findall(r"^step (\d+)  mean@2 [\d.]+  pass@2 [\d.]+  greedy [\d.]+  len [\d.]+  "
                     r"constant [\d.]+  rollouts [\d,]+$", proc.stdout, re.M)
  assert evals == ["0", "2"]
  assert "grpo_jax: run complete at step 2/2" in proc.stdout
  assert re.search(r"^  time \d+ s: prompts \d+ s, generation \d+ s, scoring \d+ s, "
                   r"assembly \d+ s, update \d+ s, metrics \d+ s, evaluation \d+ s, "
                   r"checkpoint \d+ s, other \d+ s$", proc.stdout, re.M)
  assert f"checkpoints  {workdir}" in proc.stdout
  records = metrics.read_metrics(os.fspath(workdir))
  steps = [r for r in records if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2]
  # smoke: 2 prompts x 2 rollouts per step -> 4 rollouts per step.
  assert [r["rollouts"] for r in steps] == [4, 8]
  assert any("eval/mean_at_2" in r for r in records)
  assert checkpoint_lib.Checkpointer(os.fspath(workdir), 2).latest_step() == 2
  # Started again, the finished run says so and prints the same summary; from another
  # directory, the config file by its full path (it imports the schema from the package).
  again = subprocess.run([sys.executable, "-m", "grpo_jax.train",
                          f"--config={ROOT}/configs/popo.py:smoke", f"--workdir={workdir}"],
                         cwd=workdir.parent, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0
  assert f"grpo_jax: {workdir} is complete (2/2 steps); nothing to do." in again.stdout
  summary = lambda text: text[text.index("grpo_jax: run complete"):].splitlines()[:4]
  assert summary(again.stdout) == summary(proc.stdout)


def test_step_records_split_the_step_time_into_phases(smoke_run):
  """Each step record has the seconds of every phase (timing.PHASES): non-negative, adding up
  to at most the step's wall time; the cumulative ``time_<phase>_s`` are their running sums."""
  workdir, _ = smoke_run
  steps = [r for r in metrics.read_metrics(os.fspath(workdir)) if "loss" in r]
  assert len(steps) == 2
  for r in steps:
    phases = [r[f"time/{name}_s"] for name in timing.PHASES]
    assert all(v >= 0 for v in phases), r
    assert 0 < sum(phases) <= r["time/step_s"] * (1 + 1e-9) + 1e-9
    # The device work was waited for in the phases that ran it.
    assert r["time/generation_s"] > 0 and r["time/update_s"] > 0
    assert r["time/checkpoint_s"] > 0  # smoke: checkpoint.every = 1
  # Step 2 was evaluated (the last step): the evaluation is in its window, not step 1's.
  assert steps[0]["time/evaluation_s"] == 0 < steps[1]["time/evaluation_s"]
  for name in timing.PHASES:
    total = steps[0][f"time/{name}_s"] + steps[1][f"time/{name}_s"]
    first_eval = steps[0][f"time_{name}_s"] - steps[0][f"time/{name}_s"]  # step 0's evaluation
    assert steps[1][f"time_{name}_s"] == pytest.approx(first_eval + total, abs=1e-9)
  # The loop's wall time bounds the steps' windows (the first evaluation is in neither).
  assert sum(r["time/step_s"] for r in steps) <= steps[1]["wall_s"] + steps[1][
      "time/evaluation_s"] + steps[1]["time/checkpoint_s"] + 1.0


def test_phase_timer_accumulates_until_taken():
  timer = timing.PhaseTimer()
  for _ in range(2):
    with timer.phase("scoring"):
      pass
  with pytest.raises(KeyError):
    with timer.phase("update"):
      raise KeyError("the phase is timed even when it raises")
  seconds = timer.take()
  assert set(seconds) == {"scoring", "update"} and all(v >= 0 for v in seconds.values())
  assert timer.take() == {}


def test_report_of_the_smoke_run(smoke_run, tmp_path):
  workdir, _ = smoke_run
  assert report_cli.main([os.fspath(workdir), f"--out={tmp_path}"]) == 0
  for name in ("accuracy.png", "training.png"):
    data = (tmp_path / name).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    import matplotlib.image  # pylint: disable=g-import-not-at-top
    assert matplotlib.image.imread(tmp_path / name).ndim == 3  # decodes as an image
  table = (tmp_path / "summary.md").read_text()
  s = report_writer.run_summary(os.fspath(workdir), k=2)
  assert f"| {s['steps']} | {s['start']:.3f} → {s['end']:.3f} |" in report_writer.summary_table(
      [os.fspath(workdir)], k=2)
  assert "| 8 |" in report_writer.summary_table([os.fspath(workdir)], k=2)  # 8 rollouts
  assert "rollouts" in table
  # The run itself wrote its report at the end.
  assert (workdir / "report" / "summary.md").exists()


def test_tensorboard_events_without_tensorflow(smoke_run):
  """The event file holds the scalars of the JSONL records (read with tensorboardX's protos)."""
  import struct  # pylint: disable=g-import-not-at-top
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  workdir, _ = smoke_run
  files = list((workdir / "tensorboard").glob("events.out.tfevents.*"))
  assert files
  tags = set()
  for f in files:
    data = f.read_bytes()
    pos = 0
    while pos < len(data):  # TFRecord: length u64, crc u32, payload, crc u32
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      tags.update(v.tag for v in event.summary.value)
      pos += 12 + length + 4
  assert {"loss", "eval/mean_at_2", "learning_rate"} <= tags


def _final_state(workdir):
  ck = checkpoint_lib.Checkpointer(workdir, 2)
  return ck.manager.restore(ck.latest_step()).state


def _stopped_at_step_2(straight: str, resumed: str) -> None:
  """``resumed``: the 4-step run ``straight`` as it was after step 2, as if killed then (its
  step-2 checkpoint, config record and step-0 to step-2 metrics), without running those steps
  a second time. A run's own final save is the SIGTERM test's (test_reliability.py)."""
  shutil.copytree(straight, resumed)
  shutil.rmtree(os.path.join(resumed, "checkpoints", "4"))
  assert os.listdir(os.path.join(resumed, "checkpoints")) == ["2"]  # so the run resumes at 2
  path = os.path.join(resumed, "metrics.jsonl")
  with open(path, encoding="utf-8") as f:
    kept = [line for line in f if line.strip() and json.loads(line)["step"] <= 2]
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(kept)


@pytest.mark.parametrize("module,presets", [(popo, "smoke"), (rollout_replay, "smoke"),
                                            (headroom, "smoke"), (popo, "smoke,lora=4")])
def test_resume_gives_exactly_the_uninterrupted_run(tmp_path, module, presets):
  """N steps + resume + N steps == 2N steps: parameters, optimiser state, the replay buffer.

  Under LoRA (``lora=4``) the checkpoints hold the adapters alone, on the base reloaded from
  the model folder at the restart.

  The replay methods only: their steps are GRPO's plus the buffer, and the GRPO loop runs end
  to end in the CLI smoke test, so a GRPO copy of these three runs would add time and no
  coverage. Advantages and effectiveness on the score (0 / 0.1 / 1), so that the tiny smoke
  batches do have mixed groups to store; rollout replay starts replaying at step 1.
  """

  def config(total):
    c = module.get_config(presets)
    c.rl.reward_signal = c.rl.effective_signal = "score"
    c.replay.prioritized.warmup_steps = 1
    c.replay.headroom.tau = 1e3  # Headroom-Drift: admit whatever the tiny batches' updates move
    c.total_steps = total
    c.eval.every = 100  # evaluations never change the trajectory; keep them out of the way
    c.eval.greedy = False  # (one sampler fewer to compile; the k=2 one is the rollouts')
    c.checkpoint.every = 2
    return c

  straight, resumed = os.fspath(tmp_path / "straight"), os.fspath(tmp_path / "resumed")
  train.train_and_evaluate(config(4), straight)
  _stopped_at_step_2(straight, resumed)          # "killed" after 2 steps...
  train.train_and_evaluate(config(4), resumed)   # ...and started again with the same command
  assert [r["step"] for r in metrics.read_metrics(resumed) if "loss" in r] == [1, 2, 3, 4]
  a, b = _final_state(straight), _final_state(resumed)
  assert "replay" in a
  assert int(np.asarray(a["replay"]["num_inserted"])) > 0  # the buffer really was used...
  replayed = [r["replay_rows"] for r in metrics.read_metrics(straight) if "loss" in r]
  assert sum(replayed) > 0  # ...and replayed from
  params = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      a["train"]["params"])[0]}
  assert all("lora" in k for k in params) == ("lora" in presets)
  leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(leaves_a) == len(leaves_b) > 0
  for x, y in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # The data position and counters were restored too: the same rollouts were generated.
  ra = [r["rollouts"] for r in metrics.read_metrics(straight) if "loss" in r]
  rb = [r["rollouts"] for r in metrics.read_metrics(resumed) if "loss" in r]
  assert ra == rb == [4, 8, 12, 16]


@pytest.mark.parametrize("module,presets", [(sara, "smoke,dps"), (grpo, "smoke,mopps"),
                                            (dapo, "smoke")])
def test_resume_of_an_allocator_makes_the_same_decisions(tmp_path, module, presets):
  """SARA + DPS, MoPPS and DAPO's dynamic sampling: their state (posteriors, counts, the
  stream position, their random generators) is in the checkpoint, so a resumed run draws the
  same prompts, spends the same rollouts and ends with the same parameters."""

  def config(total):
    c = module.get_config(presets)
    c.rl.reward_signal = c.rl.effective_signal = "score"  # mixed groups in tiny batches
    c.task.train_size = 16  # prompts come back within 4 steps, so the posteriors matter
    c.total_steps = total
    c.eval.every = 100
    c.eval.greedy = False  # (one sampler fewer to compile, as above)
    c.checkpoint.every = 2
    return c

  straight, resumed = os.fspath(tmp_path / "straight"), os.fspath(tmp_path / "resumed")
  train.train_and_evaluate(config(4), straight)
  _stopped_at_step_2(straight, resumed)
  train.train_and_evaluate(config(4), resumed)
  assert [r["step"] for r in metrics.read_metrics(resumed) if "loss" in r] == [1, 2, 3, 4]
  for x, y in zip(jax.tree.leaves(_final_state(straight)), jax.tree.leaves(_final_state(resumed))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  keys = ("rollouts", "alloc/rollouts_generated", "alloc/prompts_touched", "alloc/rounds")
  ra = [[r[k] for k in keys] for r in metrics.read_metrics(straight) if "loss" in r]
  rb = [[r[k] for k in keys] for r in metrics.read_metrics(resumed) if "loss" in r]
  assert ra == rb and len(ra) == 4
  host = [checkpoint_lib.Checkpointer(w, 2).host(4)["allocator"] for w in (straight, resumed)]
  assert host[0] == host[1]


def test_rollout_budget_ends_the_run_and_a_rerun_says_it_is_complete(tmp_path, capsys):
  c = sara.get_config("smoke")
  # The allocator resume test's signals and evaluation, so that its compiled steps serve here.
  c.rl.reward_signal = c.rl.effective_signal = "score"
  c.eval.greedy = False
  c.total_steps, c.total_rollouts = 50, 6
  c.eval.every_rollouts = 4
  # The sampler in blocks of one group (2 of the round's 4 rows at a time): SARA's rounds mix
  # prompts with other counts than G, and blocks must still sample them all.
  c.rollout.sampler_rows = 2
  workdir = os.fspath(tmp_path / "budget")
  train.train_and_evaluate(c, workdir)
  steps = [r for r in metrics.read_metrics(workdir) if "loss" in r]
  evals = [r for r in metrics.read_metrics(workdir) if "eval/mean_at_2" in r]
  # Stops at the first step whose cumulative rollouts reach 6, well before 50 steps; evaluates
  # at 0, whenever a multiple of 4 rollouts is crossed, and at the end.
  assert steps[-1]["rollouts"] >= 6 and all(r["rollouts"] < 6 for r in steps[:-1])
  assert len(steps) < 50
  crossings = {r["rollouts"] // 4 for r in steps}
  assert len(evals) >= len(crossings)
  capsys.readouterr()
  train.train_and_evaluate(c, workdir)
  assert "is complete" in capsys.readouterr().out


@pytest.mark.parametrize("module", [grpo, drgrpo, rloo, dapo, popo, rollout_replay, headroom,
                                    sara])
def test_every_config_validates(module):
  configuration.validate(module.get_config())
  configuration.validate(module.get_config("smoke"))
  c = module.get_config("smoke,lora")  # every config takes the LoRA preset
  configuration.validate(c)
  assert c.model.lora.rank == 32
  for loss in ("gspo", "cispo"):  # and the policy-loss presets
    c = module.get_config(f"smoke,{loss}")
    configuration.validate(c)
    assert type(configuration.loss_config(c).policy).__name__.lower() == loss


@pytest.mark.parametrize("module,presets", [(popo, "smoke,gspo"), (grpo, "smoke,cispo")])
def test_gspo_and_cispo_train_from_their_presets(tmp_path, module, presets):
  """Two smoke steps each, GSPO with POPO's replayed rows (its sequence ratio beside the
  behaviour weight of the decoupled objective): finite losses, the presets' losses in the
  resolved config, their clip ranges from their own groups."""
  c = module.get_config(presets)
  c.rl.reward_signal = c.rl.effective_signal = "score"  # mixed groups in tiny batches
  c.total_steps, c.checkpoint.every, c.eval.every = 2, 2, 100
  workdir = os.fspath(tmp_path / "run")
  train.train_and_evaluate(c, workdir)
  steps = [r for r in metrics.read_metrics(workdir) if "loss" in r]
  assert len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
  saved = json.loads((tmp_path / "run" / "config.json").read_text())["rl"]
  loss = presets.split(",")[1]
  assert saved["loss"]["policy"] == loss and saved["loss"][loss] == dict(c.rl.loss[loss])


@pytest.mark.parametrize("module,preset", [
    (popo, p) for p in ("kl", "filter", "ineff", "stale=10", "pi_old", "align_mu", "kl,smoke")] +
    [(popo, "keep_unfilled")] +
    [(headroom, p) for p in ("headroom_only", "drift_only", "decoupled")] +
    [(rollout_replay, p) for p in ("decoupled", "paper", "paper,smoke")] +
    [(m, p) for m in (grpo, popo, sara, dapo) for p in ("mopps", "dps", "dps,pool=64")])
def test_method_presets_validate(module, preset):
  configuration.validate(module.get_config(preset))


def _refused(c, field, value, message):
  *groups, name = field.split(".")
  functools.reduce(lambda parent, key: parent[key], groups, c)[name] = value
  with pytest.raises(configuration.ConfigError, match=message):
    configuration.validate(c)


@pytest.mark.parametrize("field,value,message", [
    ("rollout.group_size", 1, "rollout.group_size"),
    ("rl.num_minibatches", 3, "rl.num_minibatches"),
    ("rl.estimator", "ppo", "rl.estimator"),
    ("model.path", "/nonexistent/model", "model.path"),
    ("rl.aggregation", "sum", "aggregation"),
    ("opt.schedule", "linear", "opt.schedule"),
    ("rollout.top_k", 20, "rollout.top_k: 20: RL rollouts must sample the full distribution"),
    ("rollout.top_p", 0.95, "rollout.top_p"),
    ("rollout.sampler_rows", 12, "rollout.sampler_rows: 12 must be 0 .* a multiple of "
     "rollout.group_size \\(8\\) that divides the 256 rows"),
    ("rollout.sampler_rows", 512, "rollout.sampler_rows"),
    ("rollout.sampler_rows", -8, "rollout.sampler_rows"),
    ("rl.effective_signal", "reward", "rl.effective_signal"),
    ("prox.rows", "fresh", "prox.rows: 'fresh'; known: auto, replayed, all"),
    ("prox.continued", "none", "prox.continued: 'none'; known: decoupled, naive"),
    ("rl.logprob_chunk", -1, "rl.logprob_chunk"),
    ("replay.objective", "on_policy", "objective"),
    ("allocation.method", "oversample", "allocation.method"),
    ("allocation.selector", "random", "allocation.selector"),
    ("allocation.sara.tau_lo", 0.95, "tau_lo"),
    ("allocation.selector", "mopps", "task.train_size.*needs prompts that come back"),
    ("allocation.dynamic_sampling.oversample", 0, "allocation.dynamic_sampling: oversample"),
    ("rl.score_base", "format", "rl.score_base"),
])
def test_invalid_values_name_the_field(field, value, message):
  _refused(grpo.get_config(), field, value, message)


@pytest.mark.parametrize("module,field,value,message", [
    (popo, "replay.popo.unfilled", "zero", "config.replay.popo: unfilled"),
    (rollout_replay, "replay.prioritized.age_unit", "epochs",
     "config.replay.prioritized: age_unit"),
    (dapo, "allocation.dynamic_sampling.oversample", 31, "allocation.dynamic_sampling.oversample"),
])
def test_invalid_method_values_name_the_field(module, field, value, message):
  _refused(module.get_config(), field, value, message)


def test_rollout_replay_ages_in_updates_are_refused_below_one_step():
  """tau_max = 3 gradient steps with 4 updates per train step could never replay anything."""
  c = rollout_replay.get_config("paper")
  c.replay.prioritized.tau_max, c.rl.num_minibatches = 3, 4
  with pytest.raises(configuration.ConfigError, match="less than one train step"):
    configuration.validate(c)


def test_real_model_preset_needs_a_path():
  c = grpo.get_config("qwen3_1p7b")
  with pytest.raises(configuration.ConfigError, match="model.path.*--config.model.path"):
    configuration.validate(c)
  with pytest.raises(ValueError, match="unknown config preset 'qwen9'"):
    grpo.get_config("qwen9")
  # An unknown preset lists every preset the chosen file accepts, its own included.
  with pytest.raises(ValueError, match=r"known: age=A, align_mu, bf16, cispo, countdown_hard, "
                                       r"decoupled_all, dps, filter, gsm8k, gspo, "
                                       r"ineff, keep_unfilled, kl, mopps, naive, pi_old, .*reuse=K, "
                                       r"smoke, stale=S, "
                                       r"pool=N, minibatches=M"):
    popo.get_config("nope")
  assert grpo.get_config("minibatches=1,smoke").rl.num_minibatches == 2  # smoke comes after
  assert grpo.get_config("smoke,minibatches=1").rl.num_minibatches == 1
  with pytest.raises(ValueError, match="decoupled, decoupled_all, dps, drift_only, gsm8k, gspo, "
                                       "headroom_only"):
    headroom.get_config("nope")


def _cli_error_line(override, workdir, config="configs/grpo.py"):
  """The CLI with one bad --config override: exit 1, no traceback; returns stderr's last line."""
  cmd = [sys.executable, "-m", "grpo_jax.train", f"--config={config}", override,
         f"--workdir={workdir}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert "Traceback" not in proc.stderr
  return proc.stderr.strip().splitlines()[-1]


def test_cli_bad_value_is_one_readable_line(tmp_path):
  assert _cli_error_line("--config.rollout.group_size=1", tmp_path) == (
      "grpo_jax.train: config.rollout.group_size: 1: group-relative advantages need >= 2 "
      "rollouts per prompt")


def test_k1_is_rejected_as_a_loss_term():
  c = grpo.get_config()
  c.rl.loss.kl_estimator = "k1"
  configuration.validate(c)  # no KL term: k1 is only a diagnostic, fine
  c.rl.loss.kl_coef = 0.04
  with pytest.raises(configuration.ConfigError, match="k1.*zero expected gradient"):
    configuration.validate(c)


def test_prox_pass_auto_follows_the_matmul_dtype():
  c = grpo.get_config()
  assert configuration.prox_pass(c) == "replayed"
  c.model.dtype = "bfloat16"
  assert configuration.prox_pass(c) == "all"
  c.prox.rows = "replayed"
  assert configuration.prox_pass(c) == "replayed"


def test_cli_unknown_config_field_is_one_readable_line(tmp_path):
  assert _cli_error_line("--config.rl.fooo=1", tmp_path) == (
      "grpo_jax.train: unknown config field 'config.rl.fooo'; the fields and their meaning are "
      "in grpo_jax/schema/defaults.py")
  assert not os.listdir(tmp_path)  # nothing written
  # A key retired after its release names its new place (for every replay method).
  assert _cli_error_line("--config.replay.slots=3", tmp_path) == (
      "grpo_jax.train: config.replay.slots: moved to config.replay.<method>.slots, its old name "
      "retired (docs/CHANGELOG.md): set the new key")


def test_cli_bad_preset_is_one_readable_line(tmp_path):
  # ml_collections wraps the config file's ValueError, traceback and all, in its flag error
  line = _cli_error_line("--config.seed=1", tmp_path, config="configs/popo.py:reuse=x")
  assert line.startswith("grpo_jax.train: flag --config=configs/popo.py:reuse=x: Error whilst "
                         "parsing config file: ValueError: unknown config preset 'reuse=x'; "
                         "known: age=A, align_mu,")
  assert not os.listdir(tmp_path)  # nothing written


def test_cli_value_of_the_wrong_type_is_one_readable_line(tmp_path):
  assert _cli_error_line("--config.rollout.group_size=abc", tmp_path) == (
      "grpo_jax.train: flag --config.rollout.group_size=abc: invalid literal for int() with "
      "base 10: 'abc'")
  assert not os.listdir(tmp_path)  # nothing written


@pytest.mark.parametrize("first,advised", [("transformers", True), ("grpo_jax.train", False)])
def test_no_advice_to_install_pytorch(first, advised):
  """Without torch, transformers' import says "PyTorch was not found. Models won't be
  available...": the package never needs torch (its models are JAX), so importing it first
  silences that one line. transformers imported first still says it (the check's control)."""
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "without_torch.py"), first],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert ("PyTorch was not found" in proc.stdout + proc.stderr) == advised


@pytest.mark.parametrize("cache", ["reprefill", "keep"])
def test_partial_rollouts_span_versions_and_resume(tmp_path, cache):
  """``rollout.partial``: 4 groups in flight for a step of 2, at most 3 decode steps a step,
  so that rows of 8 tokens span up to 3 versions (3 x (2 + 1) = 9 >= 7 decode steps). The pool
  (tokens, log-probs, versions, keys, prompts) is in the checkpoint: with ``reprefill`` the
  rebuilt cache is the one the run had, and the resumed run is exact; with ``keep`` the
  continued rows attend to keys and values of the resumed parameters instead of older ones
  (documented), so the resume is checked to run and count, not to be equal."""

  def config(total):
    c = grpo.get_config("smoke")
    c.rl.reward_signal = c.rl.effective_signal = "score"
    c.prox.rows = "all"  # the decoupled objective over every row
    c.rollout.update(partial=True, slots=8, decode_budget=3, max_staleness=2, chunk=1,
                     partial_cache=cache)
    c.total_steps = total
    c.eval.every = 100
    c.eval.greedy = False
    c.checkpoint.every = 2
    return c

  straight, resumed = os.fspath(tmp_path / "straight"), os.fspath(tmp_path / "resumed")
  train.train_and_evaluate(config(4), straight)
  steps = [r for r in metrics.read_metrics(straight) if "loss" in r]
  assert max(r["rollout/staleness_max"] for r in steps) >= 1  # trained tokens spanned versions
  assert steps[-1]["alloc/rows_in_flight"] > 0  # reported, not lost
  # A rollout counts once, when handed out or discarded: never more than were admitted.
  assert all(r["alloc/rollouts_in_update"] <= 4 for r in steps)
  _stopped_at_step_2(straight, resumed)
  train.train_and_evaluate(config(4), resumed)
  again = [r for r in metrics.read_metrics(resumed) if "loss" in r]
  assert [r["step"] for r in again] == [1, 2, 3, 4]
  if cache == "keep":
    return
  for x, y in zip(jax.tree.leaves(_final_state(straight)), jax.tree.leaves(_final_state(resumed))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  keys = ("rollouts", "completion_tokens", "alloc/groups_discarded", "rollout/staleness_max")
  assert [[r[k] for k in keys] for r in steps] == [[r[k] for k in keys] for r in again]


@pytest.mark.parametrize("changes,message", [
    (dict(slots=12), "rollout.slots: 12 must be 0 .* or a multiple of rollout.group_size \\(8\\)"),
    (dict(max_staleness=-1), "rollout.max_staleness: -1 must be an integer >= 0"),
    (dict(chunk=-2), "rollout.chunk: -2 must be an integer >= 0"),
    (dict(decode_budget=-1), "rollout.decode_budget: -1 must be an integer >= 0"),
    (dict(partial_cache="fresh"), "rollout.partial_cache: 'fresh'; known: keep, reprefill"),
    # T = 16 needs 15 decode steps after the prefill's token: 4 x (2 + 1) = 12 cannot.
    (dict(decode_budget=4, max_staleness=2), "rollout.decode_budget: 4 decode steps per step x "
     "\\(rollout.max_staleness 2 \\+ 1\\) can never finish a row of rollout.completion_len=16"),
    (dict(sampler_rows=16), "rollout.sampler_rows: 16: partial rollouts hold rollout.slots"),
])
def test_partial_rollout_knobs_are_refused_in_one_line(changes, message):
  c = grpo.get_config("partial=2")
  c.rollout.update(**changes)
  with pytest.raises(configuration.ConfigError, match=message) as e:
    configuration.validate(c)
  assert "\n" not in str(e.value)
  c = grpo.get_config("partial=2")
  c.rollout.update(decode_budget=4, max_staleness=3)  # 4 x 4 = 16 >= 15: accepted
  configuration.validate(c)


@functools.lru_cache(maxsize=1)
def _embedded_split():
  return nnx.split(from_pretrained(assets.EMBEDDED_MODEL))


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(slots=st.sampled_from([0, 2, 3, 4, 6, 8]), staleness=st.integers(0, 5),
                  chunk=st.integers(0, 20), budget=st.integers(0, 20),
                  cache=st.sampled_from(["keep", "reprefill"]),
                  correction=st.sampled_from(["decoupled", "naive"]),
                  method=st.sampled_from(["uniform", "dynamic_sampling", "sara"]),
                  prox=st.sampled_from(["exact", "interpolate"]),
                  prox_pass=st.sampled_from(["replayed", "all"]))
def test_partial_settings_the_validator_accepts_build_their_pool(
    slots, staleness, chunk, budget, cache, correction, method, prox, prox_pass):
  """What ``configuration.validate`` accepts of the partial-rollout knobs (with the rule, the
  correction and pi_prox's source) builds its step config and its producer: no refusal is left
  for the run to find."""
  from grpo_jax.generate import producer as producer_lib  # pylint: disable=g-import-not-at-top
  from grpo_jax.run import build  # pylint: disable=g-import-not-at-top
  c = grpo.get_config("smoke,partial")  # G = 2, T = 16
  c.rollout.update(slots=slots, max_staleness=staleness, chunk=chunk, decode_budget=budget,
                   partial_cache=cache)
  c.allocation.method = method
  c.prox.update(estimate=prox, rows=prox_pass, continued=correction)
  try:
    configuration.validate(c)
  except configuration.ConfigError as e:
    assert "\n" not in str(e)
    return
  step = configuration.step_config(c)
  assert step.continued == (correction == "decoupled")
  graphdef, params = _embedded_split()
  sampling = sampler_lib.SamplingConfig(max_new_tokens=c.rollout.completion_len, eos_ids=(5,),
                                        pad_id=0)
  producer = build.producer_factory(c, graphdef, params, sampling)(prompts=lambda: None)
  assert isinstance(producer, producer_lib.Producer)
  assert producer.slots == (slots or c.rollout.batch_prompts * c.rollout.group_size)


@pytest.mark.parametrize("module", [dapo, sara])
def test_dapo_and_sara_decide_on_the_pool_and_resume_exactly(tmp_path, module):
  """DAPO's filter and SARA's probe / commit / abandon as rules on the slot pool: groups they
  drop are counted as generated and never trained, their decisions persist across steps, and a
  run resumed from step 2 (``partial_cache=reprefill``) ends as the straight one, bit for bit,
  SARA's committed groups in the checkpoint."""

  def config(total):
    c = module.get_config("smoke,partial=2,slots=16,decode_budget=4")
    c.rollout.update(chunk=1, partial_cache="reprefill")
    c.total_steps, c.checkpoint.every, c.eval.every, c.eval.greedy = total, 2, 100, False
    return c

  straight, resumed = os.fspath(tmp_path / "straight"), os.fspath(tmp_path / "resumed")
  train.train_and_evaluate(config(4), straight)
  steps = [r for r in metrics.read_metrics(straight) if "loss" in r]
  assert len(steps) == 4 and all(np.isfinite(r["loss"]) for r in steps)
  assert sum(r["alloc/groups_dropped"] for r in steps) > 0  # the rule dropped groups
  # A dropped or discarded rollout is generated, never trained.
  assert all(r["rollouts"] >= r["alloc/rollouts_in_update"] for r in steps)
  assert sum(r["rollouts"] for r in steps) > sum(r["alloc/rollouts_in_update"] for r in steps)
  if module is sara:
    assert sum(r["alloc/committed"] for r in steps) > 0
    assert sum(r["alloc/abandoned"] for r in steps) > 0
  _stopped_at_step_2(straight, resumed)
  train.train_and_evaluate(config(4), resumed)
  again = [r for r in metrics.read_metrics(resumed) if "loss" in r]
  for x, y in zip(jax.tree.leaves(_final_state(straight)), jax.tree.leaves(_final_state(resumed))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  keys = ("rollouts", "completion_tokens", "alloc/groups_dropped", "alloc/groups_discarded")
  if module is sara:  # a group committed before the save is not committed again after it
    keys += ("alloc/committed", "alloc/abandoned")
  assert [[r[k] for k in keys] for r in steps] == [[r[k] for k in keys] for r in again]


@pytest.mark.parametrize("module,presets", [(popo, "smoke,lora=4"),
                                            (rollout_replay, "smoke,bf16,gspo"),
                                            (headroom, "smoke,mopps,cispo")])
def test_partial_rollouts_compose_with_replay_lora_bf16_losses_and_selectors(tmp_path, module,
                                                                           presets):
  """Four steps each of partial rollouts (rows spanning versions: 8 in flight for a step of 4,
  4 decode steps a step, so no 8-token row ends in the step that admitted it) under each replay method, with LoRA, bfloat16 matmuls (pi_prox pass
  over every row), GSPO / CISPO and the MoPPS selector: finite losses, the buffer filled from
  rows that carry their tokens' versions."""
  c = module.get_config(presets + ",partial=2,slots=8,decode_budget=4")
  c.rl.reward_signal = c.rl.effective_signal = "score"
  c.replay.headroom.tau = 1e3
  c.rollout.chunk = 1
  c.total_steps, c.checkpoint.every, c.eval.every, c.eval.greedy = 4, 4, 100, False
  workdir = os.fspath(tmp_path / "run")
  train.train_and_evaluate(c, workdir)
  steps = [r for r in metrics.read_metrics(workdir) if "loss" in r]
  assert len(steps) == 4 and all(np.isfinite(r["loss"]) for r in steps)
  assert sum(r["alloc/rollouts_in_update"] for r in steps) > 0
  replay = _final_state(workdir)["replay"]
  assert int(np.asarray(replay["num_inserted"])) > 0
  assert np.asarray(replay["rollouts"]["version"]).ndim == 3  # [C, E, T]: per token
