"""Qwen3-family decoder (Qwen3, Qwen2, Qwen2.5) in Flax NNX, with a fixed-size KV cache.

References: Qwen3 Technical Report (arXiv 2505.09388) for per-head q/k RMSNorm and no q/k/v bias;
Qwen2 Technical Report (arXiv 2407.10671) for q/k/v bias without q/k norm.

Shape letters: ``types.py`` (N rows, S positions or cache slots, X a block of new positions,
D width, H query heads, K key/value heads, Q = H / K query heads per key/value head, W head
width, F MLP width, V vocabulary; B prompts and G continuations per prompt in the grouped pass).

Attributes are named like the Hugging Face modules (``layers.self_attn.q_proj``) so that the
checkpoint mapping (``qwen3_checkpoint.py``) is mechanical. The decoder layers are one
``DecoderLayer`` whose parameters are stacked along a leading layer axis L (``causal_lm.LAYERS``):
the passes without a cache (the train step's) run one ``lax.scan`` over them, so XLA compiles one
block whatever the depth. They are stored stacked rather than stacked at each call, which would
copy every parameter, and its gradient, in every pass of the train step. Parameters are stored in
``param_dtype``, matmuls run in ``dtype``; norms, softmax and logits are computed in float32.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.models import flash, packed_attention
from grpo_jax.models import lm_head as head_lib
from grpo_jax.models.attention import cache_attention, grouped_attention, self_attention
from grpo_jax.models.causal_lm import positions_from_mask
from grpo_jax.models.kv_cache import KVCache
from grpo_jax.models.layers import INIT, Dense, RMSNorm, fused_dense, rope
from grpo_jax.models.model_config import ModelConfig  # re-exported: qwen3.ModelConfig
from grpo_jax.sharding import ambient_tensor_shards, constrain

# What the layer scan's step saves for the backward pass without ``remat`` (``Qwen3._scan``):
# the matmuls' outputs and the blocked kernels' output and log-sum-exp.
SCAN_POLICY = flash.saved_by(jax.checkpoint_policies.dots_saveable)

# (module name, parameter name) -> logical axes of each dimension (kernels are [in, out]);
# the family's ``param_axes`` (``sharding.LOGICAL_RULES`` maps them to mesh axes). Parameters of
# the decoder layers lead with their layer axis (``layers``, never split: each step of the scan
# reads one layer's slice). The RMSNorm scales are replicated: they are tiny and every shard
# needs all of them.
PARAM_AXES = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("norm", "scale"): (None,),
    ("q_proj", "kernel"): ("layers", "embed", "heads"),
    ("k_proj", "kernel"): ("layers", "embed", "kv_heads"),
    ("v_proj", "kernel"): ("layers", "embed", "kv_heads"),
    ("q_proj", "bias"): ("layers", "heads"),
    ("k_proj", "bias"): ("layers", "kv_heads"),
    ("v_proj", "bias"): ("layers", "kv_heads"),
    ("o_proj", "kernel"): ("layers", "heads", "embed"),
    ("gate_proj", "kernel"): ("layers", "embed", "mlp"),
    ("up_proj", "kernel"): ("layers", "embed", "mlp"),
    ("down_proj", "kernel"): ("layers", "mlp", "embed"),
    ("q_norm", "scale"): ("layers", None),
    ("k_norm", "scale"): ("layers", None),
    ("input_layernorm", "scale"): ("layers", None),
    ("post_attention_layernorm", "scale"): ("layers", None),
}


def _fuse(x_NxXxD) -> bool:
  """Whether projections reading ``x_NxXxD`` run as one matmul (``fused_dense``).

  Only for one token per row (decoding, where narrow GEMMs are slow) and without tensor
  parallelism (concatenating kernels split by columns over ``tensor`` would move them).
  """
  return x_NxXxD.shape[1] == 1 and ambient_tensor_shards() == 1


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

  def _qkv(self, x_NxXxD, positions_NxX):
    """Queries [N, X, K, Q, W], keys and values [N, X, K, W], normed and rotated."""
    c = self.config
    n, x, _ = x_NxXxD.shape
    if _fuse(x_NxXxD):
      q, k, v = fused_dense(x_NxXxD, (self.q_proj, self.k_proj, self.v_proj))
    else:
      q, k, v = self.q_proj(x_NxXxD), self.k_proj(x_NxXxD), self.v_proj(x_NxXxD)
    q_NxXxHxW = q.reshape(n, x, c.num_heads, c.head_dim)
    k_NxXxKxW = k.reshape(n, x, c.num_kv_heads, c.head_dim)
    v_NxXxKxW = v.reshape(n, x, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
      q_NxXxHxW, k_NxXxKxW = self.q_norm(q_NxXxHxW), self.k_norm(k_NxXxKxW)
    q_NxXxHxW = rope(q_NxXxHxW, positions_NxX, c.rope_theta)
    k_NxXxKxW = rope(k_NxXxKxW, positions_NxX, c.rope_theta)
    per_kv_head = c.num_heads // c.num_kv_heads
    return (q_NxXxHxW.reshape(n, x, c.num_kv_heads, per_kv_head, c.head_dim), k_NxXxKxW,
            v_NxXxKxW)

  def grouped(self, xp_BxPxD, xc_NxTxD, positions_BxP, positions_NxT, prompt_mask_BxP,
              group: int, query_block: int = 0):
    """Attention of B prompts and of their N = B * G continuations (``grouped_attention``).

    Returns:
      (prompt outputs [B, P, D], continuation outputs [N, T, D]).
    """
    c = self.config
    qp, kp, vp = self._qkv(xp_BxPxD, positions_BxP)
    qc, kc, vc = self._qkv(xc_NxTxD, positions_NxT)
    out_p, out_c = grouped_attention(qp, kp.astype(qp.dtype), vp, qc, kc.astype(qc.dtype), vc,
                                     prompt_mask_BxP, group, query_block, c.attention,
                                     c.attention_block)
    flat = lambda o: o.reshape(o.shape[:2] + (c.num_heads * c.head_dim,))
    return self.o_proj(flat(out_p)), self.o_proj(flat(out_c))

  def packed(self, x_NxCxD, positions_NxC, segments: packed_attention.Segments,
             query_block: int = 0):
    """Attention of packed rows, each slot to its own sequence's keys
    (``packed_attention``, the kernel ``config.attention`` resolves to at C keys).

    Returns:
      output [N, C, D].
    """
    c = self.config
    n, x, _ = x_NxCxD.shape
    q, k, v = self._qkv(x_NxCxD, positions_NxC)
    out = packed_attention.packed_attention(q, k.astype(q.dtype), v, segments,
                                            impl=c.attention, block=c.attention_block,
                                            query_block=query_block)
    return self.o_proj(out.reshape(n, x, c.num_heads * c.head_dim))

  def __call__(self, x_NxXxD, positions_NxX, key_mask_NxS, kv=None, index=None,
               query_block: int = 0):
    """Attends the X new tokens causally to themselves (S = X), or to the S cache slots up to
    their own given ``kv`` (written at slots ``index`` ..); ``key_mask_NxS`` marks the real
    keys (``attention.self_attention`` / ``cache_attention``, kernel ``config.attention``).

    ``query_block > 0`` (``xla`` kernel) computes the attention of ``query_block`` queries at a
    time (``blocked_attention``): the same values, with [N, H, query_block, S] scores alive at
    a time instead of [N, H, X, S].

    Returns:
      (output [N, X, D], (keys, values)) where keys/values are the updated cache entries
      ([N, K, W, S] and [N, K, S, W]) when ``kv`` was given, else the X new ones
      ([N, X, K, W]).
    """
    c = self.config
    n, x, _ = x_NxXxD.shape
    q_NxXxKxQxW, k, v = self._qkv(x_NxXxD, positions_NxX)
    if kv is not None:
      # New keys [N, X, K, W] -> [N, K, W, X] and values -> [N, K, X, W], written at slot
      # ``index`` of the cache's own layout (KVCache); one index per row ([N]) writes each
      # row at its own slot (a slot pool's rows sit at every position).
      write = _write_per_row if jnp.ndim(index) else jax.lax.dynamic_update_slice
      k = write(kv[0], jnp.transpose(k, (0, 2, 3, 1)).astype(kv[0].dtype), (0, 0, 0, index))
      v = write(kv[1], jnp.transpose(v, (0, 2, 1, 3)).astype(kv[1].dtype), (0, 0, index, 0))
      out = cache_attention(q_NxXxKxQxW, k, v, key_mask_NxS, index, c.attention,
                            c.attention_block)
    else:
      out = self_attention(q_NxXxKxQxW, k.astype(q_NxXxKxQxW.dtype), v, key_mask_NxS,
                           c.attention, query_block, c.attention_block)
    return self.o_proj(out.reshape(n, x, c.num_heads * c.head_dim)), (k, v)


def _write_per_row(cache_Nx, update_Nx, start):
  """``lax.dynamic_update_slice`` with the one traced entry of ``start`` an [N] array: row n's
  update written at its own offset ``start[i][n]`` (a scatter, in place in a loop)."""
  axis = next(i for i, s in enumerate(start) if jnp.ndim(s))
  per_row = lambda c, u, i: jax.lax.dynamic_update_slice_in_dim(c, u, i, axis - 1)
  return jax.vmap(per_row)(cache_Nx, update_Nx, start[axis])


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


def _packed_block(layer: DecoderLayer, x_NxCxD, positions_NxC, segments, query_block: int = 0):
  """One decoder block over packed rows (``Attention.packed``)."""
  x_NxCxD = x_NxCxD + layer.self_attn.packed(layer.input_layernorm(x_NxCxD), positions_NxC,
                                              segments, query_block)
  return x_NxCxD + layer.mlp(layer.post_attention_layernorm(x_NxCxD))


def _stack(layers: list[DecoderLayer]) -> DecoderLayer:
  """One DecoderLayer whose every parameter is the L layers' parameters stacked: [L, ...]."""
  graphdef, _ = nnx.split(layers[0])
  return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *map(nnx.state, layers)))


