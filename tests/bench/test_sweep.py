"""The sweep runner: grids read and checked, cell records and summaries by hand, and the command
line on the two-cell smoke grid, resumed."""

import importlib.metadata
import json
import math
import os
import subprocess
import sys

import pytest

from grpo_jax.bench import carry_over
from grpo_jax.bench import cells as cells_lib
from grpo_jax.bench import grid as grid_lib
from grpo_jax.bench import sweep, sweep_outputs

SMOKE = "configs/sweeps/smoke.py"


def _grid_file(tmp_path, body: str) -> str:
  path = tmp_path / "grid.py"
  path.write_text(f"def get_grid(arg=None):\n  return {body}\n")
  return os.fspath(path)


def test_cells_are_seed_major_and_a_methods_own_axes_cross_only_its_cells(tmp_path):
  g = grid_lib.load(_grid_file(tmp_path, """dict(
      methods={"grpo": "grpo", "hd": "headroom"}, seeds=[0, 1], presets="smoke",
      budget={"steps": 2}, axes={"opt.learning_rate": [3e-5, 1e-4]},
      method_axes={"hd": {"replay.headroom.tau": [1e-3, 1e-2]}})"""))
  ids = [c.id for c in g.cells()]
  # per seed: 2 learning rates x (grpo + hd at 2 taus) = 2 x 3 = 6 cells; 12 for two seeds
  assert len(ids) == 12 and len(set(ids)) == 12
  assert ids[:3] == ["grpo__opt.learning_rate=3e-05__seed0",
                     "hd__opt.learning_rate=3e-05__replay.headroom.tau=0.001__seed0",
                     "hd__opt.learning_rate=3e-05__replay.headroom.tau=0.01__seed0"]
  assert all(i.endswith("seed0") for i in ids[:6]) and all(i.endswith("seed1") for i in ids[6:])
  cell = g.cells()[2]
  c = g.config(cell)
  assert (c.replay.headroom.tau, c.opt.learning_rate, c.seed) == (1e-2, 3e-5, 0)
  assert cell.setting_key == "opt.learning_rate=3e-05,replay.headroom.tau=0.01"


def test_more_seeds_run_after_the_grids_seeds_for_the_named_methods_only(tmp_path):
  g = grid_lib.load(_grid_file(tmp_path, """dict(
      methods={"grpo": "grpo", "popo": "popo", "hd": "headroom"}, seeds=[0, 1],
      presets="smoke", budget={"steps": 2}, more_seeds={"grpo": [2, 3], "popo": [3]})"""))
  # seeds 0 and 1: 3 methods each = 6 cells; then seed 2 for grpo, seed 3 for grpo and popo
  assert [c.id for c in g.cells()][6:] == ["grpo__seed2", "grpo__seed3", "popo__seed3"]
  assert (g.seeds_of("popo"), g.seeds_of("hd")) == ((0, 1, 3), (0, 1))


def test_only_selects_cells_by_seed_method_and_axis_value(tmp_path):
  g = grid_lib.load(_grid_file(tmp_path, """dict(
      methods={"grpo": "grpo", "hd": "headroom"}, seeds=[0, 1], presets="smoke",
      budget={"steps": 2}, axes={"opt.learning_rate": [3e-5, 1e-4]},
      method_axes={"hd": {"replay.headroom.tau": [1e-3, 1e-2]}})"""))
  ids = lambda only: [c.id for c in grid_lib.select(g, only)]
  # seed 1 at lr 1e-4 (written 0.0001 here): grpo + hd at its 2 taus = 3 cells, in run order
  assert ids(["seed=1", "opt.learning_rate=0.0001"]) == [
      "grpo__opt.learning_rate=0.0001__seed1",
      "hd__opt.learning_rate=0.0001__replay.headroom.tau=0.001__seed1",
      "hd__opt.learning_rate=0.0001__replay.headroom.tau=0.01__seed1"]
  # a method's own axis selects only that method's cells: 2 lrs x 2 seeds at tau 1e-2
  assert len(ids(["replay.headroom.tau=1e-2"])) == 4
  assert ids(["method=grpo", "seed=0,1", "opt.learning_rate=3e-5"]) == [
      "grpo__opt.learning_rate=3e-05__seed0", "grpo__opt.learning_rate=3e-05__seed1"]
  assert ids(["opt.learning_rate=2e-4"]) == []
  with pytest.raises(grid_lib.GridError, match="not seed, method or an axis"):
    grid_lib.select(g, ["opt.b1=0.9"])
  with pytest.raises(grid_lib.GridError, match="KEY=V1,V2"):
    grid_lib.select(g, ["seed"])


