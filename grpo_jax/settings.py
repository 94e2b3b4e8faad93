"""What validating a run config gives: its groups typed, each parsed once.

``configuration.validate(config)`` checks every group and returns a ``Settings``; ``run.build``
hands each builder its own typed part (the mesh layouts to ``sharding``, the replay method to
the buffer, the rule and selector specs to ``allocation``, the train step's static settings to
``rl.step``, the optimiser's to ``rl.optim``, the model's to ``run.build.load_model``) instead of the raw config, so nothing is parsed twice and no builder re-reads a
group another owns.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_jax import sharding
from grpo_jax.models import lora
from grpo_jax.rl.optim import OptimizerSettings
from grpo_jax.rl.step_config import StepConfig


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """``config.model``, as ``run.build.load_model`` reads it.

  Attributes:
    path: the Hugging Face folder.
    param_dtype: the stored parameters' dtype (the compute dtype under LoRA: the base never
      updates).
    dtype: the compute dtype.
    attention: the attention kernel's name; attention_block its block.
    attention_block: (see attention).
    lora: the adapters (``lora.LoraConfig``), None for full fine-tuning.
    seed: the run's seed (the adapters' initial draw).
  """

  path: str
  param_dtype: str
  dtype: str
  attention: str
  attention_block: int
  lora: lora.LoraConfig | None
  seed: int

  @classmethod
  def from_config(cls, config) -> ModelSettings:
    m = config.model
    adapters = lora.from_config(m)
    return cls(path=m.path, param_dtype=m.dtype if adapters else m.param_dtype, dtype=m.dtype,
               attention=m.attention, attention_block=int(m.attention_block), lora=adapters,
               seed=int(config.seed))


@dataclasses.dataclass(frozen=True)
class Settings:
  """A validated config's typed groups.

  Attributes:
    mesh: ``config.mesh``: the training devices' layout.
    generation_mesh: ``config.rollout.generation_mesh``: the generation devices' layout.
    generation_devices: ``config.rollout.devices`` (0: generation on the training devices).
    uses_pool: rows come from the slot pool (``rollout.partial``, or generation on its own
      devices).
    replay: the replay method (``rl.replay.method.ReplayMethod``) of ``config.replay``.
    rule: the allocation rule's spec (``allocation.rule.RuleSpec``) of ``config.allocation``.
    selector: the prompt selector's spec of ``config.allocation``.
    step: the train step's static settings (``StepConfig``).
    optimizer: the optimiser's (``rl.optim.OptimizerSettings``).
    model: the policy's (``ModelSettings``).
  """

  mesh: sharding.MeshConfig
  generation_mesh: sharding.MeshConfig
  generation_devices: int
  uses_pool: bool
  replay: Any
  rule: Any
  selector: Any
  step: StepConfig
  optimizer: OptimizerSettings
  model: ModelSettings