class Qwen3(nnx.Module):
  """Qwen3-family causal language model (a ``CausalLM``).

  ``model(input_ids)`` is the plain full forward; ``hidden_states`` + ``logits`` are the pieces
  the sampler and the log-prob kernels use (so they never build logits they do not need).
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size,
                                  dtype=jnp.dtype(config.dtype),
                                  param_dtype=jnp.dtype(config.param_dtype),
                                  embedding_init=INIT, rngs=rngs)
    # Built one after the other (the random draws of L separate layers), then stacked.
    self.layers = _stack([DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)])
    self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps,
                        param_dtype=jnp.dtype(config.param_dtype), dtype=jnp.dtype(config.dtype))
    if not config.tie_word_embeddings:
      self.lm_head = _linear(config.hidden_size, config.vocab_size, False, config, rngs)

  def __call__(self, input_ids_NxS: jax.Array,
               attention_mask_NxS: Optional[jax.Array] = None,
               positions_NxS: Optional[jax.Array] = None) -> jax.Array:
    """Full forward pass.

    Args:
      input_ids_NxS: int32 token ids, left padded if ``attention_mask_NxS`` is given.
      attention_mask_NxS: 1/True for real tokens; None means no padding.
      positions_NxS: position ids; default counts real tokens from 0.

    Returns:
      float32 logits [N, S, V].
    """
    h, _ = self.hidden_states(input_ids_NxS, attention_mask_NxS, positions_NxS)
    return self.logits(h)

  def init_cache(self, batch: int, size: int) -> KVCache:
    """An empty KV cache of ``size`` slots S for ``batch`` rows N."""
    return KVCache.init(self.config, batch, size)

  def hidden_states(self, input_ids_NxX, attention_mask_NxX=None, positions_NxX=None,
                    cache: Optional[KVCache] = None, remat: bool = False,
                    query_block: int = 0):
    """Final-norm hidden states [N, X, D], writing the X tokens into ``cache`` when given.

    With a cache the tokens go to slots [cache.index, cache.index + X) and attend to every
    earlier real slot (``cache.index`` one slot, or one per row with X = 1: a slot pool's
    decode step); without one they attend causally among themselves.

    Without a cache the layers run as one ``lax.scan`` over the stacked parameters (``_scan``):
    the compiled program holds one block, whatever the depth. With one (the sampler's prefill
    and decode steps) they are unrolled, each layer reading a static slice of the stacked
    parameters and its own entries of the cache: a scan would either rewrite the whole cache
    at every token (as its stacked output) or read each layer's entries through a dynamic
    slice that a GEMM cannot fuse. The sampler's program, unlike the train step's, therefore
    still grows with the depth; inside its decode loop the slices are loop-invariant, and XLA
    computes them (with the sampler's cast to the compute dtype) once, before the loop.

    Args:
      input_ids_NxX: int32 token ids.
      attention_mask_NxX: True for real tokens (default all).
      positions_NxX: position ids (default from the mask).
      cache: optional KV cache.
      remat: activation checkpointing per layer (``jax.checkpoint`` around each step of the
        scan; only without a cache): a backward pass keeps each block's input [N, X, D] and
        recomputes the block's insides (attention scores, MLP activations) instead of storing
        them. Same values; less memory, one more forward pass of compute.
      query_block: queries per attention block (0 = all X at once; see ``blocked_attention``).

    Returns:
      (hidden [N, X, D] in the compute dtype, updated cache or None).
    """
    n, x = input_ids_NxX.shape
    if attention_mask_NxX is None:
      attention_mask_NxX = jnp.ones((n, x), bool)
    attention_mask_NxX = attention_mask_NxX.astype(bool)
    if positions_NxX is None:
      positions_NxX = positions_from_mask(attention_mask_NxX)
    residual = lambda h: constrain(h, ("batch", None, None))  # rows split, width whole
    h_NxXxD = residual(self.embed(input_ids_NxX))
    if cache is None:
      # Real keys of each row; the kernels add the causal part. New keys/values are dropped.
      block = lambda layer, h: residual(layer(h, positions_NxX, attention_mask_NxX,
                                              query_block=query_block)[0])
      return self.norm(self._scan(block, h_NxXxD, remat)), None
    index = cache.index
    write = _write_per_row if jnp.ndim(index) else jax.lax.dynamic_update_slice
    key_mask_NxS = write(cache.key_mask_NxS, attention_mask_NxX, (0, index))
    graphdef, stacked = nnx.split(self.layers)
    new_k, new_v = [], []
    for i in range(self.config.num_layers):
      # The barrier makes the slices a value XLA hoists out of the sampler's decode loop: a bare
      # slice it leaves in the loop (too cheap to hoist alone), copying the o_proj and
      # down_proj weights of every layer at every token; and it keeps them out of the
      # consumers' fusions, which then compile once for all layers.
      layer = nnx.merge(graphdef, jax.lax.optimization_barrier(
          jax.tree.map(lambda a, i=i: a[i], stacked)))
      h_NxXxD, (k, v) = layer(h_NxXxD, positions_NxX, key_mask_NxS, (cache.k[i], cache.v[i]),
                              index, query_block)
      h_NxXxD = residual(h_NxXxD)
      new_k.append(k)
      new_v.append(v)
    cache = KVCache(k=tuple(new_k), v=tuple(new_v), key_mask_NxS=key_mask_NxS, index=index + x)
    return self.norm(h_NxXxD), cache

  def grouped_hidden_states(self, prompt_ids_BxP, prompt_mask_BxP, completion_ids_NxT,
                            group: int, remat: bool = False, query_block: int = 0):
    """Final-norm hidden states of B prompts and of N = B * G completions that follow them.

    The teacher-forced pass of GRPO's group-major batches without repeating the prompts:
    completion row i continues prompt i // G. The values are those of ``hidden_states``
    over the N rows [prompt i // G; completion i] (same keys, positions and masks; float
    rounding may differ), at (B * P + N * T) / (N * (P + T)) of the token work of the
    projections and MLPs (docs/benchmarks.md: Step speed). The layers run as one scan, as in
    ``hidden_states`` without a cache.

    Args:
      prompt_ids_BxP: int32 prompts, left padded (every row has a real token).
      prompt_mask_BxP: True for real prompt tokens.
      completion_ids_NxT: int32 tokens after each prompt (all attended to, causally).
      group: G, completions per prompt.
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
    residual = lambda h: constrain(h, ("batch", None, None))

    def block(layer, carry):
      xp_BxPxD, xc_NxTxD = _grouped_block(layer, *carry, positions_BxP, positions_NxT,
                                          prompt_mask_BxP, group, query_block)
      return residual(xp_BxPxD), residual(xc_NxTxD)

    xp, xc = residual(self.embed(prompt_ids_BxP)), residual(self.embed(completion_ids_NxT))
    xp, xc = self._scan(block, (xp, xc), remat)
    return self.norm(xp), self.norm(xc)

  def packed_hidden_states(self, input_ids_NxC, positions_NxC,
                           segments: packed_attention.Segments, remat: bool = False,
                           query_block: int = 0):
    """Final-norm hidden states [N, C, D] of packed rows: several sequences a row, each slot
    attending to its own sequence's keys (``Segments``; ``generate.packing`` builds them) at
    its own position. The values are those of ``hidden_states`` / ``grouped_hidden_states``
    over the sequences one per row (same keys, positions and masks; float rounding may
    differ). The layers run as one scan (``remat``, ``query_block`` as ``hidden_states``)."""
    residual = lambda h: constrain(h, ("batch", None, None))
    block = lambda layer, h: residual(_packed_block(layer, h, positions_NxC, segments,
                                                    query_block))
    return self.norm(self._scan(block, residual(self.embed(input_ids_NxC)), remat))

  def _scan(self, block, carry, remat: bool):
    """``carry`` through every decoder layer, ``carry = block(layer, carry)``, as one
    ``lax.scan`` over the stacked parameters: each step merges one layer's slice into a
    ``DecoderLayer``.

    What a backward pass keeps of each step: with ``remat``, only its input carry (the layer's
    slice is the scan's own input); without, the outputs of its matmuls, the elementwise ops
    between them being recomputed from those (as XLA fuses them into the backward pass of an
    unrolled graph), and the blocked kernels' output and log-sum-exp (``flash.saved_by``:
    saving only dots, the step kept every tile's products of their forward loops instead,
    quadratic in length). Keeping every intermediate instead, a scan's default, stacks them all:
    1.2x the time of the unrolled layers' gradient on CPU and 1.3-1.6x its memory (the
    reference model of docs/performance.md; 1.04x and 0.56-0.75x this way).
    """
    graphdef, stacked = nnx.split(self.layers)

    def step(carry, layer_params):
      return block(nnx.merge(graphdef, layer_params), carry), None

    # Within a scan the recomputation cannot be merged with the forward pass (the loop body
    # keeps them apart), so the barriers prevent_cse adds would only cost (jax.checkpoint).
    policy = None if remat else SCAN_POLICY
    step = jax.checkpoint(step, prevent_cse=False, policy=policy)
    return jax.lax.scan(step, carry, stacked)[0]

  def embed(self, input_ids_NxX: jax.Array) -> jax.Array:
    """Token embeddings [N, X, D] in the compute dtype (``nnx.Embed``'s lookup).

    Under a mesh the table's width is gathered first (as FSDP gathers every weight before
    use) while its rows stay split over ``tensor``: the lookup then needs no other collective
    than one reduction over ``tensor`` of the rows each shard holds.
    """
    table_VxD = self.embed_tokens.embedding[...].astype(jnp.dtype(self.config.dtype))
    return jnp.take(constrain(table_VxD, ("vocab", None)), input_ids_NxX, axis=0)

  def logits(self, hidden_xD: jax.Array) -> jax.Array:
    """float32 logits [..., V] from final hidden states [..., D]; their backward GEMMs run in
    the compute dtype (``models/lm_head.py``)."""
    dtype = jnp.dtype(self.config.dtype)
    if self.config.tie_word_embeddings:
      w_VxD = self.embed_tokens.embedding[...].astype(dtype)
      return head_lib.logits(hidden_xD.astype(dtype), w_VxD, True)
    w_DxV = self.lm_head.kernel[...].astype(dtype)
    logits = head_lib.logits(hidden_xD.astype(dtype), w_DxV, False)
    if self.lm_head.lora is None:
      return logits
    # An adapted LM head (``lora.attach`` with a target matching lm_head).
    lead, d = hidden_xD.shape[:-1], hidden_xD.shape[-1]
    x2 = hidden_xD.reshape(-1, d).astype(dtype)
    return self.lm_head.adapted(x2, logits.reshape(-1, logits.shape[-1])).reshape(
        *lead, logits.shape[-1])