def test_a_rollout_budget_sets_the_stop_and_the_evaluations(tmp_path):
  g = grid_lib.load(_grid_file(tmp_path, """dict(methods={"grpo": "grpo"}, seeds=[3],
      budget={"rollouts": 1000}, evaluations=4, overrides={"eval.num_prompts": 64})"""))
  c = g.config(g.cells()[0])
  # B x G = 32 x 8 = 256 per step: ceil(1000 / 256) = 4 steps at most; the budget stops it;
  # an evaluation every 1000 // 4 = 250 rollouts; a checkpoint every max(1, 4 // 4) = 1 step
  assert (c.total_rollouts, c.eval.every_rollouts, c.total_steps) == (1000, 250, 4)
  assert (c.checkpoint.every, c.eval.num_prompts, c.seed, c.log_every) == (1, 64, 3, 1)


def test_the_config_hash_follows_the_resolved_config(tmp_path, monkeypatch):
  body = """dict(methods={"grpo": "grpo"}, seeds=[0], budget={"steps": 2},
      overrides={"opt.learning_rate": %s})"""
  (tmp_path / "a").mkdir()
  (tmp_path / "b").mkdir()
  a = grid_lib.load(_grid_file(tmp_path / "a", body % "3e-5"))
  b = grid_lib.load(_grid_file(tmp_path / "b", body % "1e-4"))
  ca, cb = a.cells()[0], b.cells()[0]
  assert ca.id == cb.id  # the same cell of the grid...
  assert a.config_hash(ca) != b.config_hash(cb)  # ...whose config changed: it runs again
  assert a.config_hash(ca) == a.config_hash(ca)
  assert b.current(cb).changes({"config": a.current(ca).config}) == {
      "opt.learning_rate": [3e-5, 1e-4]}
  # the embedded model's absolute path does not enter it: the same cell built by a copy of the
  # package elsewhere (a worktree) has the same stored config and hash; any other path does not
  c, here, flat = a.config(ca), a.config_hash(ca), grid_lib.flat_config(a.config(ca))
  package = grid_lib._PACKAGE  # pylint: disable=protected-access
  assert c.model.path.startswith(package + os.sep)
  assert flat["model.path"] == "<grpo_jax>/assets/countdown-qwen3-1m"
  moved = c.copy_and_resolve_references()
  moved.model.path = c.model.path.replace(package, "/elsewhere/checkout/grpo_jax")
  assert grid_lib.config_hash(moved) != here  # another path, here
  monkeypatch.setattr(grid_lib, "_PACKAGE", "/elsewhere/checkout/grpo_jax")
  assert grid_lib.flat_config(moved) == flat
  moved.model.path = "/my/own/model"
  assert grid_lib.flat_config(moved)["model.path"] == "/my/own/model"


@pytest.mark.parametrize("body, message", [
    ("dict(methods={'grpo': 'grpo'}, seeds=[0], budget={'steps': 2}, colour='red')",
     "unknown grid key(s) ['colour']"),
    ("dict(methods={'grpo': 'grpo'}, seeds=[0], budget={'epochs': 2})", "budget is one of"),
    ("dict(methods={'grpo': 'grpo'}, seeds=[0])", "the grid needs 'budget'"),
    ("dict(methods={'grpo': 'grpo'}, seeds=[0], budget={'steps': 2}, baseline='popo')",
     "the baseline 'popo' is not one of the methods"),
    ("dict(methods={'grpo': 'grpo', 'popo': 'popo'}, seeds=[0], budget={'steps': 2},"
     " more_seeds={'popo': [1, 2], 'grpo': [2]})",
     "more_seeds gives 'popo' seeds [1] that the baseline 'grpo' does not run"),
    ("dict(methods={'grpo': 'grpo'}, seeds=[0], budget={'steps': 2}, more_seeds={'dapo': [1]})",
     "more_seeds names 'dapo', not one of the methods ['grpo']"),
    ("dict(methods={'grpo': 'grpo'}, seeds=[0], budget={'steps': 2}, targets=['dapo'])",
     "targets names 'dapo', not one of the methods ['grpo']"),
    ("dict(methods={'grpo': 'grpo'}, seeds=[0], budget={'steps': 2}, axes={'opt.lr': [1]})",
     "grpo (grpo): no config field 'opt.lr'"),
    ("dict(methods={'grpo': 'grpo'}, seeds=[0], budget={'steps': 2},"
     " overrides={'optim.learning_rate': 1e-4})", "no config group 'optim'"),
    ("dict(methods={'grpo': 'grpo'}, seeds=[0], budget={'steps': 2},"
     " overrides={'rl.num_minibatches': 'four'})", "rl.num_minibatches='four'"),
    ("dict(methods={'grpo': 'grpo'}, seeds=[0], budget={'steps': 2},"
     " axes={'rl.num_minibatches': [4, 0]})", "cell grpo__rl.num_minibatches=0__seed0"),
    ("dict(methods={'x': 'nosuchconfig'}, seeds=[0], budget={'steps': 2})",
     "/configs/nosuchconfig.py not found (the method files are in the repository's configs/"),
    ("dict(methods={'grpo': 'grpo:nosuchpreset'}, seeds=[0], budget={'steps': 2})",
     "unknown config preset 'nosuchpreset'"),
])
def test_a_grid_that_cannot_run_fails_in_one_line_before_any_cell(tmp_path, body, message):
  with pytest.raises(grid_lib.GridError) as e:
    grid_lib.load(_grid_file(tmp_path, body))
  assert message in str(e.value) and "\n" not in str(e.value)


