"""The registries: components found by name, their config groups, the deprecated flat keys, and
docs/design.md's examples (a two-file replay method, a one-module policy loss and estimator),
copied out of the page and trained with."""

import importlib
import pathlib
import re
import sys

import numpy as np
import pytest

from configs import grpo, headroom, popo, rollout_replay
from grpo_jax import allocation, configuration, deprecated, registry, schema, tasks, train
from grpo_jax.rewards import functions as rewards
from grpo_jax.rl import estimators, policy_losses
from grpo_jax.rl.replay import method as method_lib
from grpo_jax.run import metrics

DESIGN = pathlib.Path(__file__).resolve().parents[1] / "docs" / "design.md"


def test_every_component_is_found_and_its_group_holds_its_defaults():
  """Each table lists what the packages register, and base_config carries each component's
  own group with exactly its dataclass defaults (a hand-written copy would drift)."""
  assert set(method_lib.METHODS.names()) == {"none", "popo", "prioritized", "headroom"}
  assert set(allocation.RULES.names()) == {"uniform", "dynamic_sampling", "sara"}
  assert set(allocation.SELECTORS.names()) == {"stream", "mopps", "dps"}
  assert set(tasks.TASKS.names()) == {"countdown", "gsm8k", "jsonl", "file"}
  assert set(rewards.REWARDS.names()) == {"math", "gsm8k", "countdown", "format"}
  c = schema.base_config()
  for parent, table in ((c.replay, method_lib.METHODS), (c.allocation, allocation.RULES),
                        (c.allocation, allocation.SELECTORS), (c.task, tasks.TASKS)):
    for name, component in table.items():
      fields = {f.name: f.default for f in component.config_fields()}
      assert dict(parent.get(name, {})) == fields, name
  # The fields a method reads elsewhere are not in its group.
  assert "objective" not in c.replay.popo and "updates_per_step" not in c.replay.prioritized
  # A few defaults by hand, as the papers' configs state them.
  assert (c.replay.headroom.slots, c.replay.headroom.candidates, c.replay.headroom.tau) == (
      8, 16, 1e-3)
  assert (c.allocation.sara.probes, c.allocation.sara.tau_lo) == (4, 0.45)


def test_unknown_names_and_keys_are_refused_with_the_known_ones():
  with pytest.raises(KeyError, match="unknown replay method 'poppo'; known: none, .*popo"):
    method_lib.METHODS.get("poppo")
  with pytest.raises(ValueError, match="unknown key.*slotz; known: .*slots"):
    method_lib.METHODS.get("headroom").from_group({"slotz": 3})
  table = registry.Registry("widget")
  table.register("a")(int)
  with pytest.raises(ValueError, match="widget 'a' is registered twice"):
    table.register("a")(float)
  c = grpo.get_config()
  c.replay.method = "poppo"
  with pytest.raises(configuration.ConfigError, match="config.replay.method: 'poppo'; known"):
    configuration.validate(c)
  c = grpo.get_config()
  c.task.name = "mnist"
  with pytest.raises(configuration.ConfigError, match="config.task.name: 'mnist'; known"):
    configuration.validate(c)


def test_an_inactive_group_is_validated_too():
  """A value the validator accepts must run once its method is selected: a bad Headroom tau is
  refused under GRPO as well."""
  c = grpo.get_config()
  c.replay.headroom.tau = -1.0
  with pytest.raises(configuration.ConfigError, match="config.replay.headroom: tau must be > 0"):
    configuration.validate(c)
  c = grpo.get_config()
  c.allocation.dps.decay = 2.0
  with pytest.raises(configuration.ConfigError, match=r"config.allocation.dps: decay=2.0"):
    configuration.validate(c)


