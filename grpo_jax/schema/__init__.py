"""The config's schema: the keys and defaults of a run, the presets, and the config files.

``defaults.base_config()`` (every key, its default and its meaning), ``presets`` (``Preset``,
``apply_presets``, ``COMMON``: the named changes after ':' in ``--config=FILE:PRESETS``) and
``files.load("popo:kl")`` (a method's file in ``configs/`` or any file, by name or path). The
files in ``configs/`` are what users edit: one per method, its presets beside it, each starting
from ``base_config()``. ``grpo_jax.configuration`` validates what they build.
"""

from grpo_jax.schema.defaults import base_config
from grpo_jax.schema.presets import COMMON, LORA_LR_SCALE, Preset, apply_presets, known

__all__ = ["COMMON", "LORA_LR_SCALE", "Preset", "apply_presets", "base_config", "known"]
