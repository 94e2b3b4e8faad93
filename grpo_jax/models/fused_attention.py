"""The accelerator attention kernels: cuDNN flash attention (GPU) and Pallas splash (TPU).

Both compute the square causal case only, query x over keys s <= x of the same row with a key
mask of left padding (shape letters: ``types.py``); ``attention.self_attention`` sends every
other case (cache prefill and decode, a non-square continuation) to ``flash.flash_attention``.
Neither can run on a CPU: their parity with ``blocked`` is checked by
``grpo_jax.bench.accelerator`` on the device (tests/test_attention.py skips it elsewhere).

* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, [N, S, H, W] layout,
  grouped-query heads native, bf16/fp16 only. cuDNN's padding mask takes per-row lengths of
  *right*-padded rows, and it ignores segment ids (MaxText issue 4476), so each left-padded row
  is rolled left by its padding first (query x' = x - pad sees key s' = s - pad <= x': the
  causal order is unchanged, RoPE was applied before) and the output rolled back.
* ``splash``: the Pallas TPU splash kernel (as tunix uses it), a causal mask, left padding as
  segment ids (pad tokens segment 0, real tokens 1: a real query never sees a pad key), keys
  and values repeated to all H heads, S padded to a multiple of 128.

Not yet done (no device has run these): under a mesh the splash call is not wrapped in
``shard_map``, so XLA cannot split the Pallas kernel over the batch and gathers its inputs
(correct, but one device's worth of rows at a time is what a TPU pod run would need; tunix
wraps it); JAX's cuDNN call carries its own batch/head partitioning rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_SPLASH_BLOCK = 128


def cudnn_supported(q_NxSxKxQxW) -> bool:
  """Shapes and dtypes the cuDNN fused kernel takes (else the caller falls back to blocked)."""
  return (q_NxSxKxQxW.dtype in (jnp.bfloat16, jnp.float16) and q_NxSxKxQxW.shape[-1] % 8 == 0
          and q_NxSxKxQxW.shape[-1] <= 128)


def _roll_rows(a_NxS, shift_N):
  """Row n of a [N, S, ...] array rolled by shift_N[n] along S (a gather)."""
  s = a_NxS.shape[1]
  idx = (jnp.arange(s)[None, :] - shift_N[:, None]) % s
  return jnp.take_along_axis(a_NxS, idx.reshape(idx.shape + (1,) * (a_NxS.ndim - 2)), axis=1)


def cudnn_attention(q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW, key_mask_NxS,
                    implementation: str = "cudnn"):
  """Square causal attention on cuDNN. Returns [N, S, K, Q, W] in the values' dtype.

  ``implementation="xla"`` runs the same call (rolls, lengths) on JAX's reference kernel: the
  CPU test of everything here but cuDNN itself.
  """
  n, s, kh, qh, w = q_NxSxKxQxW.shape
  key_mask_NxS = key_mask_NxS.astype(bool)
  lengths_N = jnp.sum(key_mask_NxS, axis=1, dtype=jnp.int32)
  pad_N = s - lengths_N  # rows are left padded: the real tokens are the last ``lengths``
  left = lambda a: _roll_rows(a, -pad_N)
  out = jax.nn.dot_product_attention(
      left(q_NxSxKxQxW.reshape(n, s, kh * qh, w)), left(k_NxSxKxW), left(v_NxSxKxW),
      is_causal=True, query_seq_lengths=lengths_N, key_value_seq_lengths=lengths_N,
      implementation=implementation)
  return _roll_rows(out, pad_N).reshape(n, s, kh, qh, w)


def _splash_kernel(num_heads: int, length: int, interpret: bool):
  """The splash kernel for H heads of ``length`` (built per trace: the kernel object holds
  arrays, and one cached across traces would leak a trace's values into the next)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as kernel, splash_attention_mask as mask_lib)
  mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length))] * num_heads)
  block = min(_SPLASH_BLOCK * 4, length)
  sizes = kernel.BlockSizes(block_q=block, block_kv_compute=block, block_kv=block,
                            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                            block_q_dq=block, block_kv_dq=block)
  return kernel.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                interpret=interpret), kernel.SegmentIds


def splash_attention(q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW, key_mask_NxS, interpret: bool = False):
  """Square causal attention with the Pallas TPU splash kernel.

  ``interpret`` runs the kernel in Pallas' interpreter (any backend; slow, for checking).

  Returns:
    [N, S, K, Q, W] in the values' dtype.
  """
  n, s, kh, qh, w = q_NxSxKxQxW.shape
  pad = -s % _SPLASH_BLOCK
  padded = lambda a: jnp.pad(a, ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
  length = s + pad
  heads = lambda a: jnp.moveaxis(a, 2, 1)  # [N, S', H, W] -> [N, H, S', W]
  q = heads(padded(q_NxSxKxQxW * (w ** -0.5)).reshape(n, length, kh * qh, w))
  k = heads(jnp.repeat(padded(k_NxSxKxW), qh, axis=2))
  v = heads(jnp.repeat(padded(v_NxSxKxW), qh, axis=2))
  segments = padded(key_mask_NxS.astype(jnp.int32))
  kernel, segment_ids = _splash_kernel(kh * qh, length, interpret)
  out = jax.vmap(lambda q, k, v, seg: kernel(q, k, v, segment_ids=segment_ids(seg, seg)))(
      q, k, v, segments)
  return jnp.moveaxis(out, 1, 2)[:, :s].reshape(n, s, kh, qh, w).astype(v_NxSxKxW.dtype)