@pytest.mark.parametrize("module,old,value,new", [
    (popo, "rl.prox_pass", "all", "prox.rows"),
    (popo, "replay.prox", "interpolate", "prox.estimate"),
    (popo, "replay.prox_chunks", 2, "prox.chunks"),
    (grpo, "rollout.correction", "naive", "prox.continued"),
])
def test_a_deprecated_key_moves_to_its_group_with_one_line(module, old, value, new, capsys):
  c = module.get_config()
  group, key = old.split(".")
  c[group][key] = value
  configuration.validate(c)
  assert deprecated._get(c, new) == value and c[group][key] is None  # pylint: disable=protected-access
  err = capsys.readouterr().err
  assert err == f"grpo_jax: config.{old} is deprecated: use config.{new} (applied)\n"


@pytest.mark.parametrize("module,old,value,new", [
    (popo, "replay.slots", 3, "replay.popo.slots"),
    (headroom, "replay.slots", 3, "replay.headroom.slots"),
    (rollout_replay, "replay.max_age", 7, "replay.prioritized.tau_max"),
    (headroom, "replay.drift_tau", 0.5, "replay.headroom.tau"),
    (grpo, "task.max_number", 99, "task.countdown.max_number"),
    (grpo, "allocation.probes", 2, "allocation.sara.probes"),
    (grpo, "rl.clip_high", 0.28, "rl.loss.ppo.clip_high"),
    (grpo, "rl.kl_coef", 0.04, "rl.loss.kl_coef"),
    # GRPO selects no replay method: the key is named for whichever method is chosen.
    (grpo, "replay.slots", 2, "replay.<method>.slots"),
])
def test_a_retired_key_is_refused_in_one_line_naming_its_new_key(module, old, value, new):
  c = module.get_config()
  assert old.split(".")[1] not in c[old.split(".")[0]]  # no longer a field of the config
  group, key = old.split(".")
  c[group][key] = value  # as a config file written before could still set it
  with pytest.raises(configuration.ConfigError) as e:
    configuration.validate(c)
  assert str(e.value) == (f"config.{old}: moved to config.{new}, its old name retired "
                          "(docs/CHANGELOG.md): set the new key")


def test_every_moved_key_names_an_existing_field():
  """Each move's target (live alias or retired) exists for some method / selector / loss, with
  the old key's type: a saved config that predates it migrates to a real key."""
  c = schema.base_config()
  for old, (kind, template) in deprecated.MOVED.items():
    found = []
    for m in method_lib.METHODS.names():
      for s in allocation.SELECTORS.names():
        for loss in policy_losses.POLICY_LOSSES.names():
          new = deprecated._new_key(  # pylint: disable=protected-access
              template, {"method": m, "selector": s, "loss": loss})
          value = deprecated._get(c, new)  # pylint: disable=protected-access
          if value is not None:
            found.append(type(value))
    assert found and all(t is kind for t in found), (old, found)
  # Only the live aliases are fields (unset): the retired keys are gone from every config.
  assert {f"{g}.{k}" for g in c for k in (c[g] if hasattr(c[g], "keys") else ())
          if f"{g}.{k}" in deprecated.MOVED} == set(deprecated.ALIASES)


def test_the_old_method_name_is_refused_in_one_line():
  c = rollout_replay.get_config()
  c.replay.method = "rollout"
  with pytest.raises(configuration.ConfigError, match="^config.replay.method: 'rollout' was "
                     "renamed 'prioritized' and its old name retired$"):
    configuration.validate(c)
  # A saved config's old name is read as the new one (a workdir from before resumes).
  assert deprecated.migrate_saved({"replay.method": "rollout", "replay.max_age": 7}) == {
      "replay.method": "prioritized", "replay.prioritized.tau_max": 7}


def _design_blocks() -> dict[str, str]:
  """docs/design.md's python blocks whose first line is ``# <path>``, by path."""
  blocks = re.findall(r"```python\n# (\S+)\n(.*?)```", DESIGN.read_text(), flags=re.S)
  return {path: body for path, body in blocks}


