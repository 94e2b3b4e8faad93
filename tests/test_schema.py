"""The config's schema in the package (``grpo_jax.schema``): the method files found by name or
path from any directory, and the old module kept for the files written against it."""

import os

import pytest

from configs import common, popo
from grpo_jax import schema
from grpo_jax.schema import files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_method_file_loads_by_name_or_path_from_any_directory(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # neither the repository nor its configs/ is here
  want = popo.get_config("kl,smoke").to_json(sort_keys=True)
  assert files.load("popo:kl,smoke").to_json(sort_keys=True) == want
  assert files.load(f"{ROOT}/configs/popo.py:kl,smoke").to_json(sort_keys=True) == want
  assert files.path_of("popo") == os.path.join(ROOT, "configs", "popo.py")
  assert files.module("popo") is files.module(os.path.join(ROOT, "configs", "popo.py"))


@pytest.mark.parametrize("name,says", [("nosuch", "the method files are in the repository's "
                                                  "configs/"),
                                       ("sub/nosuch.py", "not found")])
def test_an_unknown_config_file_is_one_line(tmp_path, monkeypatch, name, says):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(FileNotFoundError, match=says) as e:
    files.load(name + ":smoke")
  assert "\n" not in str(e.value)


def test_the_old_module_is_the_package_s_schema():
  # Config files written against configs/common.py build the same config.
  assert common.base_config is schema.base_config and common.COMMON is schema.COMMON
  assert common.apply_presets(common.base_config(), "smoke").to_json() == (
      schema.apply_presets(schema.base_config(), "smoke").to_json())


def test_validation_returns_each_group_typed_once():
  """``configuration.validate`` hands back what it parsed, typed (``settings.Settings``): the
  same objects the builders would otherwise parse again from the raw config."""
  from grpo_jax import allocation, configuration, sharding  # pylint: disable=g-import-not-at-top
  from grpo_jax import settings as settings_lib  # pylint: disable=g-import-not-at-top
  from grpo_jax.models import lora  # pylint: disable=g-import-not-at-top
  from grpo_jax.rl import optim  # pylint: disable=g-import-not-at-top
  c = files.load("sara:smoke,partial,dps")
  c.mesh.fsdp, c.rollout.generation_mesh.tensor = 1, 2
  settings = configuration.validate(c)
  assert settings.step == configuration.step_config(c)
  assert settings.step.continued  # :partial's rows continue under the decoupled correction
  assert settings.replay == configuration.replay_method(c)
  assert settings.rule == allocation.spec(allocation.RULES, c.allocation, "sara")
  assert settings.rule.probes == 2  # smoke: probes fit the group of 2
  assert settings.selector == allocation.spec(allocation.SELECTORS, c.allocation, "dps")
  assert settings.mesh == sharding.MeshConfig(data=-1, fsdp=1, tensor=1)
  assert settings.generation_mesh == sharding.MeshConfig(data=-1, fsdp=1, tensor=2)
  assert settings.uses_pool and settings.generation_devices == 0
  # opt's keys, the run's length only for a cosine schedule, and the updates a step makes
  # (smoke: 2 minibatches x 1 epoch).
  assert settings.optimizer == optim.OptimizerSettings(
      c.opt.schedule, c.opt.learning_rate, c.opt.warmup_steps, 0, c.opt.grad_clip, c.opt.b1,
      c.opt.b2, c.opt.weight_decay, 2)
  m = c.model
  assert settings.model == settings_lib.ModelSettings(
      m.path, m.param_dtype, m.dtype, m.attention, m.attention_block, None, c.seed)
  static = configuration.validate(files.load("grpo:smoke,lora=4"))
  assert not static.uses_pool and not static.step.continued
  # LoRA: the base is stored in the compute dtype (it never updates), the adapters' config.
  lo = files.load("grpo:smoke,lora=4").model.lora
  assert static.model.lora == lora.LoraConfig(4, lo.alpha, lo.targets)
  assert static.model.param_dtype == static.model.dtype