def test_no_such_grid_file():
  with pytest.raises(grid_lib.GridError, match="no such grid file: /nonexistent.py"):
    grid_lib.load("/nonexistent.py")


def _metrics(tmp_path, name, rows):
  d = tmp_path / name
  d.mkdir()
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return os.fspath(d)


def _step(step, rollouts, tokens, **kw):
  return {"step": step, "loss": 0.0, "rollouts": rollouts, "completion_tokens": tokens,
          "wall_s": 10.0 * step, **kw}


def _eval(step, rollouts, acc, se=0.01):
  return {"step": step, "rollouts": rollouts, "eval/mean_at_8": acc, "eval/mean_at_8_se": se,
          "eval/pass_at_8": 0.5, "eval/mean_length": 9.0, "eval/constant_fraction": 0.3,
          "eval/truncated_fraction": 0.1}


def test_a_record_reads_tokens_mechanism_means_and_step_times_by_hand(tmp_path):
  w = _metrics(tmp_path, "run", [
      _eval(0, 0, 0.25),
      _step(1, 256, 2000, replay_rows=0.0, replay_drift=0.0, completion_length_mean=8.0,
            **{"time/step_s": 9.0}),
      _step(2, 512, 4100, replay_rows=64.0, replay_drift=0.02, completion_length_mean=10.0,
            **{"time/step_s": 2.0}),
      _eval(2, 512, 0.30),
      _step(3, 768, 6000, replay_rows=64.0, replay_drift=0.04, completion_length_mean=12.0,
            **{"time/step_s": 4.0}),
      _eval(3, 768, 0.35)])
  rec = cells_lib.record(w, 8)
  # tokens of an evaluation: the step record just before it (0 at step 0)
  assert [(e["step"], e["rollouts"], e["completion_tokens"], e["mean_at_k"])
          for e in rec["evals"]] == [(0, 0, 0, 0.25), (2, 512, 4100, 0.30), (3, 768, 6000, 0.35)]
  assert rec["evals"][1]["mean_at_k_se"] == 0.01 and rec["evals"][1]["truncated_fraction"] == 0.1
  # replay drift over the steps that replayed only: (0.02 + 0.04) / 2 = 0.03, not 0.06 / 3
  assert rec["train"]["replay_drift"] == pytest.approx(0.03)
  # length over all steps (8 + 10 + 12) / 3 = 10; at the end: the last max(1, 3 // 10) = 1 step
  assert rec["train"]["completion_length_mean"] == pytest.approx(10.0)
  assert rec["train"]["end_completion_length_mean"] == pytest.approx(12.0)
  # the median step time leaves out the first (compiling) step: median(2, 4) = 3
  assert rec["step_s_median"] == pytest.approx(3.0) and rec["steps"] == 3
  assert rec["loop_wall_s"] == pytest.approx(30.0)


def test_interpolate_by_hand():
  curve = [(0, 0.2), (100, 0.3), (300, 0.5)]
  assert cells_lib.interpolate(curve, 200) == pytest.approx(0.4)  # 0.3 + 100 / 200 * 0.2
  assert math.isnan(cells_lib.interpolate(curve, 301))


def _rec(method, seed, curve, se=0.01, setting="(defaults)"):
  """A done record whose evaluations are (rollouts, tokens, mean@8) points."""
  return {"grid": "g", "id": f"{method}__seed{seed}", "method": method, "spec": method,
          "setting": {}, "setting_key": setting, "seed": seed, "config_hash": "x",
          "wall_s": 60.0, "cpu_s": 100.0, "loop_wall_s": 50.0, "step_s_median": 0.5,
          "other_cpu_s": 1.0, "contended": False, "train": {"replay_drift": 0.01 * (seed + 1)},
          "evals": [{"step": i, "rollouts": r, "completion_tokens": t, "mean_at_k": a,
                     "mean_at_k_se": se} for i, (r, t, a) in enumerate(curve)]}


