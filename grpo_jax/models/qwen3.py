"""Qwen3-family decoder (Qwen3, Qwen2, Qwen2.5) in Flax NNX, with a fixed-size KV cache.

References: Qwen3 Technical Report (arXiv 2505.09388) for per-head q/k RMSNorm and no q/k/v bias;
Qwen2 Technical Report (arXiv 2407.10671) for q/k/v bias without q/k norm; RoFormer
(arXiv 2104.09864) for rotary embeddings in the "rotate half" layout Hugging Face uses.

Shape letters: B batch, T query tokens, S key slots (cache length), D model width, H query heads,
K key/value heads, G = H // K query heads per key/value head, Dh head dim, F MLP width, V vocab.

Attributes are named like the Hugging Face modules (``layers[i].self_attn.q_proj``) so that the
checkpoint mapping in ``hf.py`` is mechanical. Parameters are stored in ``param_dtype``, matmuls
run in ``dtype``; norms, softmax and logits are computed in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models.attention import (  # re-exported: the kernels live in attention.py
    attention, blocked_attention, cached_attention, decode_attention, grouped_attention)
from grpo_jax.sharding import ambient_tensor_shards, constrain

_INIT = nnx.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Architecture of a Qwen3-family decoder.

  Attributes:
    vocab_size: V, rows of the embedding table.
    hidden_size: D, model width.
    intermediate_size: F, SwiGLU hidden width.
    num_layers: number of decoder blocks.
    num_heads: H, query heads.
    num_kv_heads: K, key/value heads (grouped-query attention); H % K == 0.
    head_dim: Dh, width of one head (Qwen3 sets it explicitly; Qwen2 uses D // H).
    rope_theta: rotary base frequency.
    rms_norm_eps: epsilon inside every RMSNorm.
    tie_word_embeddings: output head shares the embedding table.
    qkv_bias: q/k/v projections carry a bias (Qwen2/2.5).
    qk_norm: per-head RMSNorm on queries and keys before RoPE (Qwen3).
    param_dtype: storage dtype of parameters ("float32" or "bfloat16").
    dtype: compute dtype of matmuls ("float32" on CPU, "bfloat16" on accelerators).
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
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"ModelConfig.{name} must be float32, bfloat16 or float16, "
                         f"got {getattr(self, name)!r}")

  def replace(self, **kwargs) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)

  @property
  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * dh * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.qkv_bias:
      attn += dh * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * dh
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.num_layers * layer + d + head


@flax.struct.dataclass
class KVCache:
  """Fixed-size key/value cache shared by all layers.

  Keys are stored transposed, [B, K, Dh, S], and values [B, K, S, Dh]: both products of a
  decode step, q [B, K, G, Dh] @ keys [B, K, Dh, S] and probs [B, K, G, S] @ values
  [B, K, S, Dh], are then plain batched matmuls over (B, K) that read the cache in its own
  layout, with no transposed copy of S slots per token (the [B, S, K, Dh] layout cost a copy
  of the whole cache per layer and token; docs/benchmarks.md: Step speed).

  Attributes:
    k: per layer, keys [B, K, Dh, S] (post-RoPE, post-norm).
    v: per layer, values [B, K, S, Dh].
    key_mask_BxS: True where a slot holds a real token (False for left padding and unwritten
      slots).
    index: int32 scalar, the next slot to write.
  """

  k: tuple
  v: tuple
  key_mask_BxS: jax.Array
  index: jax.Array

  @classmethod
  def init(cls, config: ModelConfig, batch: int, size: int) -> "KVCache":
    k_shape = (batch, config.num_kv_heads, config.head_dim, size)
    v_shape = (batch, config.num_kv_heads, size, config.head_dim)
    # Rows split like the batch, key/value heads like the k/v projections (under a mesh).
    zeros = lambda shape: constrain(jnp.zeros(shape, jnp.dtype(config.dtype)),
                                    ("batch", "kv_heads", None, None))
    return cls(k=tuple(zeros(k_shape) for _ in range(config.num_layers)),
               v=tuple(zeros(v_shape) for _ in range(config.num_layers)),
               key_mask_BxS=jnp.zeros((batch, size), bool),
               index=jnp.zeros((), jnp.int32))

  @property
  def size(self) -> int:
    return self.key_mask_BxS.shape[1]


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
  """Position ids for left-padded rows: 0 at the first real token, pads clipped to 0."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def prompts_repeat(prompt_ids_NxP: jax.Array, prompt_mask_NxP: jax.Array,
                   group: int) -> jax.Array:
  """True when rows come in runs of ``group`` copies of one prompt (bool scalar, on device).

  GRPO's batches are group-major (G rollouts of each prompt in a row); the sampler's prefill
  and the grouped log-prob pass (``Qwen3.grouped_hidden_states``) then need the prompt once
  per run. False when N is not a multiple of ``group``; True for ``group`` 1.
  """
  n, p = prompt_ids_NxP.shape
  if group <= 1 or n % group:
    return jnp.asarray(group <= 1)
  ids = prompt_ids_NxP.reshape(n // group, group, p)
  mask = prompt_mask_NxP.astype(bool).reshape(n // group, group, p)
  return jnp.all((ids == ids[:, :1]) & (mask == mask[:, :1]))


def rope(x_BxTxNxDh: jax.Array, positions_BxT: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding in the rotate-half layout (first half pairs with second half)."""
  dh = x_BxTxNxDh.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  angles_BxTxHalf = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
  cos = jnp.cos(angles_BxTxHalf)[:, :, None, :]
  sin = jnp.sin(angles_BxTxHalf)[:, :, None, :]
  x = x_BxTxNxDh.astype(jnp.float32)
  x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxDh.dtype)


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

  Same parameters as ``nnx.Linear`` (``kernel [in, out]``, ``bias [out]``), but every leading
  axis is folded into one matmul row axis first: XLA:CPU lowers the backward pass of a
  [B, T, D] x [D, F] dot (two contracting axes for the weight gradient) far slower than the
  plain 2-D GEMM (measured 1.8x on the SwiGLU MLP at B*T = 12288; docs/benchmarks.md).
  """

  def __init__(self, din: int, dout: int, *, use_bias: bool, dtype, param_dtype,
               rngs: nnx.Rngs):
    self.kernel = nnx.Param(_INIT(rngs.params(), (din, dout), param_dtype))
    self.bias = nnx.Param(jnp.zeros((dout,), param_dtype)) if use_bias else None
    self.dtype = dtype

  def __call__(self, x):
    lead = x.shape[:-1]
    y = jnp.dot(x.reshape(-1, x.shape[-1]).astype(self.dtype), self.kernel[...].astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y.reshape(*lead, y.shape[-1])


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
  y = jnp.dot(x.reshape(-1, x.shape[-1]).astype(dtype), kernel)
  if denses[0].bias is not None:
    y = y + jnp.concatenate([d.bias[...].astype(dtype) for d in denses])
  y = y.reshape(*lead, y.shape[-1])
  widths = [d.kernel.shape[1] for d in denses]
  splits = [sum(widths[:i + 1]) for i in range(len(widths) - 1)]
  return jnp.split(y, splits, axis=-1)


def _fuse(x) -> bool:
  """Whether projections reading ``x`` [B, T, D] run as one matmul (``fused_dense``).

  Only for one token per row (decoding, where narrow GEMMs are slow) and without tensor
  parallelism (concatenating kernels split by columns over ``tensor`` would move them).
  """
  return x.shape[1] == 1 and ambient_tensor_shards() == 1


def _linear(din, dout, bias, config, rngs):
  return Dense(din, dout, use_bias=bias, dtype=jnp.dtype(config.dtype),
               param_dtype=jnp.dtype(config.param_dtype), rngs=rngs)


class Attention(nnx.Module):
  """Grouped-query self-attention with optional q/k RMSNorm and q/k/v bias."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.config = c
    self.q_proj = _linear(c.hidden_size, c.num_heads * c.head_dim, c.qkv_bias, c, rngs)
    self.k_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, c, rngs)
    self.v_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.qkv_bias, c, rngs)
    self.o_proj = _linear(c.num_heads * c.head_dim, c.hidden_size, False, c, rngs)
    if c.qk_norm:
      kw = dict(param_dtype=jnp.dtype(c.param_dtype), dtype=jnp.dtype(c.dtype))
      self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw)
      self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw)

  def _qkv(self, x_BxTxD, positions_BxT):
    """Queries [B, T, K, G, Dh], keys and values [B, T, K, Dh], normed and rotated."""
    c = self.config
    b, t, _ = x_BxTxD.shape
    if _fuse(x_BxTxD):
      q, k, v = fused_dense(x_BxTxD, (self.q_proj, self.k_proj, self.v_proj))
    else:
      q, k, v = self.q_proj(x_BxTxD), self.k_proj(x_BxTxD), self.v_proj(x_BxTxD)
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = rope(q, positions_BxT, c.rope_theta)
    k = rope(k, positions_BxT, c.rope_theta)
    groups = c.num_heads // c.num_kv_heads
    return q.reshape(b, t, c.num_kv_heads, groups, c.head_dim), k, v

  def grouped(self, xp_BxPxD, xc_NxTxD, positions_BxP, positions_NxT, prompt_mask_BxP,
              group: int, query_block: int = 0):
    """Attention of B prompts and of their N = B * group continuations (``grouped_attention``).

    Returns:
      (prompt outputs [B, P, D], continuation outputs [N, T, D]).
    """
    c = self.config
    qp, kp, vp = self._qkv(xp_BxPxD, positions_BxP)
    qc, kc, vc = self._qkv(xc_NxTxD, positions_NxT)
    out_p, out_c = grouped_attention(qp, kp.astype(qp.dtype), vp, qc, kc.astype(qc.dtype), vc,
                                     prompt_mask_BxP, group, query_block)
    flat = lambda o: o.reshape(o.shape[:2] + (c.num_heads * c.head_dim,))
    return self.o_proj(flat(out_p)), self.o_proj(flat(out_c))

  def __call__(self, x_BxTxD, positions_BxT, mask_BxTxS, kv=None, index=None,
               query_block: int = 0):
    """Attends the T new tokens to themselves, or to the S cache slots when ``kv`` is given.

    ``query_block > 0`` computes the attention of ``query_block`` queries at a time
    (``blocked_attention``): the same values, with [B, H, query_block, S] scores alive at a
    time instead of [B, H, T, S].

    Returns:
      (output [B, T, D], (keys, values)) where keys/values are the updated cache entries
      ([B, K, Dh, S] and [B, K, S, Dh]) when ``kv`` was given, else the T new ones
      ([B, T, K, Dh]).
    """
    c = self.config
    b, t, _ = x_BxTxD.shape
    q_BxTxKxGxDh, k, v = self._qkv(x_BxTxD, positions_BxT)
    if kv is not None:
      # New keys [B, T, K, Dh] -> [B, K, Dh, T] and values -> [B, K, T, Dh], written at slot
      # ``index`` of the cache's own layout (KVCache).
      k = jax.lax.dynamic_update_slice(
          kv[0], jnp.transpose(k, (0, 2, 3, 1)).astype(kv[0].dtype), (0, 0, 0, index))
      v = jax.lax.dynamic_update_slice(
          kv[1], jnp.transpose(v, (0, 2, 1, 3)).astype(kv[1].dtype), (0, 0, index, 0))
      if t == 1:
        out = decode_attention(q_BxTxKxGxDh[:, 0], k, v, mask_BxTxS[:, 0])
      else:
        out = cached_attention(q_BxTxKxGxDh, k, v, mask_BxTxS)
    elif 0 < query_block < t:
      out = blocked_attention(q_BxTxKxGxDh, k.astype(q_BxTxKxGxDh.dtype), v, mask_BxTxS,
                              query_block)
    else:
      out = attention(q_BxTxKxGxDh, k.astype(q_BxTxKxGxDh.dtype), v, mask_BxTxS)
    return self.o_proj(out.reshape(b, t, c.num_heads * c.head_dim)), (k, v)


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c = config
    self.gate_proj = _linear(c.hidden_size, c.intermediate_size, False, c, rngs)
    self.up_proj = _linear(c.hidden_size, c.intermediate_size, False, c, rngs)
    self.down_proj = _linear(c.intermediate_size, c.hidden_size, False, c, rngs)

  def __call__(self, x):
    if _fuse(x):
      gate, up = fused_dense(x, (self.gate_proj, self.up_proj))
    else:
      gate, up = self.gate_proj(x), self.up_proj(x)
    return self.down_proj(jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
  """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    kw = dict(param_dtype=jnp.dtype(config.param_dtype), dtype=jnp.dtype(config.dtype))
    self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
    self.self_attn = Attention(config, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x, positions, mask, kv=None, index=None, query_block: int = 0):
    h, kv = self.self_attn(self.input_layernorm(x), positions, mask, kv, index, query_block)
    x = x + h
    return x + self.mlp(self.post_attention_layernorm(x)), kv


def _grouped_block(layer: DecoderLayer, xp_BxPxD, xc_NxTxD, positions_BxP, positions_NxT,
                   prompt_mask_BxP, group: int, query_block: int = 0):
  """One decoder block over B prompts and their N continuations (``Attention.grouped``)."""
  hp, hc = layer.self_attn.grouped(layer.input_layernorm(xp_BxPxD),
                                   layer.input_layernorm(xc_NxTxD), positions_BxP,
                                   positions_NxT, prompt_mask_BxP, group, query_block)
  xp_BxPxD, xc_NxTxD = xp_BxPxD + hp, xc_NxTxD + hc
  mlp = lambda x: x + layer.mlp(layer.post_attention_layernorm(x))
  return mlp(xp_BxPxD), mlp(xc_NxTxD)


def _remat_block(layer: DecoderLayer, x_BxTxD, positions_BxT, mask_BxTxS, query_block: int):
  """One decoder block under ``jax.checkpoint``: only its input is saved for the backward pass.

  The block's parameters enter as an explicit argument (split from the module), so the
  checkpointed function is pure; the new keys/values (unused without a cache) are dropped.
  """
  graphdef, params = nnx.split(layer)

  def block(params, x):
    return nnx.merge(graphdef, params)(x, positions_BxT, mask_BxTxS,
                                       query_block=query_block)[0]

  return jax.checkpoint(block)(params, x_BxTxD)


class Qwen3(nnx.Module):
  """Qwen3-family causal language model.

  ``model(input_ids)`` is the plain full forward; ``hidden_states`` + ``logits`` are the pieces
  the sampler and the log-prob kernels use (so they never build logits they do not need).
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size,
                                  dtype=jnp.dtype(config.dtype),
                                  param_dtype=jnp.dtype(config.param_dtype),
                                  embedding_init=_INIT, rngs=rngs)
    self.layers = nnx.List([DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)])
    self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                        param_dtype=jnp.dtype(config.param_dtype), dtype=jnp.dtype(config.dtype))
    if not config.tie_word_embeddings:
      self.lm_head = _linear(config.hidden_size, config.vocab_size, False, config, rngs)

  def __call__(self, input_ids_BxT: jax.Array,
               attention_mask_BxT: Optional[jax.Array] = None,
               positions_BxT: Optional[jax.Array] = None) -> jax.Array:
    """Full forward pass.

    Args:
      input_ids_BxT: int32 token ids, left padded if ``attention_mask_BxT`` is given.
      attention_mask_BxT: 1/True for real tokens; None means no padding.
      positions_BxT: position ids; default counts real tokens from 0.

    Returns:
      float32 logits [B, T, V].
    """
    h, _ = self.hidden_states(input_ids_BxT, attention_mask_BxT, positions_BxT)
    return self.logits(h)

  def hidden_states(self, input_ids_BxT, attention_mask_BxT=None, positions_BxT=None,
                    cache: Optional[KVCache] = None, remat: bool = False,
                    query_block: int = 0):
    """Final-norm hidden states [B, T, D], writing the T tokens into ``cache`` when given.

    With a cache the tokens go to slots [cache.index, cache.index + T) and attend to every
    earlier real slot; without one they attend causally among themselves.

    Args:
      input_ids_BxT: int32 token ids.
      attention_mask_BxT: True for real tokens (default all).
      positions_BxT: position ids (default from the mask).
      cache: optional KV cache.
      remat: activation checkpointing per layer (``jax.checkpoint`` around each decoder
        block; only without a cache): a backward pass keeps each block's input [B, T, D] and
        recomputes the block's insides (attention scores, MLP activations) instead of storing
        them. Same values; less memory, one more forward pass of compute.
      query_block: queries per attention block (0 = all T at once; see ``blocked_attention``).

    Returns:
      (hidden [B, T, D] in the compute dtype, updated cache or None).
    """
    b, t = input_ids_BxT.shape
    if attention_mask_BxT is None:
      attention_mask_BxT = jnp.ones((b, t), bool)
    attention_mask_BxT = attention_mask_BxT.astype(bool)
    if positions_BxT is None:
      positions_BxT = positions_from_mask(attention_mask_BxT)
    causal_TxT = jnp.tril(jnp.ones((t, t), bool))
    if cache is None:
      mask = causal_TxT[None] & attention_mask_BxT[:, None, :]
      index = None
    else:
      index = cache.index
      key_mask = jax.lax.dynamic_update_slice(cache.key_mask_BxS, attention_mask_BxT, (0, index))
      slots_S = jnp.arange(cache.size)
      causal_TxS = slots_S[None, :] <= (index + jnp.arange(t))[:, None]
      mask = causal_TxS[None] & key_mask[:, None, :]
    residual = lambda x: constrain(x, ("batch", None, None))  # rows split, width whole
    x = residual(self.embed(input_ids_BxT))
    new_k, new_v = [], []
    for i, layer in enumerate(self.layers):
      if remat and cache is None:
        x = residual(_remat_block(layer, x, positions_BxT, mask, query_block))
        continue
      kv = None if cache is None else (cache.k[i], cache.v[i])
      x, (k, v) = layer(x, positions_BxT, mask, kv, index, query_block)
      x = residual(x)
      new_k.append(k)
      new_v.append(v)
    x = self.norm(x)
    if cache is not None:
      cache = KVCache(k=tuple(new_k), v=tuple(new_v), key_mask_BxS=key_mask, index=index + t)
    return x, cache

  def grouped_hidden_states(self, prompt_ids_BxP, prompt_mask_BxP, completion_ids_NxT,
                            group: int, remat: bool = False, query_block: int = 0):
    """Final-norm hidden states of B prompts and of N = B * group completions that follow them.

    The teacher-forced pass of GRPO's group-major batches without repeating the prompts:
    completion row i continues prompt i // group. The values are those of ``hidden_states``
    over the N rows [prompt i // group; completion i] (same keys, positions and masks; float
    rounding may differ), at (B * P + N * T) / (N * (P + T)) of the token work of the
    projections and MLPs (docs/benchmarks.md: Step speed).

    Args:
      prompt_ids_BxP: int32 prompts, left padded (every row has a real token).
      prompt_mask_BxP: True for real prompt tokens.
      completion_ids_NxT: int32 tokens after each prompt (all attended to, causally).
      group: completions per prompt.
      remat: checkpoint each decoder block (as ``hidden_states``).
      query_block: queries per attention block (``grouped_attention``; 0 = all at once).

    Returns:
      (prompt hidden [B, P, D], completion hidden [N, T, D]) in the compute dtype.
    """
    prompt_mask_BxP = prompt_mask_BxP.astype(bool)
    t = completion_ids_NxT.shape[1]
    positions_BxP = positions_from_mask(prompt_mask_BxP)
    first_N = jnp.repeat(jnp.sum(prompt_mask_BxP, axis=-1, dtype=jnp.int32), group)
    positions_NxT = first_N[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    residual = lambda x: constrain(x, ("batch", None, None))
    xp, xc = residual(self.embed(prompt_ids_BxP)), residual(self.embed(completion_ids_NxT))
    for layer in self.layers:
      if remat:
        graphdef, params = nnx.split(layer)

        def block(params, xp, xc, graphdef=graphdef):
          return _grouped_block(nnx.merge(graphdef, params), xp, xc, positions_BxP,
                                positions_NxT, prompt_mask_BxP, group, query_block)

        xp, xc = jax.checkpoint(block)(params, xp, xc)
      else:
        xp, xc = _grouped_block(layer, xp, xc, positions_BxP, positions_NxT, prompt_mask_BxP,
                                group, query_block)
      xp, xc = residual(xp), residual(xc)
    return self.norm(xp), self.norm(xc)

  def embed(self, input_ids_BxT: jax.Array) -> jax.Array:
    """Token embeddings [B, T, D] in the compute dtype (``nnx.Embed``'s lookup).

    Under a mesh the table's width is gathered first (as FSDP gathers every weight before
    use) while its rows stay split over ``tensor``: the lookup then needs no other collective
    than one reduction over ``tensor`` of the rows each shard holds.
    """
    table_VxD = self.embed_tokens.embedding[...].astype(jnp.dtype(self.config.dtype))
    return jnp.take(constrain(table_VxD, ("vocab", None)), input_ids_BxT, axis=0)

  def logits(self, hidden_xD: jax.Array) -> jax.Array:
    """float32 logits [..., V] from final hidden states [..., D]."""
    dtype = jnp.dtype(self.config.dtype)
    if self.config.tie_word_embeddings:
      w_VxD = self.embed_tokens.embedding[...].astype(dtype)
      return jnp.einsum("...d,vd->...v", hidden_xD.astype(dtype), w_VxD,
                        preferred_element_type=jnp.float32)
    w_DxV = self.lm_head.kernel[...].astype(dtype)
    return jnp.einsum("...d,dv->...v", hidden_xD.astype(dtype), w_DxV,
                      preferred_element_type=jnp.float32)
