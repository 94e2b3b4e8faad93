"""Moved into the package: ``grpo_jax.schema`` (``base_config``, ``Preset``, ``apply_presets``,
``COMMON``, ``LORA_LR_SCALE``), so that the schema and its presets load from any directory.

Kept for one release so that config files written against it (``from configs import common``,
``common.base_config()``) still run; new files import ``grpo_jax.schema`` (docs/CHANGELOG.md).
"""

from grpo_jax.schema import (COMMON, LORA_LR_SCALE, Preset, apply_presets,  # noqa: F401
                             base_config, known)