def test_summaries_pair_seeds_and_compare_at_equal_tokens_by_hand():
  recs = [_rec("grpo", 0, [(0, 0, 0.20), (100, 1000, 0.30)]),
          _rec("grpo", 1, [(0, 0, 0.20), (100, 1000, 0.34)]),
          _rec("popo", 0, [(0, 0, 0.20), (100, 2000, 0.36)]),
          _rec("popo", 1, [(0, 0, 0.20), (100, 2000, 0.36)])]
  s = {x["method"]: x for x in cells_lib.summarise(recs, "grpo")}
  # grpo's final mean (0.30 + 0.34) / 2 = 0.32, population std 0.02
  assert (s["grpo"]["mean"], s["grpo"]["std"]) == pytest.approx((0.32, 0.02))
  # paired gains 0.36 - 0.30 = 0.06 and 0.36 - 0.34 = 0.02: mean 0.04; sample std
  # sqrt(((0.02)^2 + (0.02)^2) / 1) = 0.0282843, over sqrt(2): SE 0.02; t = 2 on 1 degree of
  # freedom: p = 1 - (2/pi) atan(2) = 1 - 0.70483 = 0.29517, not resolved
  assert s["popo"]["gain"] == pytest.approx(0.04)
  assert s["popo"]["gain_se"] == pytest.approx(0.02)
  assert s["popo"]["gain_p"] == pytest.approx(0.29517, abs=1e-5)
  assert s["popo"]["resolved"] is False
  # equal tokens: the most every run reached is 1,000; popo at 1,000 of its 0..2,000 segment:
  # 0.20 + 0.5 x 0.16 = 0.28; gains 0.28 - 0.30 and 0.28 - 0.34: mean -0.04
  assert s["popo"]["tokens_common"] == 1000
  assert s["popo"]["gain_tokens"] == pytest.approx(-0.04)
  # rollouts to grpo's final 0.32: popo crosses it on 0 -> 100 at 0.12 / 0.16 x 100 = 75;
  # grpo's seed 0 never does (0.30), seed 1 at 0.12 / 0.14 x 100 = 85.7
  assert s["popo"]["rollouts_to_baseline"] == pytest.approx(75.0)
  assert s["grpo"]["reached"] == "1/2"
  assert s["grpo"]["rollouts_to_baseline"] == pytest.approx(100 * 0.12 / 0.14)
  assert s["popo"]["train/replay_drift"] == pytest.approx(0.015)  # (0.01 + 0.02) / 2


def test_resolved_is_a_paired_t_test_not_two_standard_errors():
  def gains(*finals):  # grpo at 0.30 on seeds 0..2, the other method at finals
    recs = [_rec("grpo", i, [(0, 0, 0.2), (10, 10, 0.30)]) for i in range(3)]
    recs += [_rec("m", i, [(0, 0, 0.2), (10, 10, f)]) for i, f in enumerate(finals)]
    return {x["method"]: x for x in cells_lib.summarise(recs, "grpo")}["m"]
  # gains 0.02, 0.05, 0.08: mean 0.05, sample std 0.03, SE 0.03 / sqrt(3) = 0.017321, t = 2.887:
  # above 2 SE but below t(0.975, 2) = 4.303. With 2 degrees of freedom the t tail has a closed
  # form, p = 1 - t / sqrt(2 + t^2) = 1 - 2.88675 / 3.21455 = 0.10197: not resolved
  wide = gains(0.32, 0.35, 0.38)
  assert wide["gain_se"] == pytest.approx(0.017321, abs=1e-6)
  assert wide["gain_p"] == pytest.approx(0.10197, abs=1e-5) and wide["resolved"] is False
  # gains 0.04, 0.05, 0.06: SE 0.01 / sqrt(3) = 0.0057735, t = 8.660, p = 1 - 8.660 /
  # sqrt(77) = 0.01307: resolved
  tight = gains(0.34, 0.35, 0.36)
  assert tight["gain_p"] == pytest.approx(0.01307, abs=1e-4) and tight["resolved"] is True
  md = cells_lib.summary_markdown([tight], "grpo", 8)
  assert "+0.050 ± 0.006 (p 0.013) **resolved**" in md


