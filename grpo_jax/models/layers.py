"""Building blocks of a decoder in Flax NNX: RMSNorm, dense layers, rotary embeddings.

Shape letters: ``types.py``. Parameters are stored in ``param_dtype``, matmuls run in
``dtype``; norms and RoPE are computed in float32. Reference for RoPE: RoFormer
(arXiv 2104.09864), in the "rotate half" layout Hugging Face uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Hugging Face's default ``initializer_range``: random weights of models built without a
# checkpoint (tests, abstract shapes); loading replaces every one.
INIT = nnx.initializers.normal(stddev=0.02)


def rope(x_NxXxHxW: jax.Array, positions_NxX: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in the rotate-half layout (first half pairs with second half).

  Args:
    x_NxXxHxW: queries or keys, H heads (or K) of width W (even).
    positions_NxX: position ids.
    theta: rotary base frequency.
  """
  w = x_NxXxHxW.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, w, 2, dtype=jnp.float32) / w))
  angles = positions_NxX.astype(jnp.float32)[..., None] * inv_freq  # [N, X, W / 2]
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  x = x_NxXxHxW.astype(jnp.float32)
  x1, x2 = x[..., : w // 2], x[..., w // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_NxXxHxW.dtype)


class RMSNorm(nnx.Module):
  """RMSNorm computed in float32, scaled by a learned weight (initialised to one)."""

  def __init__(self, dim: int, eps: float, *, param_dtype, dtype):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(self.dtype) * normed.astype(self.dtype)


class Dense(nnx.Module):
  """y = x @ kernel (+ bias), computed on x flattened to 2-D.

  Same parameters as ``nnx.Linear`` (``kernel [in, out]``, ``bias [out]``; in the stacked decoder
  layers [L, in, out] and [L, out], called on one layer's slice), but every leading axis of x is
  folded into one matmul row axis first: XLA:CPU lowers the backward pass of a
  [N, S, D] x [D, F] dot (two contracting axes for the weight gradient) far slower than the
  plain 2-D GEMM (measured 1.8x on the SwiGLU MLP at N * S = 12288; docs/benchmarks.md).
  """

  def __init__(self, din: int, dout: int, *, use_bias: bool, dtype, param_dtype,
               rngs: nnx.Rngs):
    self.kernel = nnx.Param(INIT(rngs.params(), (din, dout), param_dtype))
    self.bias = nnx.Param(jnp.zeros((dout,), param_dtype)) if use_bias else None
    self.dtype = dtype
    # Low-rank adapters (``lora.Adapter``: the factors and their scale), set by
    # ``lora.attach``; None: a plain dense layer.
    self.lora = nnx.data(None)

  def __call__(self, x):
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(self.dtype)
    y = jnp.dot(x2, self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return self.adapted(x2, y).reshape(*lead, y.shape[-1])

  def adapted(self, x2, y):
    """``y`` [rows, out] of ``x2`` [rows, in] plus the adapter's (alpha / r) (x A) B, if any."""
    if self.lora is None:
      return y
    return y + self.lora(x2).astype(y.dtype)


def fused_dense(x, denses) -> list:
  """``[d(x) for d in denses]`` as one matmul over the kernels concatenated by columns.

  For decoding, where x has one token per row: one [rows, sum of widths] GEMM runs well
  above the speed of several narrow ones on CPU (1.5x measured for SwiGLU's gate and up at
  128 rows; docs/benchmarks.md: Step speed). The concatenation reads only loop-invariant
  parameters, so inside the sampler's loop XLA computes it once, before the loop. Same values as the
  separate products (each output column is the same dot product).
  """
  dtype = denses[0].dtype
  lead = x.shape[:-1]
  kernel = jnp.concatenate([d.kernel[...].astype(dtype) for d in denses], axis=1)
  x2 = x.reshape(-1, x.shape[-1]).astype(dtype)
  y = jnp.dot(x2, kernel)
  if denses[0].bias is not None:
    y = y + jnp.concatenate([d.bias[...].astype(dtype) for d in denses])
  widths = [d.kernel.shape[1] for d in denses]
  splits = [sum(widths[:i + 1]) for i in range(len(widths) - 1)]
  # Adapters (if any) are added per layer, after the shared product.
  return [d.adapted(x2, part).reshape(*lead, part.shape[-1])
          for d, part in zip(denses, jnp.split(y, splits, axis=-1))]
