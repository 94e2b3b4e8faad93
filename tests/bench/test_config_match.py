"""When a sweep's record stands for its cell: the rule by hand (``config_match``), a made-up
sweep folder before and after a key is added to the package, and the re-keying of records
written before records stored their config (``rekey``), with a stand-in for git and once
against a real commit."""

import json
import os
import shutil
import subprocess

import ml_collections
import pytest

from grpo_jax import schema
from grpo_jax.bench import cells as cells_lib
from grpo_jax.bench import config_match
from grpo_jax.bench import grid as grid_lib
from grpo_jax.bench import rekey
from grpo_jax.bench import sweep, sweep_outputs

SMOKE = "configs/sweeps/smoke.py"
ABSENT = config_match.ABSENT
EVALS = [{"step": 2, "rollouts": 16, "completion_tokens": 120, "mean_at_k": 0.5,
          "mean_at_k_se": 0.1, "pass_at_k": 0.5, "greedy_accuracy": 0.5}]


def test_what_makes_two_configs_two_runs_by_hand():
  defaults = {"opt.lr": 3e-5, "opt.b2": 0.999, "new.knob": 0, "new.off": None}
  ran = {"opt.lr": 1e-4, "opt.b2": 0.999, "gone.unset": None}
  # a key added at its default, or unset, and a removed key that was unset: the same run
  now = {"opt.lr": 1e-4, "opt.b2": 0.999, "new.knob": 0, "new.off": None}
  assert config_match.changes(ran, now, defaults) == {}
  # the added key set otherwise by the cell (a method's file, the grid) is a change
  assert config_match.changes(ran, dict(now, **{"new.knob": 2}), defaults) == {
      "new.knob": [ABSENT, 2]}
  # a value the run used, changed; and a default it relied on, changed (today's config is at
  # today's default, 0.99, and still another run than the recorded 0.999)
  assert config_match.changes(ran, dict(now, **{"opt.lr": 2e-4}), defaults) == {
      "opt.lr": [1e-4, 2e-4]}
  assert config_match.changes(ran, dict(now, **{"opt.b2": 0.99}),
                              dict(defaults, **{"opt.b2": 0.99})) == {"opt.b2": [0.999, 0.99]}
  # a removed key that held a value; an added key the defaults do not have
  assert config_match.changes(dict(ran, **{"gone.on": 1}), now, defaults) == {
      "gone.on": [1, ABSENT]}
  assert config_match.changes(ran, dict(now, **{"x.y": 0}), defaults) == {"x.y": [ABSENT, 0]}
  # a key that moved into a group (deprecated.ALIASES) is compared at its new place
  old = {"rl.clip_high": 0.28, "rl.aggregation": "token-mean"}
  new = {"rl.clip_high": None, "rl.aggregation": None, "rl.loss.ppo.clip_high": 0.28,
         "rl.loss.aggregation": "token-mean"}
  assert config_match.changes(old, new, {}) == {}
  assert config_match.changes(old, dict(new, **{"rl.loss.ppo.clip_high": 0.2}), {}) == {
      "rl.loss.ppo.clip_high": [0.28, 0.2]}
  # the hash names the choices (entries off the defaults): a key added at its default keeps it
  assert config_match.config_hash(ran, defaults) == config_match.config_hash(now, defaults)
  assert config_match.config_hash(ran, defaults) != config_match.config_hash(
      dict(now, **{"opt.lr": 2e-4}), defaults)
  assert config_match.flatten({"a": {"b": 1, "c": {"d": None}}, "e": {}}) == {
      "a.b": 1, "a.c.d": None, "e": {}}


def _edit_defaults(monkeypatch, edit):
  """Makes ``grpo_jax.schema``'s base config (every config file starts from it) ``edit``ed."""
  base = schema.base_config

  def edited():
    c = base()
    edit(c)
    return c

  monkeypatch.setattr(schema, "base_config", edited)


def _add_keys(c):
  c.new_knob = 0
  c.rollout.new_knob = 0.5
  c.new_group = ml_collections.ConfigDict({"width": 3})