def test_a_methods_own_axis_values_are_each_paired_with_the_baseline(tmp_path):
  g = grid_lib.load(_grid_file(tmp_path, """dict(
      methods={"grpo": "grpo", "hd": "headroom"}, seeds=[0, 1], presets="smoke",
      budget={"steps": 2}, method_axes={"hd": {"replay.headroom.tau": [1e-3, 1e-2]}})"""))
  out = tmp_path / "out"
  os.makedirs(out / "cells")
  finals = {("grpo", 0): 0.30, ("grpo", 1): 0.34, ("hd", 1e-3, 0): 0.31,
            ("hd", 1e-3, 1): 0.36, ("hd", 1e-2, 0): 0.26, ("hd", 1e-2, 1): 0.32}
  for cell in g.cells():
    setting = dict(cell.setting)
    key = (cell.method, *setting.values(), cell.seed)
    rec = _rec(cell.method, cell.seed, [(0, 0, 0.2), (10, 10, finals[key])])
    rec.update(id=cell.id, setting=setting, setting_key=cell.setting_key, status="done",
               config_hash=g.config_hash(cell), config=g.current(cell).config, k=8)
    with open(sweep.cell_path(os.fspath(out), cell), "w") as f:
      json.dump(rec, f)
  written = sweep.write_outputs(g, os.fspath(out))
  # knobs.png: one panel (hd: tau), its two values at x = 0 and 1; no shared axes, so no
  # accuracy.png / mechanism.png (every point of theirs would be at x = 0)
  assert os.fspath(out / "knobs.png") in written and os.path.getsize(out / "knobs.png") > 0
  assert not any(os.path.exists(out / n) for n in ("accuracy.png", "mechanism.png"))
  with open(out / "summary.json") as f:
    s = {x["method"]: x for x in json.load(f)}
  assert sorted(s) == ["grpo", "hd [tau=0.001]", "hd [tau=0.01]"]
  assert {x["setting"] for x in s.values()} == {"(defaults)"}
  # tau 1e-3: gains 0.31 - 0.30 = +0.01 and 0.36 - 0.34 = +0.02, mean +0.015;
  # tau 1e-2: 0.26 - 0.30 = -0.04 and 0.32 - 0.34 = -0.02, mean -0.03
  assert s["hd [tau=0.001]"]["gain"] == pytest.approx(0.015)
  assert s["hd [tau=0.01]"]["gain"] == pytest.approx(-0.03)
  with pytest.raises(grid_lib.GridError, match="'grpo' is the baseline or a target and has "
                     "method_axes"):
    grid_lib.load(_grid_file(tmp_path, """dict(
        methods={"grpo": "grpo"}, seeds=[0], budget={"steps": 2},
        method_axes={"grpo": {"opt.learning_rate": [1e-4]}})"""))


def test_rollouts_to_another_methods_final_and_its_share_by_hand():
  recs = [_rec("grpo", 0, [(0, 0, 0.20), (100, 1000, 0.30)]),
          _rec("dapo", 0, [(0, 0, 0.20), (40, 400, 0.25), (120, 1200, 0.27)]),
          _rec("popo", 0, [(0, 0, 0.20), (50, 500, 0.30), (100, 1000, 0.36)])]
  s = {x["method"]: x for x in cells_lib.summarise(recs, "grpo", targets=["dapo"])}
  # dapo's final 0.27: popo crosses it on 0 -> 50 at 0.07 / 0.10 x 50 = 35 rollouts, a share
  # 35 / 120 = 29% of the 120 dapo generated; grpo on 0 -> 100 at 0.07 / 0.10 x 100 = 70
  assert s["popo"]["rollouts_to"]["dapo"]["rollouts"] == pytest.approx(35.0)
  assert s["popo"]["rollouts_to"]["dapo"]["share"] == pytest.approx(35 / 120)
  assert s["grpo"]["rollouts_to"]["dapo"]["rollouts"] == pytest.approx(70.0)
  # dapo reaches its own final at its last evaluation: share 1
  assert s["dapo"]["rollouts_to"]["dapo"]["share"] == pytest.approx(1.0)
  md = cells_lib.summary_markdown(list(s.values()), "grpo", 8, targets=["dapo"])
  assert "rollouts to dapo's final (share of its) |" in md
  assert "| rollouts to grpo's final | rollouts to dapo's" in md  # the baseline's, named
  assert "| 35 (1/1; 29%) |" in md and "| 70 (1/1; 58%) |" in md
  # a seed that never reaches it is counted out and named
  recs.append(_rec("popo", 1, [(0, 0, 0.20), (100, 1000, 0.26)]))
  s = {x["method"]: x for x in cells_lib.summarise(recs, "grpo", targets=["dapo"])}
  assert s["popo"]["rollouts_to"]["dapo"]["reached"] == "1/2"
  assert s["popo"]["rollouts_to"]["dapo"]["rollouts"] == pytest.approx(35.0)


def test_one_seed_takes_the_evaluations_standard_errors_and_resolves_nothing():
  recs = [_rec("grpo", 0, [(0, 0, 0.2), (10, 10, 0.30)], se=0.03),
          _rec("popo", 0, [(0, 0, 0.2), (10, 10, 0.42)], se=0.04)]
  s = {x["method"]: x for x in cells_lib.summarise(recs, "grpo")}
  # sqrt(0.03^2 + 0.04^2) = 0.05; gain 0.12 > 2 x 0.05, but one seed says nothing of how two
  # runs differ: not resolved, and marked as one seed's
  assert s["popo"]["gain_se"] == pytest.approx(0.05)
  assert s["popo"]["resolved"] is False
  md = cells_lib.summary_markdown(list(s.values()), "grpo", 8)
  assert "+0.120 ± 0.050 ¹ |" in md and "**resolved**" not in md and "†" not in md
  assert "¹ one seed: the SE is the two evaluations' alone" in md
  recs[1]["contended"] = True  # a cell timed while other processes took the CPU is marked
  md = cells_lib.summary_markdown(cells_lib.summarise(recs, "grpo"), "grpo", 8)
  assert "| 60 † |" in md and "† other processes used more than 10%" in md


