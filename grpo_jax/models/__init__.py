"""Model families and Hugging Face checkpoint I/O."""

from grpo_jax.models.hf import CheckpointError, from_pretrained, save_pretrained
from grpo_jax.models.qwen3 import KVCache, ModelConfig, Qwen3, positions_from_mask

__all__ = ["CheckpointError", "KVCache", "ModelConfig", "Qwen3", "from_pretrained",
           "positions_from_mask", "save_pretrained"]