def _run_cells(monkeypatch, g, spec, out) -> list[str]:
  """``sweep.run`` with a stand-in for training; the ids of the cells it ran."""
  ran = []

  def child(spec, cell, *args):
    del spec, args
    ran.append(cell.id)
    return 0, ""

  monkeypatch.setattr(sweep, "_run_child", child)
  monkeypatch.setattr(cells_lib, "record", lambda workdir, k: {"evals": EVALS})
  monkeypatch.setattr(sweep, "write_outputs", lambda *a, **kw: [])
  monkeypatch.setitem(sweep._STOP, "asked", False)  # pylint: disable=protected-access
  sweep.run(g, spec, out, os.path.join(out, "runs"))
  return ran


def test_a_key_added_at_its_default_keeps_every_recorded_cell_done(tmp_path, monkeypatch):
  g, out = grid_lib.load(SMOKE), os.fspath(tmp_path / "out")
  cells = g.cells()
  assert _run_cells(monkeypatch, g, SMOKE, out) == ["grpo__seed0", "popo__seed0"]
  hashes = [g.config_hash(c) for c in cells]
  rec = json.load(open(sweep.cell_path(out, cells[0])))
  assert rec["config"] == g.current(cells[0]).config and rec["config_hash"] == hashes[0]
  assert all(sweep.finished(out, g, c) for c in cells)
  # three keys added to the package at their defaults: a knob, one in a group, a new group
  with monkeypatch.context() as m:
    _edit_defaults(m, _add_keys)
    assert "new_group.width" in g.current(cells[0]).config
    assert all(sweep.finished(out, g, c) for c in cells)
    assert [g.config_hash(c) for c in cells] == hashes
    assert len(sweep.records(out, g)) == 2
    assert _run_cells(m, g, SMOKE, out) == []  # the same command runs nothing again
    # ...unless the grid sets the new knob otherwise: the cells run again
    other = tmp_path / "other.py"
    other.write_text(open(SMOKE).read().replace("evaluations=1", "evaluations=1, "
                                                "overrides={'rollout.new_knob': 1.0}"))
    g2 = grid_lib.load(os.fspath(other))
    assert [c.id for c in g2.cells()] == [c.id for c in cells]
    assert not any(sweep.finished(out, g2, c) for c in cells)
    assert g2.current(cells[0]).changes(rec) == {"rollout.new_knob": [ABSENT, 1.0]}
  # a default the cells relied on, changed: they are stale, though their choices (hash) are not
  with monkeypatch.context() as m:
    _edit_defaults(m, lambda c: setattr(c.opt, "b2", 0.99))
    assert [g.config_hash(c) for c in cells] == hashes
    assert not any(sweep.finished(out, g, c) for c in cells)
    assert g.current(cells[0]).changes(rec) == {"opt.b2": [0.999, 0.99]}
  # a value the run used, changed by the grid: stale
  lr = tmp_path / "lr.py"
  lr.write_text(open(SMOKE).read().replace("evaluations=1", "evaluations=1, "
                                           "overrides={'opt.learning_rate': 1e-4}"))
  assert not any(sweep.finished(out, grid_lib.load(os.fspath(lr)), c) for c in cells)
  assert all(sweep.finished(out, g, c) for c in cells)


def _legacy(g, cell, code="abc+dirty", **fields):
  """A record of before records stored their config: the whole config's hash only."""
  return {"id": cell.id, "method": cell.method, "status": "done", "code": code,
          "config_hash": g.current(cell).whole, "evals": EVALS, **fields}