def test_a_record_of_another_config_is_not_done(tmp_path):
  g = grid_lib.load(SMOKE)
  cell, out = g.cells()[0], os.fspath(tmp_path)
  now = g.current(cell)

  def write(rec):
    sweep_outputs.write_json(sweep.cell_path(out, cell), rec)

  write({"status": "done", "config_hash": now.hash,
         "config": dict(now.config, **{"opt.learning_rate": 1e-4})})
  assert not sweep.finished(out, g, cell)
  write({"status": "done", "config_hash": now.hash, "config": now.config})
  assert sweep.finished(out, g, cell)
  write({"status": "failed", "config_hash": now.hash, "config": now.config})
  assert not sweep.finished(out, g, cell)
  # a record of before records stored their config: done while its whole-config hash is today's
  write({"status": "done", "config_hash": now.whole})
  assert sweep.finished(out, g, cell)
  write({"status": "done", "config_hash": now.hash})
  assert not sweep.finished(out, g, cell)


def test_a_cell_killed_by_the_forwarded_stop_signal_is_stopped_not_failed(tmp_path, monkeypatch):
  # SIGTERM reaches the child before it installs its own handler: it dies of the signal
  # (Popen's -15). The sweep was asked to stop, so the cell is "stopped" and nothing failed.
  g, out = grid_lib.load(SMOKE), os.fspath(tmp_path)

  def killed(spec, cell, workdir, env):
    del spec, cell, workdir, env
    sweep._STOP["asked"] = True  # pylint: disable=protected-access
    return -15, "exit code -15"

  monkeypatch.setattr(sweep, "_run_child", killed)
  monkeypatch.setitem(sweep._STOP, "asked", False)  # pylint: disable=protected-access
  assert sweep.run(g, SMOKE, out, os.path.join(out, "runs")) == 0
  rec = json.load(open(sweep.cell_path(out, g.cells()[0])))
  assert rec["status"] == "stopped" and not os.path.exists(sweep.cell_path(out, g.cells()[1]))
  # the same exit without a stop asked for is a failure
  monkeypatch.setattr(sweep, "_run_child", lambda *a: (-15, "exit code -15"))
  monkeypatch.setitem(sweep._STOP, "asked", False)  # pylint: disable=protected-access
  assert sweep.run(g, SMOKE, out, os.path.join(out, "runs")) == 1
  assert json.load(open(sweep.cell_path(out, g.cells()[0])))["status"] == "failed"


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "grpo_jax.bench.sweep", *args],
                        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_runs_the_smoke_grid_in_two_invocations_and_reruns_nothing(tmp_path):
  out = os.fspath(tmp_path / "out")
  first = _cli(f"--grid={SMOKE}", f"--out={out}", "--max_cells=1")
  assert first.returncode == 0, first.stdout + first.stderr
  assert "sweep smoke: 2 cells, 0 done, 2 to run (at most 1 now)" in first.stdout
  assert "[1/1] grpo__seed0: mean@2" in first.stdout
  assert sorted(os.listdir(os.path.join(out, "cells"))) == ["grpo__seed0.json"]
  done = os.path.join(out, "cells", "grpo__seed0.json")
  stamp = os.stat(done).st_mtime_ns
  # checkpoints of a finished cell are removed; its metrics stay
  assert not os.path.exists(os.path.join(out, "runs", "grpo__seed0", "checkpoints"))
  # the rest, chosen by --only (the done cell is not chosen again either way)
  second = _cli(f"--grid={SMOKE}", f"--out={out}", "--only=method=popo,grpo")
  assert second.returncode == 0, second.stdout + second.stderr
  assert "sweep smoke: 2 cells, 1 done, 1 to run of the 2 chosen by --only" in second.stdout
  assert "[1/1] popo__seed0: mean@2" in second.stdout and "grpo__seed0:" not in second.stdout
  assert os.stat(done).st_mtime_ns == stamp  # the finished cell was not run again
  rec = json.load(open(done))
  assert rec["status"] == "done" and rec["steps"] == 2 and rec["wall_s"] > 0
  # The record travels: no path of this machine in it (the run folder is <workdirs>/<cell id>).
  assert os.fspath(tmp_path) not in open(done).read() and "workdir" not in rec
  assert [e["step"] for e in rec["evals"]] == [0, 2]
  import csv  # pylint: disable=g-import-not-at-top
  rows = list(csv.DictReader(open(os.path.join(out, "sweep.csv"))))
  # two cells x two evaluations (steps 0 and 2)
  assert [(r["method"], r["step"], r["final"]) for r in rows] == [
      ("grpo", "0", "False"), ("grpo", "2", "True"), ("popo", "0", "False"), ("popo", "2", "True")]
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  assert pq.read_table(os.path.join(out, "sweep.parquet")).num_rows == 4
  summary = open(os.path.join(out, "summary.md")).read()
  assert "2 of 2 cells done" in summary and "| (defaults) | popo |" in summary
  for png in ("accuracy.png", "mechanism.png"):
    assert os.path.getsize(os.path.join(out, png)) > 0
  smoke = grid_lib.load(SMOKE)  # both done: the same command again would run nothing
  assert all(sweep.finished(out, smoke, c) for c in smoke.cells())


