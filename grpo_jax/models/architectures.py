"""Published Qwen3 architectures, for abstract benchmarks that need shapes but no weights.

Training always reads the architecture from the checkpoint's ``config.json``; these are the
values of the Hugging Face ``Qwen/Qwen3-*`` config.json files (Qwen3 Technical Report, arXiv
2505.09388, Table 1: dense models with 128-dimensional heads, 8 key/value heads, tied
embeddings up to 4B), named like the config presets (``grpo_jax/schema/presets.py``).
"""

from __future__ import annotations

from grpo_jax.models.model_config import ModelConfig

_COMMON = dict(vocab_size=151_936, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0,
               rms_norm_eps=1e-6, qk_norm=True, qkv_bias=False)

ARCHITECTURES = {
    "qwen3_0p6b": dict(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                       tie_word_embeddings=True),
    "qwen3_1p7b": dict(hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16,
                       tie_word_embeddings=True),
    "qwen3_4b": dict(hidden_size=2560, intermediate_size=9728, num_layers=36, num_heads=32,
                     tie_word_embeddings=True),
    "qwen3_8b": dict(hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                     tie_word_embeddings=False),
}


def architecture(name: str, *, param_dtype: str = "float32",
                 dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a published architecture.

  Raises:
    ValueError: an unknown name (lists the known ones).
  """
  if name not in ARCHITECTURES:
    raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
  return ModelConfig(**_COMMON, **ARCHITECTURES[name], param_dtype=param_dtype, dtype=dtype)
