"""Model families (``family.FAMILIES``, by Hugging Face ``model_type``), the ``CausalLM``
interface the rest of the package uses, and Hugging Face checkpoint I/O."""

from grpo_jax.errors import CheckpointError
from grpo_jax.models.causal_lm import CausalLM, positions_from_mask
from grpo_jax.models.family import FAMILIES, Family
from grpo_jax.models.hf import from_pretrained, save_pretrained
from grpo_jax.models.kv_cache import KVCache
from grpo_jax.models.model_config import ModelConfig
from grpo_jax.models.qwen3 import Qwen3

__all__ = ["FAMILIES", "CausalLM", "CheckpointError", "Family", "KVCache", "ModelConfig",
           "Qwen3", "from_pretrained", "positions_from_mask", "save_pretrained"]