def test_rekey_stores_the_config_a_commit_reproduces_and_leaves_the_rest(tmp_path, monkeypatch):
  g, out = grid_lib.load(SMOKE), os.fspath(tmp_path)
  grpo, popo = g.cells()
  text = {c.id: grid_lib.config_json(g.config(c)) for c in (grpo, popo)}
  # grpo ran at "abc" with uncommitted changes that "def" (the next commit) holds: "abc" builds
  # another config (another learning rate), "def" the recorded one. popo's run, with lr 1e-4
  # against today's 3e-5, is reproduced by "abc" and is stale.
  popo_ran = text["popo__seed0"].replace('"learning_rate": 3e-05', '"learning_rate": 0.0001')
  assert popo_ran != text["popo__seed0"]
  recs = {"grpo__seed0": _legacy(g, grpo),
          "popo__seed0": _legacy(g, popo, config_hash=config_match.whole_hash(popo_ran))}
  calls = []

  def find(commit, spec, ids):
    calls.append((commit, sorted(ids)))
    if commit == "abc":
      return {"grpo__seed0": text["grpo__seed0"].replace("3e-05", "2e-05"),
              "popo__seed0": popo_ran}
    return {"grpo__seed0": text["grpo__seed0"]} if commit == "def" else "no such commit"

  now = {c.id: g.current(c) for c in (grpo, popo)}
  commits = {"grpo__seed0": ["abc", "def"], "popo__seed0": ["abc", "def"]}
  rekeyed, verdicts = rekey.rekey(recs, now, SMOKE, commits, find)
  assert calls == [("abc", ["grpo__seed0", "popo__seed0"]), ("def", ["grpo__seed0"])]
  assert verdicts == {"grpo__seed0": "done", "popo__seed0": "stale: opt.learning_rate"}
  assert rekeyed["grpo__seed0"]["rekeyed"] == {"from": recs["grpo__seed0"]["config_hash"],
                                              "commit": "def"}
  assert rekeyed["grpo__seed0"]["config"] == now["grpo__seed0"].config
  assert rekeyed["grpo__seed0"]["config_hash"] == now["grpo__seed0"].hash
  assert rekeyed["popo__seed0"]["config"]["opt.learning_rate"] == 1e-4
  # no commit reproduces the hash, or git cannot build it: left as it is, with why
  bad = dict(recs["grpo__seed0"], config_hash="0" * 12)
  _, verdicts = rekey.rekey({"grpo__seed0": bad}, now, SMOKE, commits, find)
  assert verdicts["grpo__seed0"] == ("left: no config of its commits (abc, def) has its hash "
                                     "000000000000")
  _, verdicts = rekey.rekey({"grpo__seed0": bad}, now, SMOKE, {"grpo__seed0": ["xyz"]}, find)
  assert verdicts["grpo__seed0"].endswith("(xyz) has its hash 000000000000; no such commit")
  # sweep.rekey rewrites the records it re-keys; then they are done by their stored config
  for cell in (grpo, popo):
    sweep_outputs.write_json(sweep.cell_path(out, cell), recs[cell.id])
  assert sweep.finished(out, g, grpo) and not sweep.finished(out, g, popo)  # whole hashes
  monkeypatch.setattr(rekey, "candidates", lambda code, added: ["abc", "def"])
  assert sweep.rekey(g, SMOKE, out, find) == {"grpo__seed0": "done",
                                              "popo__seed0": "stale: opt.learning_rate"}
  with monkeypatch.context() as m:
    _edit_defaults(m, _add_keys)
    assert sweep.finished(out, g, grpo) and not sweep.finished(out, g, popo)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_configs_at_builds_the_cells_config_at_a_commit(tmp_path):
  # a repository of one commit holding this package and its configs
  here = os.path.dirname(os.path.dirname(grid_lib.__file__))
  repo = tmp_path / "repo"
  skip = shutil.ignore_patterns("__pycache__", "*.pyc")
  shutil.copytree(here, repo / "grpo_jax", ignore=skip)
  shutil.copytree(os.path.join(os.path.dirname(here), "configs"), repo / "configs", ignore=skip)
  git = ["git", "-C", os.fspath(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
  subprocess.run(git[:3] + ["init", "-q"], check=True)
  subprocess.run(git + ["add", "-A"], check=True)
  subprocess.run(git + ["commit", "-qm", "c"], check=True)
  commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
  g = grid_lib.load(SMOKE)
  spec = os.fspath(repo / SMOKE)
  found = rekey.configs_at(commit, spec, ["popo__seed0", "nosuch__seed0"], os.fspath(repo))
  assert list(found) == ["popo__seed0"]
  assert config_match.whole_hash(found["popo__seed0"]) == g.current(g.cells()[1]).whole
  assert rekey.configs_at("0" * 40, spec, ["popo__seed0"], os.fspath(repo)).startswith(
      "git archive 000000000000")
  assert rekey.candidates(commit + "+dirty", None, os.fspath(repo)) == [commit]