@pytest.mark.slow
def test_cli_records_a_failed_cell_and_refuses_a_second_sweep(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text("not json\n")
  grid = _grid_file(tmp_path, f"""dict(methods={{"grpo": "grpo"}}, seeds=[0], presets="smoke",
      budget={{"steps": 2}}, overrides={{"task.data_path": {os.fspath(bad)!r}}})""")
  out = os.fspath(tmp_path / "out")
  got = _cli(f"--grid={grid}", f"--out={out}")
  assert got.returncode == 1
  assert "[1/1] grpo__seed0: FAILED (" in got.stdout and "bad.jsonl" in got.stdout
  assert "1 cell(s) failed" in got.stderr and "Traceback" not in got.stdout + got.stderr
  rec = json.load(open(os.path.join(out, "cells", "grpo__seed0.json")))
  assert rec["status"] == "failed" and "bad.jsonl" in rec["error"]
  # a live process holding the lock (this test's) refuses a second sweep on the same folder
  with open(os.path.join(out, "sweep.lock"), "w") as f:
    f.write(str(os.getpid()))
  held = _cli(f"--grid={grid}", f"--out={out}")
  assert held.returncode == 1
  assert held.stderr.strip().splitlines()[-1] == (
      f"grpo_jax.bench.sweep: another sweep (pid {os.getpid()}) is writing {out}; wait for it "
      f"or stop it (kill {os.getpid()})")


def test_the_grid_figure_names_a_series_missing_from_its_first_panel():
  """GRPO has no replay drift, the mechanism figure's first row: it is still in the legend,
  in the series' order (before: only the first panel's series were named)."""
  from grpo_jax.run import report_writer  # pylint: disable=g-import-not-at-top
  plt = report_writer._pyplot()  # pylint: disable=protected-access
  fig, axes = plt.subplots(2, 1, squeeze=False)
  axes[0][0].plot([0, 1], [0.1, 0.2], label="popo")  # drift: POPO only
  axes[1][0].plot([0, 1], [0.3, 0.4], label="grpo")  # accuracy: both
  axes[1][0].plot([0, 1], [0.3, 0.5], label="popo")
  # pylint: disable-next=protected-access
  handles, labels = report_writer._legend_entries(axes, ["grpo", "popo", "headroom"])
  plt.close(fig)
  assert labels == ["grpo", "popo"]  # headroom drew nothing: not named
  assert [h.get_label() for h in handles] == labels


def test_a_rerun_that_reproduces_its_record_carries_the_methods_other_records_over(
    tmp_path, monkeypatch):
  # Two seeds of GRPO and one of POPO with records of an older config (hash 0...0) written by
  # commit "old". Re-running grpo seed 0 with the same evaluations carries grpo seed 1 over;
  # POPO, with no re-run, stays stale; then a POPO re-run that differs is recorded as such.
  grid = _grid_file(tmp_path, """dict(methods={"grpo": "grpo", "popo": "popo"}, seeds=[0, 1],
      presets="smoke", budget={"steps": 2})""")
  g, out = grid_lib.load(grid), os.fspath(tmp_path / "out")
  evals = [{"step": 0, "rollouts": 0, "completion_tokens": 0, "mean_at_k": 0.25,
            "mean_at_k_se": 0.1, "pass_at_k": 0.5, "greedy_accuracy": 0.0},
           {"step": 2, "rollouts": 16, "completion_tokens": 120, "mean_at_k": 0.375,
            "mean_at_k_se": 0.1, "pass_at_k": 0.5, "greedy_accuracy": 0.5}]
  for cell in g.cells():
    sweep_outputs.write_json(sweep.cell_path(out, cell), {
        "id": cell.id, "method": cell.method, "status": "done", "config_hash": "0" * 12,
        "code": "old", "evals": evals})
  assert not any(sweep.finished(out, g, c) for c in g.cells())
  rerun = {"evals": evals}
  monkeypatch.setattr(sweep, "_run_child", lambda *a: (0, ""))
  monkeypatch.setattr(cells_lib, "record", lambda workdir, k: rerun)
  monkeypatch.setattr(sweep, "write_outputs", lambda *a, **kw: [])
  monkeypatch.setitem(sweep._STOP, "asked", False)  # pylint: disable=protected-access
  assert sweep.run(g, grid, out, os.path.join(out, "runs"), only=("method=grpo",
                                                                  "seed=0")) == 0
  ids = {c.id: c for c in g.cells()}
  rec = json.load(open(sweep.cell_path(out, ids["grpo__seed0"])))
  assert rec["previous"] == {"config_hash": "0" * 12, "code": "old", "identical": True,
                            "agreed_until_step": 2}
  # what else moves float rounding is recorded beside the code (here, this machine's)
  assert rec["platform"]["jax"] == importlib.metadata.version("jax")
  assert set(rec["platform"]) == {"jax", "jaxlib", "numpy", "python", "cpu", "cpu_flags"}
  carried, left = sweep.carry_over(g, out)
  assert carried == ["grpo__seed1"]
  assert set(left) == {"popo__seed0", "popo__seed1"}
  assert "no re-run of its cells yet" in left["popo__seed0"]
  rec = json.load(open(sweep.cell_path(out, ids["grpo__seed1"])))
  assert rec["carried_over"] == {"from": "0" * 12, "verified_by": ["grpo__seed0"]}
  assert sweep.finished(out, g, ids["grpo__seed1"]) and rec["evals"] == evals
  # a POPO re-run whose last evaluation moves by one sample in 64 blocks its other record
  rerun = {"evals": [evals[0], dict(evals[1], mean_at_k=0.375 + 1 / 64)]}
  assert sweep.run(g, grid, out, os.path.join(out, "runs"), only=("method=popo",
                                                                  "seed=0")) == 0
  carried, left = sweep.carry_over(g, out)
  assert carried == [] and list(left) == ["popo__seed1"]
  assert "the re-run of popo__seed0 differs from its record" in left["popo__seed1"]
  rec = json.load(open(sweep.cell_path(out, ids["popo__seed0"])))
  assert rec["previous"]["agreed_until_step"] == 0  # the first evaluation still agrees
  assert not sweep.finished(out, g, ids["popo__seed1"])


def test_where_a_rerun_parts_from_its_record():
  ev = lambda step, tokens, mean: {"step": step, "rollouts": 8 * step, "mean_at_k": mean,
                                   "completion_tokens": tokens, "pass_at_k": 0.5,
                                   "greedy_accuracy": 0.5, "mean_at_k_se": 0.1}
  rec = {"evals": [ev(0, 0, 0.25), ev(25, 200, 0.30), ev(50, 400, 0.35)]}
  assert carry_over.agreed_until(rec, rec) == 50
  # a token count off at step 50 with the same accuracy is a difference there
  moved = {"evals": [ev(0, 0, 0.25), ev(25, 200, 0.30), ev(50, 407, 0.35)]}
  assert carry_over.agreed_until(rec, moved) == 25
  # agreeing again later (the same mean by chance) does not undo a difference
  moved = {"evals": [ev(0, 0, 0.25), ev(25, 200, 0.3125), ev(50, 400, 0.35)]}
  assert carry_over.agreed_until(rec, moved) == 0
  # the SE is not compared (it follows from the mean), the first evaluation is
  assert carry_over.agreed_until(rec, {"evals": [dict(ev(0, 0, 0.25), mean_at_k_se=0.2)]}) == 0
  assert carry_over.agreed_until(rec, {"evals": [ev(0, 0, 0.5)]}) is None
  assert carry_over.agreed_until(rec, {}) is None


def test_a_stopped_rerun_keeps_the_old_record_for_the_next_one(tmp_path, monkeypatch):
  g, out = grid_lib.load(SMOKE), os.fspath(tmp_path)
  cell = g.cells()[0]
  old = {"id": cell.id, "method": cell.method, "status": "done", "config_hash": "0" * 12,
         "code": "old", "evals": [{"step": 2, "rollouts": 16, "completion_tokens": 120,
                                   "mean_at_k": 0.5, "mean_at_k_se": 0.1, "pass_at_k": 0.5,
                                   "greedy_accuracy": 0.5}]}
  sweep_outputs.write_json(sweep.cell_path(out, cell), old)
  monkeypatch.setattr(sweep, "_run_child", lambda *a: (sweep._STOPPED, "stopped"))  # pylint: disable=protected-access
  monkeypatch.setattr(sweep, "write_outputs", lambda *a, **kw: [])
  monkeypatch.setitem(sweep._STOP, "asked", False)  # pylint: disable=protected-access
  sweep.run(g, SMOKE, out, os.path.join(out, "runs"), only=(f"method={cell.method}",))
  rec = json.load(open(sweep.cell_path(out, cell)))
  assert rec["status"] == "stopped" and rec["replaces"] == old
  # the resumed re-run still compares with the old record
  monkeypatch.setattr(sweep, "_run_child", lambda *a: (0, ""))
  monkeypatch.setattr(cells_lib, "record", lambda workdir, k: {"evals": old["evals"]})
  sweep.run(g, SMOKE, out, os.path.join(out, "runs"), only=(f"method={cell.method}",))
  rec = json.load(open(sweep.cell_path(out, cell)))
  assert rec["status"] == "done" and rec["previous"]["identical"] and "replaces" not in rec
