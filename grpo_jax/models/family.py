"""Model families: ``model_type`` -> what loading, saving and sharding need to know of one.

A family is its own module(s) under ``grpo_jax/models`` that register a ``Family`` under each
Hugging Face ``config.json`` ``model_type`` it reads::

    FAMILIES.register("qwen3")(QWEN3_FAMILY)

``hf.from_pretrained`` dispatches on ``model_type`` through ``FAMILIES``; ``sharding`` lays
parameters out by the families' ``param_axes``. The registry imports every module of this
package on first lookup, so nothing else lists the families.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

from grpo_jax import registry
from grpo_jax.errors import CheckpointError
from grpo_jax.models.causal_lm import CausalLM

# (module name, parameter name) -> logical axes of each dimension (``sharding.LOGICAL_RULES``;
# None: that dimension is replicated).
ParamAxes = Mapping[tuple[str, str], tuple[Optional[str], ...]]


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family: its config, model, checkpoint mapping and parameter layout.

  Attributes:
    config_from_hf: ``(config.json dict, *, param_dtype, dtype) -> config`` (the family's
      config, an ``LMConfig``); raises ``CheckpointError`` for what it does not support.
    config_to_hf: ``config -> transformers config`` (``save_pretrained`` writes it).
    build: ``(config, *, rngs) -> CausalLM`` with random parameters.
    hf_name: ``parameter path -> (Hugging Face tensor name, transpose)``: the checkpoint
      mapping both ways (``transpose`` when Hugging Face stores the array transposed). A
      parameter of the stacked decoder layers is named per layer, by the path of its slice
      (``causal_lm.layer_path``: ``('layers', 3, 'mlp', 'up_proj', 'kernel')``).
    param_axes: the logical axes of every parameter, by (module, parameter) name; those of the
      stacked decoder layers lead with the layer axis.
  """

  config_from_hf: Callable[..., Any]
  config_to_hf: Callable[[Any], Any]
  build: Callable[..., CausalLM]
  hf_name: Callable[[tuple], tuple[str, bool]]
  param_axes: ParamAxes


FAMILIES: registry.Registry[Family] = registry.Registry("model family",
                                                         package="grpo_jax.models")


def param_axes() -> dict:
  """Every registered family's ``param_axes`` in one table (the default of ``sharding``).

  Raises:
    ValueError: two families give one (module, parameter) name different axes.
  """
  table, owner = {}, {}
  for name, family in FAMILIES.items():
    for key, axes in family.param_axes.items():
      if table.setdefault(key, axes) != axes:
        raise ValueError(f"model families {owner[key]!r} and {name!r} give parameter "
                         f"{'.'.join(key)} different axes ({table[key]} and {axes})")
      owner.setdefault(key, name)
  return table


def family_for(model_type, architectures=None) -> Family:
  """The registered family of a ``config.json`` ``model_type``.

  Raises:
    CheckpointError: an unknown model type (one line naming the known ones).
  """
  if model_type not in FAMILIES:
    raise CheckpointError(f"unsupported architecture: model_type={model_type!r} "
                          f"(architectures={architectures}); supported model types: "
                          f"{', '.join(FAMILIES.names())}")
  return FAMILIES.get(model_type)
