"""The fixed-size key/value cache of a grouped-query decoder (shape letters: ``types.py``)."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from grpo_jax.sharding import constrain


@flax.struct.dataclass
class KVCache:
  """Fixed-size key/value cache shared by all layers.

  Keys are stored transposed, [N, K, W, S], and values [N, K, S, W]: both products of a
  decode step, q [N, K, Q, W] @ keys [N, K, W, S] and probs [N, K, Q, S] @ values
  [N, K, S, W], are then plain batched matmuls over (N, K) that read the cache in its own
  layout, with no transposed copy of S slots per token (the [N, S, K, W] layout cost a copy
  of the whole cache per layer and token; docs/benchmarks.md: Step speed).

  Attributes:
    k: per layer, keys [N, K, W, S] (post-RoPE, post-norm).
    v: per layer, values [N, K, S, W].
    key_mask_NxS: True where a slot holds a real token (False for left padding and unwritten
      slots).
    index: int32, the next slot to write: a scalar, the same for every row, or [N], each row's
      own (a slot pool, ``generate.pool``: rows at every position; X = 1 passes only).
  """

  k: tuple
  v: tuple
  key_mask_NxS: jax.Array
  index: jax.Array

  @classmethod
  def init(cls, config, batch: int, size: int) -> "KVCache":
    """An empty cache of ``size`` slots for ``batch`` rows.

    Args:
      config: the model's config (``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype``).
      batch: N.
      size: S.
    """
    k_shape = (batch, config.num_kv_heads, config.head_dim, size)
    v_shape = (batch, config.num_kv_heads, size, config.head_dim)
    # Rows split like the batch, key/value heads like the k/v projections (under a mesh).
    zeros = lambda shape: constrain(jnp.zeros(shape, jnp.dtype(config.dtype)),
                                    ("batch", "kv_heads", None, None))
    return cls(k=tuple(zeros(k_shape) for _ in range(config.num_layers)),
               v=tuple(zeros(v_shape) for _ in range(config.num_layers)),
               key_mask_NxS=jnp.zeros((batch, size), bool),
               index=jnp.zeros((), jnp.int32))

  @property
  def size(self) -> int:
    return self.key_mask_NxS.shape[1]