@pytest.fixture
def design_example(tmp_path, monkeypatch):
  """The page's replay module and config file, importable as if they were in the tree."""
  blocks = _design_blocks()
  module_path, config_path = "grpo_jax/rl/replay/random_groups.py", "configs/random_replay.py"
  assert set(blocks) >= {module_path, config_path}
  (tmp_path / "replay").mkdir()
  (tmp_path / "replay" / "random_groups.py").write_text(blocks[module_path])
  (tmp_path / "configs").mkdir()
  (tmp_path / "configs" / "random_replay.py").write_text(blocks[config_path])
  replay_pkg = importlib.import_module("grpo_jax.rl.replay")
  configs_pkg = importlib.import_module("configs")
  monkeypatch.setattr(replay_pkg, "__path__", [*replay_pkg.__path__, str(tmp_path / "replay")])
  monkeypatch.setattr(configs_pkg, "__path__", [*configs_pkg.__path__, str(tmp_path / "configs")])
  entries = dict(method_lib.METHODS._entries)  # pylint: disable=protected-access
  monkeypatch.setattr(method_lib.METHODS, "_loaded", False)
  yield importlib.import_module("configs.random_replay")
  method_lib.METHODS._entries = entries  # pylint: disable=protected-access
  for name in ("grpo_jax.rl.replay.random_groups", "configs.random_replay"):
    sys.modules.pop(name, None)


def test_the_two_file_replay_method_of_the_design_page_trains(design_example, tmp_path):
  """Nothing but the module and the config file: the method is found, its group installed and
  validated, and two smoke steps train with it, replaying stored groups in the second."""
  c = design_example.get_config("smoke")
  assert "random" in method_lib.METHODS and c.replay.random.slots == 4
  c.rl.reward_signal = c.rl.effective_signal = "score"  # mixed groups in tiny batches
  c.rollout.batch_prompts, c.rl.num_minibatches = 4, 2  # 4 + 4 groups of 2 = 16 rows
  c.total_steps, c.checkpoint.every, c.eval.every = 2, 2, 100
  configuration.validate(c)
  assert type(configuration.replay_method(c)).__name__ == "RandomGroupReplay"
  small = design_example.get_config("smoke")
  small.replay.capacity = 3
  with pytest.raises(configuration.ConfigError,
                     match="config.replay.capacity: must be >= replay.random.slots=4"):
    configuration.validate(small)
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(c, workdir)
  steps = [r for r in metrics.read_metrics(workdir) if "loss" in r]
  assert len(steps) == 2
  assert steps[0]["replay_rows"] == 0  # nothing stored before the first update
  assert steps[1]["replay_rows"] > 0, steps[1]


@pytest.fixture
def design_loss_and_estimator(tmp_path, monkeypatch):
  """The page's policy-loss and estimator modules, importable as if they were in the tree."""
  blocks = _design_blocks()
  found = {}
  for path, table in (("grpo_jax/rl/policy_losses/plain.py", policy_losses.POLICY_LOSSES),
                      ("grpo_jax/rl/estimators/batch_std.py", estimators.ESTIMATORS)):
    assert path in blocks
    package, name = path[:-3].replace("/", ".").rsplit(".", 1)
    folder = tmp_path / package.rsplit(".", 1)[1]
    folder.mkdir()
    (folder / f"{name}.py").write_text(blocks[path])
    pkg = importlib.import_module(package)
    monkeypatch.setattr(pkg, "__path__", [*pkg.__path__, str(folder)])
    found[table] = dict(table._entries)  # pylint: disable=protected-access
    monkeypatch.setattr(table, "_loaded", False)
    monkeypatch.setattr(table, "_entries", dict(table._entries))  # pylint: disable=protected-access
  yield
  for name in ("grpo_jax.rl.policy_losses.plain", "grpo_jax.rl.estimators.batch_std"):
    sys.modules.pop(name, None)


