"""The accelerator attention kernels: cuDNN flash attention (GPU) and Pallas splash (TPU).

Both compute the square causal case only, query x over keys s <= x of the same row whose key
mask is True (shape letters: ``types.py``); ``attention.self_attention`` sends every other case
(cache prefill and decode, a non-square continuation) to ``flash.flash_attention``. Both return
0 at every padded position (key mask False), as query and as key: output 0 and no gradient
there, whatever the kernel computes for it (``blocked`` agrees on every other position, and at
left padding, where a query sees no key, on that too). Neither can run on a CPU: their parity
with ``blocked`` is checked by ``grpo_jax.bench.accelerator`` on the device (here
tests/models/test_attention.py runs splash in Pallas' interpreter and the cuDNN wrapper on JAX's
reference kernel).

* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")``, [N, S, H, W] layout,
  grouped-query heads native, bf16/fp16 only. cuDNN's padding mask takes per-row lengths of
  *right*-padded rows, and it ignores segment ids (MaxText issue 4476), so each row's real
  tokens, one contiguous run (left, right or both-sides padding), are rolled to the front first
  (query x' = x - first sees key s' = s - first <= x': the causal order is unchanged, RoPE was
  applied before) and the output rolled back. A mask with a hole in its run is not supported
  (the mask is traced: nothing can refuse it).
* ``splash``: the Pallas TPU splash kernel (as tunix uses it), a causal mask, the key mask as
  segment ids (pad tokens segment 0, real tokens 1: a real query never sees a pad key, for any
  mask), keys and values repeated to all H heads, S padded to a multiple of 128 and cut into
  blocks of the largest of 512, 256, 128 that divides it (``splash_block``).

Not yet done (no device has run these): under a mesh the splash call is not wrapped in
``shard_map``, so XLA cannot split the Pallas kernel over the batch and gathers its inputs
(correct, but one device's worth of rows at a time is what a TPU pod run would need; tunix
wraps it); JAX's cuDNN call carries its own batch/head partitioning rules.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Splash needs S padded to a multiple of 128 and a block that divides it; of the blocks that
# divide it, the largest of these (fewer grid steps than splash's default of 128).
_SPLASH_MULTIPLE = 128
_SPLASH_BLOCKS = (512, 256, 128)


def cudnn_supported(q_NxSxKxQxW) -> bool:
  """Shapes and dtypes the cuDNN fused kernel takes (else the caller falls back to blocked)."""
  return (q_NxSxKxQxW.dtype in (jnp.bfloat16, jnp.float16) and q_NxSxKxQxW.shape[-1] % 8 == 0
          and q_NxSxKxQxW.shape[-1] <= 128)


def _gather_roll(a_NxS, shift_N):
  s = a_NxS.shape[1]
  idx = (jnp.arange(s)[None, :] - shift_N[:, None]) % s
  return jnp.take_along_axis(a_NxS, idx.reshape(idx.shape + (1,) * (a_NxS.ndim - 2)), axis=1)


@jax.custom_vjp
def _roll_rows(a_NxS, shift_N):
  """Row n of a [N, S, ...] array rolled by shift_N[n] along S (a gather).

  A roll is a permutation, so its gradient is the inverse roll: another gather, where
  autodiff of the gather would scatter-add the cotangent (slow on GPUs, serialised on
  colliding indices it cannot rule out).
  """
  return _gather_roll(a_NxS, shift_N)


def _roll_forward(a_NxS, shift_N):
  return _gather_roll(a_NxS, shift_N), shift_N


def _roll_backward(shift_N, g_NxS):
  return _gather_roll(g_NxS, -shift_N), None


_roll_rows.defvjp(_roll_forward, _roll_backward)


def _real_run(key_mask_NxS):
  """(first_N, length_N) int32: where each row's run of real tokens starts, and its length (a
  row with none: 0, 0)."""
  first_N = jnp.argmax(key_mask_NxS, axis=1).astype(jnp.int32)  # the first True, 0 if none
  return first_N, jnp.sum(key_mask_NxS, axis=1, dtype=jnp.int32)


def cudnn_attention(q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW, key_mask_NxS,
                    implementation: str = "cudnn"):
  """Square causal attention on cuDNN. Returns [N, S, K, Q, W] in the values' dtype.

  Each row's real tokens (key mask True) must be one contiguous run, anywhere in the row.
  Outputs and input gradients at padded positions are 0: cuDNN's at rows past a row's lengths
  are not specified (its masked rows may be left unwritten), and one NaN there would reach the
  next layer (0 x NaN) and the step's gradients. Zeroing costs four selects over [N, S, H, W].

  ``implementation="xla"`` runs the same call (rolls, lengths) on JAX's reference kernel: the
  CPU test of everything here but cuDNN itself.
  """
  n, s, kh, qh, w = q_NxSxKxQxW.shape
  real_NxS = key_mask_NxS.astype(bool)
  first_N, lengths_N = _real_run(real_NxS)
  # The inputs' padded positions as zeros: a select whose gradient is 0 there, whatever cuDNN's
  # backward leaves at the rows past the lengths.
  real = lambda a: jnp.where(real_NxS.reshape((n, s) + (1,) * (a.ndim - 2)), a, 0)
  front = lambda a: _roll_rows(real(a), -first_N)  # the run at slots 0 .. length - 1
  out = jax.nn.dot_product_attention(
      front(q_NxSxKxQxW).reshape(n, s, kh * qh, w), front(k_NxSxKxW), front(v_NxSxKxW),
      is_causal=True, query_seq_lengths=lengths_N, key_value_seq_lengths=lengths_N,
      implementation=implementation)
  return real(_roll_rows(out, first_N)).reshape(n, s, kh, qh, w)


def splash_length(s: int) -> int:
  """The length splash runs S positions at: S padded to a multiple of 128."""
  return -(-s // _SPLASH_MULTIPLE) * _SPLASH_MULTIPLE


def splash_block(length: int) -> int:
  """The block splash cuts ``length`` (a ``splash_length``) into, every kind of block alike: the
  largest of 512, 256, 128 that divides it (splash refuses a block that does not divide the
  length: 640, 1152 and 1280 take 128, 128 and 256).

  Padding the length to a multiple of 512 instead would spend compute on up to 384 padded
  positions, each a query over every key (1280 positions, the qwen3 presets' 256 + 1024: 1536,
  and ~1.4x the causal work); a smaller block only adds grid steps."""
  return next(b for b in _SPLASH_BLOCKS if length % b == 0)


def _splash_kernel(num_heads: int, length: int, interpret: bool):
  """The splash kernel for H heads of ``length`` (built per trace: the kernel object holds
  arrays, and one cached across traces would leak a trace's values into the next)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as kernel, splash_attention_mask as mask_lib)
  mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((length, length))] * num_heads)
  block = splash_block(length)
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
  length = splash_length(s)
  padded = lambda a: jnp.pad(a, ((0, 0), (0, length - s)) + ((0, 0),) * (a.ndim - 2))
  heads = lambda a: jnp.moveaxis(a, 2, 1)  # [N, S', H, W] -> [N, H, S', W]
  q = heads(padded(q_NxSxKxQxW * (w ** -0.5)).reshape(n, length, kh * qh, w))
  k = heads(jnp.repeat(padded(k_NxSxKxW), qh, axis=2))
  v = heads(jnp.repeat(padded(v_NxSxKxW), qh, axis=2))
  segments = padded(key_mask_NxS.astype(jnp.int32))
  kernel, segment_ids = _splash_kernel(kh * qh, length, interpret)
  out = jax.vmap(lambda q, k, v, seg: kernel(q, k, v, segment_ids=segment_ids(seg, seg)))(
      q, k, v, segments)
  out = jnp.moveaxis(out, 1, 2)[:, :s].reshape(n, s, kh, qh, w).astype(v_NxSxKxW.dtype)
  # Padded queries (segment 0) attend to padded keys: finite, unused, zeroed as cuDNN's are.
  return jnp.where(key_mask_NxS.astype(bool)[:, :, None, None, None], out, 0)
