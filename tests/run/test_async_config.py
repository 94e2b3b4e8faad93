"""``rollout.devices`` and its knobs: each refusal one line, the pool implied, and what one
process on one device can say before anything is built. Runs on 8 fake devices:
``tests/test_async_devices.py``."""

import jax
import pytest

from configs import grpo
from grpo_jax import configuration, sharding


@pytest.mark.parametrize("changes,message", [
    (dict(devices=-1), "rollout.devices: -1 must be an integer >= 0"),
    (dict(devices=True), "rollout.devices: True must be an integer >= 0"),
    (dict(schedule="eager"), "rollout.schedule: 'eager'; known: free, lockstep"),
    (dict(lockstep_chunks=-1), "rollout.lockstep_chunks: -1 must be an integer >= 0"),
    (dict(ahead=-1), "rollout.ahead: -1 must be an integer >= 0"),
])
def test_asynchronous_knobs_are_refused_in_one_line(changes, message):
  c = grpo.get_config("async=2")
  c.rollout.update(**changes)
  with pytest.raises(configuration.ConfigError, match=message) as e:
    configuration.validate(c)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("presets,message", [
    ("smoke,partial,lockstep=3", "rollout.schedule: 'lockstep' acts only with generation on "
     "its own devices"),
    ("smoke,partial,ahead=2", "rollout.ahead: 2 acts only with generation on its own devices"),
])
def test_asynchronous_knobs_without_generation_devices_are_refused_in_one_line(presets, message):
  # Colocated partial rollouts have no generator for a schedule or a lead to act on: the
  # review's `grpo.py:smoke,partial,lockstep=3,ahead=2` validated and did nothing.
  c = grpo.get_config(presets)
  with pytest.raises(configuration.ConfigError, match=message) as e:
    configuration.validate(c)
  assert "\n" not in str(e.value)
  c.rollout.devices = 1  # the same knobs with a generator are fine
  configuration.validate(c)


def test_a_bad_generation_mesh_names_its_own_keys():
  c = grpo.get_config("async=2")
  c.rollout.generation_mesh.update(data=-1, tensor=-1)
  with pytest.raises(configuration.ConfigError,
                     match="config.rollout.generation_mesh.tensor: only one mesh axis may be -1"):
    configuration.validate(c)


def test_generation_devices_imply_the_pool_and_its_correction():
  c = grpo.get_config("smoke")
  c.rollout.devices = 1  # rollout.partial stays False: the pool is the queue regardless
  configuration.validate(c)
  assert configuration.uses_pool(c) and configuration.step_config(c).continued
  c.prox.continued = "naive"
  assert not configuration.step_config(c).continued
  assert not configuration.uses_pool(grpo.get_config("smoke"))


def test_devices_that_leave_none_to_train_are_refused_in_one_line():
  c = grpo.get_config("smoke,async=1")  # one device here: none left to train on
  with pytest.raises(sharding.MeshError, match="rollout.devices: 1 generation devices leave "
                     f"none of the {jax.device_count()} to train on") as e:
    sharding.split(sharding.MeshConfig.from_config(c.rollout.generation_mesh),
                   sharding.MeshConfig.from_config(c.mesh), c.rollout.devices)
  assert "\n" not in str(e.value)


def test_multi_process_asynchronous_runs_are_refused_in_one_line(monkeypatch):
  c = grpo.get_config("smoke,async=1")
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(configuration.ConfigError, match="rollout.devices: not yet across 2 "
                     "processes") as e:
    configuration.check_mesh(c, None)
  assert "\n" not in str(e.value)


def test_the_generation_layout_and_schedule_may_change_on_resume_the_split_may_not(tmp_path):
  from grpo_jax import configuration as config_lib  # pylint: disable=g-import-not-at-top
  from grpo_jax.run import workdir as workdir_lib  # pylint: disable=g-import-not-at-top
  c = grpo.get_config("smoke,async=2")
  workdir_lib.check_same_run(c, str(tmp_path))
  c.rollout.generation_mesh.update(data=1, tensor=-1)
  c.rollout.update(schedule="lockstep", lockstep_chunks=3, ahead=0)
  workdir_lib.check_same_run(c, str(tmp_path))  # accepted (and recorded)
  c.rollout.devices = 4
  with pytest.raises(config_lib.ConfigError, match=r"rollout.devices \(2 -> 4\)"):
    workdir_lib.check_same_run(c, str(tmp_path))
