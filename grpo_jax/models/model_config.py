"""The architecture of a Qwen3-family decoder (Qwen3, Qwen2, Qwen2.5): its sizes, norms and
biases, dtypes and attention kernel, checked when made.

``models/qwen3.py`` builds the modules from it; ``models/qwen3_checkpoint.py`` reads it from
and writes it to a Hugging Face ``config.json``. Shape letters: ``types.py``.
"""

from __future__ import annotations

import dataclasses

from grpo_jax.models import causal_lm
from grpo_jax.models.attention import IMPLEMENTATIONS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Qwen3-family decoder.

  Attributes:
    vocab_size: V, rows of the embedding table.
    hidden_size: D, model width.
    intermediate_size: F, SwiGLU hidden width.
    num_layers: L, number of decoder blocks.
    num_heads: H, query heads.
    num_kv_heads: K, key/value heads (grouped-query attention); H % K == 0.
    head_dim: W, width of one head (Qwen3 sets it explicitly; Qwen2 uses D // H).
    rope_theta: rotary base frequency.
    rms_norm_eps: epsilon inside every RMSNorm.
    tie_word_embeddings: output head shares the embedding table.
    qkv_bias: q/k/v projections carry a bias (Qwen2/2.5).
    qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
    param_dtype: storage dtype of parameters ("float32" or "bfloat16").
    dtype: compute dtype of matmuls ("float32" on CPU, "bfloat16" on accelerators).
    attention: the attention kernel of every pass (``attention.IMPLEMENTATIONS``: auto, xla,
      blocked, cudnn, splash; ``models/attention.py`` says what each is).
    attention_block: queries and keys per block of the ``blocked`` kernel.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  qk_norm: bool = True
  param_dtype: str = "float32"
  dtype: str = "float32"
  attention: str = "auto"
  attention_block: int = 256

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim"):
      if int(getattr(self, name)) <= 0:
        raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                       f"num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
    if self.attention not in IMPLEMENTATIONS:
      raise ValueError(f"ModelConfig.attention must be one of {', '.join(IMPLEMENTATIONS)}, "
                       f"got {self.attention!r}")
    if int(self.attention_block) <= 0:
      raise ValueError(f"ModelConfig.attention_block must be positive, got "
                       f"{self.attention_block}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in causal_lm.DTYPES:
        raise ValueError(f"ModelConfig.{name} must be one of {', '.join(causal_lm.DTYPES)}, "
                         f"got {getattr(self, name)!r}")

  def replace(self, **kwargs) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  @property
  def model_type(self) -> str:
    """The Hugging Face model type this architecture saves as: Qwen3 has q/k norm."""
    return "qwen3" if self.qk_norm else "qwen2"

  @property
  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    d, f, w = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * w * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.qkv_bias:
      attn += w * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * w
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.num_layers * layer + d + head
