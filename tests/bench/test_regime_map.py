"""The regime map: several sweeps' summaries as one table per sweep and one heat map, checked
by hand on two small made-up sweeps."""

import os

import pytest

from grpo_jax.bench import regime_map
from tests.bench.summaries import write_sweep


def _summary(method, setting_values, seeds, mean, gain=0.0, gain_se=0.0, resolved=False,
             ineffective=0.3):
  return {"method": method, "setting_values": setting_values, "seeds": seeds, "mean": mean,
          "gain": gain, "gain_se": gain_se, "resolved": resolved,
          "train/ineffective_fraction": ineffective}



@pytest.fixture
def sweeps(tmp_path):
  lr = lambda v: {"opt.learning_rate": v}
  movement = write_sweep(tmp_path, "movement", [
      _summary("grpo", lr(3e-5), [0, 1, 2], 0.3371),
      _summary("popo", lr(3e-5), [0, 1, 2], 0.343, gain=0.006, gain_se=0.0004, resolved=True),
      _summary("grpo", lr(2e-4), [0, 1, 2], 0.41),
      _summary("popo", lr(2e-4), [0, 1], 0.40, gain=-0.0187, gain_se=0.0101)])
  knobs = write_sweep(tmp_path, "knobs", [
      _summary("grpo", {}, [0, 1, 2], 0.061, ineffective=0.85),
      # an own-axis value is in the label, so its column is the shared setting: defaults
      _summary("popo [max_uses=4]", {"replay.popo.max_uses": 4}, [0, 1, 2], 0.065,
               gain=0.004, gain_se=0.002)])
  return movement, knobs


def test_one_table_per_sweep_gains_in_points_resolved_bold_and_seed_counts(sweeps):
  rows = regime_map.load(sweeps)
  md = regime_map.table(rows, "grpo", ["popo", "popo [max_uses=4]", "grpo"])
  movement, knobs = md.split("\n\n**knobs**")
  assert "| method | lr 3e-5 | lr 2e-4 |" in movement
  # popo at lr 3e-5: 0.006 -> +0.6 points, SE 0.0004 -> 0.0 (resolved: bold); at lr 2e-4
  # -0.0187 -> -1.87 -> -1.9 points, SE 0.0101 -> 1.0, two seeds where GRPO ran three: the
  # count is shown
  assert "| popo | **+0.6 ± 0.0** | -1.9 ± 1.0 (n=2) |" in movement
  assert "| grpo | 0.337 (n=3) | 0.410 (n=3) |" in movement
  assert "| method | defaults |" in knobs
  assert "| popo [max_uses=4] | +0.4 ± 0.2 |" in knobs
  assert "popo |" not in knobs.replace("popo [max_uses=4] |", "")  # no row without cells


def test_setting_labels_are_short():
  assert regime_map.setting_label({"opt.learning_rate": 1e-4, "rl.num_minibatches": 4}) == \
      "lr 1e-4, updates 4"
  assert regime_map.setting_label({"task.countdown.max_number": 100}) == "numbers to 100"
  assert regime_map.setting_label({"replay.headroom.tau": 0.03}) == "tau 0.03"
  assert regime_map.setting_label({}) == "defaults"


def test_write_makes_the_table_and_the_figure(sweeps, tmp_path):
  paths = regime_map.write(sweeps, os.fspath(tmp_path / "map"))
  assert [os.path.basename(p) for p in paths] == ["map.md", "map.png"]
  assert os.path.getsize(paths[1]) > 0


def test_a_folder_without_a_summary_says_which_command_writes_it(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"no sweep summary \(python -m "
                                              r"grpo_jax.bench.sweep .*--report"):
    regime_map.load([os.fspath(tmp_path)])