def test_the_one_module_loss_and_estimator_of_the_design_page_train(design_loss_and_estimator,
                                                                    tmp_path):
  """Nothing but the two modules: selected by name on a stock config, their groups installed
  and validated, and two smoke steps train with them."""
  c = grpo.get_config("smoke")
  assert c.rl.loss.plain.max_log_ratio == 5.0 and c.rl.batch_std.eps == 1e-6
  c.rl.loss.policy, c.rl.estimator = "plain", "batch_std"
  c.rl.reward_signal = c.rl.effective_signal = "score"  # mixed groups in tiny batches
  c.total_steps, c.checkpoint.every, c.eval.every = 2, 2, 100
  configuration.validate(c)
  step_config = configuration.step_config(c)
  assert type(step_config.loss.policy).__name__ == "Plain"
  assert type(step_config.estimator).__name__ == "BatchStd"
  bad = grpo.get_config("smoke")
  bad.rl.loss.plain.max_log_ratio = 0.0
  with pytest.raises(configuration.ConfigError,
                     match=r"config.rl.loss.plain: max_log_ratio must be > 0, got 0.0"):
    configuration.validate(bad)
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(c, workdir)
  steps = [r for r in metrics.read_metrics(workdir) if "loss" in r]
  assert len(steps) == 2 and all(np.isfinite(r["loss"]) for r in steps)
  assert steps[-1]["clip_frac_high"] == 0.0


@pytest.fixture
def design_rule(tmp_path, monkeypatch):
  """The page's allocation rule and its config file, importable as if they were in the tree."""
  blocks = _design_blocks()
  module_path, config_path = "grpo_jax/allocation/first_success.py", "configs/first_success.py"
  assert set(blocks) >= {module_path, config_path}
  for folder, path in (("allocation", module_path), ("configs", config_path)):
    (tmp_path / folder).mkdir()
    (tmp_path / folder / path.rsplit("/", 1)[1]).write_text(blocks[path])
  for package, folder in ((allocation, "allocation"),
                          (importlib.import_module("configs"), "configs")):
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path / folder)])
  monkeypatch.setattr(allocation.RULES, "_loaded", False)
  entries = dict(allocation.RULES._entries)  # pylint: disable=protected-access
  monkeypatch.setattr(allocation.RULES, "_entries", entries)
  yield importlib.import_module("configs.first_success")
  for name in ("grpo_jax.allocation.first_success", "configs.first_success"):
    sys.modules.pop(name, None)


def test_the_one_module_allocation_rule_of_the_design_page_trains(design_rule, tmp_path):
  """Nothing but the module and the config file: its verdicts by hand, its group validated, and
  a smoke step in rounds and one on the slot pool, each counting what it spent."""
  from tests.allocation.test_allocation import _scored  # pylint: disable=g-import-not-at-top
  c = design_rule.get_config("smoke")
  assert c.allocation.first_success.max_failures == 3
  rule = allocation.RULES.get("first_success")().rule(group_size=4)
  assert rule.first_rows == 1
  # No success in 1 or 2 rows: one more; a success: COMMIT; 3 failures (max_failures): DROP.
  assert [rule.verdict(_scored(s), 4) for s in ([0], [0, 0], [0, 1], [0, 0, 0])] == [
      allocation.Verdict.more(1), allocation.Verdict.more(1), allocation.COMMIT,
      allocation.DROP]
  # G = 2 (smoke) and 2 failures: dropped, although max_failures is 3.
  assert rule.verdict(_scored([0, 0]), 2) == allocation.DROP
  bad = design_rule.get_config("smoke")
  bad.allocation.first_success.max_failures = 0
  with pytest.raises(configuration.ConfigError,
                     match="config.allocation.first_success: max_failures must be >= 1, got 0"):
    configuration.validate(bad)
  for name, config in (("rounds", c), ("pool", design_rule.get_config("smoke,partial"))):
    config.total_steps, config.checkpoint.every = 1, 1
    workdir = str(tmp_path / name)
    train.train_and_evaluate(config, workdir)
    steps = [r for r in metrics.read_metrics(workdir) if "loss" in r]
    assert len(steps) == 1, name
    # Something was decided, and what trained was kept this (first) step: G = 2 rows per kept
    # group at most.
    (r,) = steps
    assert r["alloc/kept"] + r["alloc/given_up"] > 0, (name, r)
    assert r["alloc/rollouts_in_update"] <= 2 * r["alloc/kept"], (name, r)
    if name == "rounds":  # one-row probes, then completions: more rounds than uniform's one
      assert r["alloc/rounds"] > 1, r
