"""The accelerator check (grpo_jax/bench/accelerator.py) runs end to end at toy shapes here: the
script a device session starts with must not fail for the first time on the device, and what it
promises a lease with a hard limit (results on disk after every point, every point bounded,
the whole command inside its budget, one line when the backend is wrong) is checked here."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from grpo_jax.bench import accelerator, accelerator_points, hbm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
CHECK = [sys.executable, "-m", "grpo_jax.bench.accelerator", "--notests"]


def _statuses(result):
  return {pt["id"]: pt["status"] for pt in result["points"]}


@pytest.mark.slow
def test_accelerator_check_writes_every_point_as_it_ends_and_bounds_each(tmp_path):
  # One point hangs (killed at its 3 s cap); the others run, before and after it. POPO (the
  # larger part) is left out by --only: its configuration is checked without compiling below.
  out = tmp_path / "out"
  proc = subprocess.Popen(
      CHECK + ["--tiny", "--simulate_hang=decode_n8_t16", f"--out_dir={out}",
               f"--cache_dir={tmp_path / 'cache'}",
               "--only=parity,train_grpo_auto_n8_t16,decode_n8_t16,decode_n4_t16"],
      cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  snapshots = []
  while proc.poll() is None:  # the JSON as a kill at this moment would leave it
    if (out / "accelerator.json").exists():
      snapshots.append(json.loads((out / "accelerator.json").read_text()))
    time.sleep(0.1)
  stdout, stderr = proc.communicate(timeout=60)
  assert proc.returncode == 0, stderr[-3000:]
  # While the hung point ran, everything before it was already on disk, and the table too.
  during = [s for s in snapshots if _statuses(s)["decode_n8_t16"] == "running"]
  assert during and all(s["status"] == "running" for s in during)
  assert [_statuses(during[-1])[k] for k in ("env", "parity", "train_grpo_auto_n8_t16")] == [
      "ok", "ok", "ok"]
  result = json.loads((out / "accelerator.json").read_text())
  assert result["status"] == "done"
  assert _statuses(result) == {"env": "ok", "parity": "ok", "train_grpo_auto_n8_t16": "ok",
                               "decode_n8_t16": "timeout", "decode_n4_t16": "ok",
                               "rollouts_n8_t64": "not selected",
                               "train_popo_auto_n8_t16": "not selected"}
  points = {pt["id"]: pt for pt in result["points"]}
  hung = points["decode_n8_t16"]
  assert hung["limit"] == "cap" and hung["seconds"] < 20
  # One line per point, in order, as each ended.
  ids = [line.split("] ")[1].split(":")[0] for line in stdout.splitlines()
         if line.startswith("[")]
  assert ids == ["env", "parity", "train_grpo_auto_n8_t16", "decode_n8_t16", "decode_n4_t16"]
  assert re.search(r"decode_n8_t16: timed out after \d+ s \(its cap\)", stdout)
  # The real bf16 configuration: its step runs the extra prox pass.
  train = points["train_grpo_auto_n8_t16"]["result"]
  assert train["dtype"] == "bfloat16" and train["prox_pass"] == "all"
  assert train["train_tokens_per_s"] > 0 and train["planned_step_bytes"] > 0
  decode = points["decode_n4_t16"]["result"]
  floor = hbm.decode_bytes(accelerator_points.qwen3_0p6b_shape(True), 4, 8, 16)
  assert decode["bytes_per_step"] == pytest.approx(floor["per_step"])
  assert decode["tokens_per_s"] > 0 and decode["step_s"] > 0
  if result["env"]["backend"] == "cpu":  # no chip specification, no device statistics
    assert train["train_mfu"] is None and decode["hbm_fraction"] is None
    assert train["device_peak_bytes"] is None and decode["device_peak_bytes"] is None
    # The splash kernel, interpreted, against blocked in bf16.
    (splash,) = points["parity"]["result"]["parity"]
    assert splash["kernel"] == "splash (interpreted)"
    assert splash["max_out_diff"] <= 0.05 * splash["ref_out_scale"]
    assert splash["max_grad_diff"] <= 0.05 * splash["ref_grad_scale"]
    assert splash["max_at_padding"] == 0 and splash["finite"]
  table = (out / "accelerator.md").read_text()
  assert "| grpo | auto (xla) | 8 | 8 | 16 | full, none (1.000) | all |" in table
  assert "| 4 | 8 | 16 | auto (xla) |" in table
  assert re.search(r"- decode_n8_t16: timed out after \d+ s \(its cap\)", table)
  assert result["compilation_cache"]["entries_after"] > 0


@pytest.mark.slow
def test_accelerator_check_ends_inside_its_budget(tmp_path):
  # Half a second: the environment's child is killed, nothing else starts, the files say so.
  t0 = time.monotonic()
  proc = subprocess.run(CHECK + ["--tiny", "--budget_s=0.5", f"--out_dir={tmp_path}",
                                 f"--cache_dir={tmp_path / 'cache'}"],
                        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
  assert time.monotonic() - t0 < 15
  assert proc.returncode == 4, proc.stderr[-3000:]
  (line,) = proc.stderr.strip().splitlines()
  assert "nothing measured" in line
  result = json.loads((tmp_path / "accelerator.json").read_text())
  assert result["status"] == "no environment"
  assert set(_statuses(result).values()) == {"timeout", "not started"}
  assert "Not measured" in (tmp_path / "accelerator.md").read_text()


@pytest.mark.slow
def test_accelerator_check_refuses_the_full_shapes_on_a_cpu(tmp_path):
  proc = subprocess.run(CHECK + [f"--out_dir={tmp_path}", f"--cache_dir={tmp_path / 'cache'}"],
                        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
  result = json.loads((tmp_path / "accelerator.json").read_text())
  if result["env"]["backend"] != "cpu":
    pytest.skip("an accelerator is here: the full shapes are not refused")
  assert proc.returncode == 2
  (line,) = proc.stderr.strip().splitlines()
  assert "refusing the full shapes on a CPU" in line and "--tiny" in line
  assert result["status"] == "refused" and _statuses(result)["parity"] == "not started"


def test_importing_the_check_defines_no_flag():
  # Tests import this module beside bench.memory, which defines group_size and prompt_len too:
  # a flag defined at import made every bench.memory test in the same worker raise
  # DuplicateFlagError. The check's flags exist only once it is the program (define_flags).
  from absl import flags  # pylint: disable=g-import-not-at-top
  from grpo_jax.bench import memory  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  assert flags.FLAGS.find_module_defining_flag("group_size") != accelerator.__name__
  assert "simulate_hang" not in flags.FLAGS


def test_a_wrong_backend_or_a_missing_package_is_one_line_naming_the_cause():
  versions = {"jax": "0.11.2", "jax-cuda13-plugin": "0.11.1", "jaxlib": "0.11.2"}
  cpu, gpu = ({"backend": b, "missing_packages": []} for b in ("cpu", "gpu"))
  code, status, line = accelerator.env_problem(cpu, "gpu", True, versions)
  assert (code, status) == (3, "wrong backend") and "\n" not in line
  assert "jax-cuda13-plugin 0.11.1" in line and "jaxlib 0.11.2" in line and "did not load" in line
  code, status, line = accelerator.env_problem(cpu, "", False, {"jax": "0.10.2"})
  assert (code, status) == (2, "refused") and "no CUDA / TPU plugin" in line
  code, status, line = accelerator.env_problem({**gpu, "missing_packages": ["ml-collections"]},
                                               "gpu", False, versions)
  assert (code, status) == (5, "missing packages") and "ml-collections" in line
  assert accelerator.env_problem(gpu, "gpu", False, versions) == (0, "", "")
  assert accelerator.env_problem(cpu, "", True, versions) == (0, "", "")


def test_the_plan_runs_cudnn_and_the_real_configuration_first_each_point_capped():
  points = accelerator.plan(False, 128, [256, 512], [1024, 4096], ["xla", "blocked"], 8, 256,
                            True)
  assert [pt["id"] for pt in points] == [
      "env", "parity", "train_grpo_auto_n128_t1024", "decode_n256_t1024", "decode_n512_t1024",
      "rollouts_n64_t4096", "train_grpo_auto_n64_t4096_lognormal_none",
      "train_grpo_auto_n64_t4096_lognormal_tokens", "train_grpo_auto_n512_t1024",
      "train_grpo_auto_n128_t4096", "train_grpo_xla_n128_t1024",
      "train_grpo_blocked_n128_t1024", "train_popo_auto_n128_t1024", "tests"]
  # Under a lent machine's 10-minute command, whatever the budget (the tests take what is left).
  assert all(pt["cap_s"] <= 300 for pt in points[:-1])


@pytest.mark.parametrize("method", ["grpo", "popo"])
def test_the_train_points_use_the_bf16_presets_prox_pass(method):
  from grpo_jax import configuration
  config = accelerator_points.run_config(method, 128, 8, 256, 1024, "auto")
  step_config = configuration.step_config(config)
  assert config.model.dtype == "bfloat16" and config.model.param_dtype == "float32"
  assert step_config.prox_pass == "all" and step_config.remat == "layer"
  assert config.rollout.batch_prompts * config.rollout.group_size == 128


def test_decode_bytes_and_the_hbm_table():
  cfg = accelerator_points.qwen3_0p6b_shape(False)
  moved = hbm.decode_bytes(cfg, rows=512, prompt_len=256, completion_len=1024)
  weights = 2 * cfg.num_params  # tied embedding: the LM head reads it once per step
  slot = 2 * 28 * 8 * 128 * 2  # keys and values, 28 layers, 8 heads of 128, bf16
  assert moved["weights_per_step"] == weights and moved["kv_slot_per_row"] == slot
  filled = sum(256 + t for t in range(1, 1024))  # step t reads P + t slots
  assert moved["total"] == 1023 * weights + 512 * slot * (filled + 1023)
  assert moved["per_step"] == pytest.approx(moved["total"] / 1023)
  assert hbm.hbm_bandwidth("NVIDIA H200") == 4.8e12
  assert hbm.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
  assert hbm.hbm_bandwidth("NVIDIA H100 PCIe") == 2.0e12
  assert hbm.hbm_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
  assert hbm.hbm_bandwidth("TPU v5 lite") == 819e9
  assert hbm.hbm_bandwidth("NVIDIA GH200 480GB") is None and hbm.hbm_bandwidth("cpu") is None


@pytest.mark.slow
def test_the_rollouts_point_compares_static_and_partial_at_the_tiny_shape():
  """The first device's static-vs-partial point, at the tiny shape: both modes trained whole
  groups, and the pool computed far fewer positions per trained token (log-normal lengths:
  the static batch decodes every row to its longest)."""
  r = accelerator_points.rollouts_point(True, 8, 2, 8, 32, steps=2)
  static, pipe = r["static"], r["pipeline"]
  assert static["groups_trained"] == pipe["groups_trained"] == 8
  assert 0 < static["useful_fraction"] < pipe["useful_fraction"] <= 1
  assert r["generation_speedup_per_useful_token"] > 0 and "useful fraction" in r["summary"]


@pytest.mark.slow
def test_the_update_points_compare_padded_and_packed_at_the_tiny_shape():
  """The first device's packed-vs-padded update, at the tiny shape on log-normal lengths: the
  packed loss pass computes fewer padding positions for the same real tokens."""
  padded = accelerator_points.train_point(True, "grpo", "auto", 8, 2, 8, 64, "none", "lognormal")
  packed = accelerator_points.train_point(True, "grpo", "auto", 8, 2, 8, 64, "tokens",
                                          "lognormal")
  assert padded["real_tokens"] == packed["real_tokens"]
  assert 0 < padded["update_useful_fraction"] < packed["update_useful_fraction"] <= 1
