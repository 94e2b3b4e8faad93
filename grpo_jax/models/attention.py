"""Attention kernels of the Qwen3-family decoder (pure functions over heads-grouped arrays).

Shape letters: ``types.py``. N rows, X queries (a block of positions), S key slots, K key/value
heads, Q query heads per key/value head, W head width; B prompts, P prompt and T continuation
positions, G continuations per prompt (N = B * G) in the grouped kernels. Scores and softmax in
float32. References: grouped-query attention (arXiv 2305.13245); query chunking (Rabe &
Staats, arXiv 2112.05682).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite "minus infinity": a fully masked row (a pad query) stays finite instead of NaN.
_MASK_VALUE = -1e30


def attention(q_NxXxKxQxW, k_NxSxKxW, v_NxSxKxW, mask_NxXxS):
  """Grouped-query softmax attention with float32 scores and softmax.

  Returns:
    [N, X, K, Q, W] in the values' dtype.
  """
  head_dim = q_NxXxKxQxW.shape[-1]
  scores = jnp.einsum("nxkqw,nskw->nkqxs", q_NxXxKxQxW, k_NxSxKxW,
                      preferred_element_type=jnp.float32) * (head_dim ** -0.5)
  scores = jnp.where(mask_NxXxS[:, None, None], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_NxSxKxW.dtype)
  return jnp.einsum("nkqxs,nskw->nxkqw", probs, v_NxSxKxW)


def grouped_attention(qp_BxPxKxQxW, kp_BxPxKxW, vp_BxPxKxW, qc_NxTxKxQxW, kc_NxTxKxW,
                      vc_NxTxKxW, prompt_mask_BxP, group: int, query_block: int = 0):
  """``attention`` over B prompts, each continued by G = ``group`` rows (N = B * G).

  Row i of the continuations follows prompt i // G. Prompt tokens attend causally to their
  prompt's real tokens; continuation tokens attend to every real token of their prompt and
  causally to their own row: the same sets of keys, and the same float32 softmax, as
  ``attention`` over the N rows of [prompt; continuation], but each prompt's queries, keys and
  values are computed once instead of G times. The continuation softmax runs over the
  P prompt keys and T own keys together (one [N, K, Q, T, P + T] score array, as before).
  ``query_block > 0`` runs both parts ``query_block`` queries at a time, each block
  rematerialised (as ``blocked_attention``): [N, K, Q, query_block, P + T] scores at a time.

  Returns:
    (prompt outputs [B, P, K, Q, W], continuation outputs [N, T, K, Q, W]), values' dtype.
  """
  p = prompt_mask_BxP.shape[1]
  n, t = qc_NxTxKxQxW.shape[:2]
  prompt_mask_BxP = prompt_mask_BxP.astype(bool)
  causal = lambda size: jnp.tril(jnp.ones((size, size), bool))
  mask_BxPxP = causal(p)[None] & prompt_mask_BxP[:, None, :]
  if 0 < query_block < p:
    out_p = blocked_attention(qp_BxPxKxQxW, kp_BxPxKxW, vp_BxPxKxW, mask_BxPxP, query_block)
  else:
    out_p = attention(qp_BxPxKxQxW, kp_BxPxKxW, vp_BxPxKxW, mask_BxPxP)
  attend = lambda q, causal_XxT: _continuation_attention(
      q, kp_BxPxKxW, vp_BxPxKxW, kc_NxTxKxW, vc_NxTxKxW, prompt_mask_BxP, causal_XxT, group)
  if not 0 < query_block < t:
    return out_p, attend(qc_NxTxKxQxW, causal(t))
  num_blocks = -(-t // query_block)
  pad = num_blocks * query_block - t
  # Padding queries (zero, with no key of their own row) attend to the prompt and are dropped.
  q = jnp.pad(qc_NxTxKxQxW, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
  rows = jnp.pad(causal(t), ((0, pad), (0, 0)))
  q_blocks = jnp.swapaxes(q.reshape((n, num_blocks, query_block) + q.shape[2:]), 0, 1)
  out = jax.lax.map(jax.checkpoint(lambda xs: attend(*xs)),
                    (q_blocks, rows.reshape(num_blocks, query_block, t)))
  out = jnp.swapaxes(out, 0, 1).reshape((n, num_blocks * query_block) + out.shape[3:])
  return out_p, out[:, :t]


def _continuation_attention(qc_NxXxKxQxW, kp_BxPxKxW, vp_BxPxKxW, kc_NxTxKxW, vc_NxTxKxW,
                            prompt_mask_BxP, causal_XxT, group: int):
  """X continuation queries per row over their prompt's P keys and their row's T keys.

  ``causal_XxT`` says which of the row's own T keys each query sees.

  Returns:
    [N, X, K, Q, W] in the values' dtype.
  """
  b, p = prompt_mask_BxP.shape
  n, x, k, q, w = qc_NxXxKxQxW.shape
  qc_BxGxXxKxQxW = qc_NxXxKxQxW.reshape(b, group, x, k, q, w)
  scores_p = jnp.einsum("bgxkqw,bskw->bgkqxs", qc_BxGxXxKxQxW, kp_BxPxKxW,
                        preferred_element_type=jnp.float32) * (w ** -0.5)
  scores_p = jnp.where(prompt_mask_BxP[:, None, None, None, None, :], scores_p, _MASK_VALUE)
  scores_c = jnp.einsum("nxkqw,nskw->nkqxs", qc_NxXxKxQxW, kc_NxTxKxW,
                        preferred_element_type=jnp.float32) * (w ** -0.5)
  scores_c = jnp.where(causal_XxT, scores_c, _MASK_VALUE)
  scores = jnp.concatenate([scores_p.reshape(n, k, q, x, p), scores_c], axis=-1)
  probs = jax.nn.softmax(scores, axis=-1).astype(vc_NxTxKxW.dtype)
  probs_p = probs[..., :p].reshape(b, group, k, q, x, p)
  # The prompt part and the row's own part are summed in float32 and rounded once, as the one
  # product of ``attention`` rounds: two bfloat16 halves rounded apart, then added, moved the
  # grouped pass's log-probs by 0.012 on average (up to 0.04) from the per-row pass (and from
  # the sampler) under bfloat16 matmuls; now they agree exactly (test_shared_prompts.py).
  f32 = jnp.float32
  out_p = jnp.einsum("bgkqxs,bskw->bgxkqw", probs_p, vp_BxPxKxW, preferred_element_type=f32)
  out_c = jnp.einsum("nkqxs,nskw->nxkqw", probs[..., p:], vc_NxTxKxW, preferred_element_type=f32)
  return (out_p.reshape(n, x, k, q, w) + out_c).astype(vc_NxTxKxW.dtype)


def blocked_attention(q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW, mask_NxSxS, block: int):
  """``attention`` for X = ``block`` queries at a time, each block rematerialised.

  Every query's softmax runs over all S keys as before, so each output row is computed by the
  same operations; only the S queries are cut into blocks (a loop over S / X), and each
  block's scores [N, K, Q, X, S] are recomputed in a backward pass instead of stored. Memory
  per layer O(X * S) instead of O(S * S): query chunking of Rabe & Staats, "Self-attention does
  not need O(n^2) memory" (arXiv 2112.05682), without their key chunking (S is at most P + T).

  Returns:
    [N, S, K, Q, W] in the values' dtype.
  """
  n, s = q_NxSxKxQxW.shape[:2]
  num_blocks = -(-s // block)
  pad = num_blocks * block - s
  if pad:  # padding queries attend to nothing (uniform weights, finite) and are dropped
    q_NxSxKxQxW = jnp.pad(q_NxSxKxQxW, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    mask_NxSxS = jnp.pad(mask_NxSxS, ((0, 0), (0, pad), (0, 0)))
  # [N, S', ...] -> [S' / X, N, X, ...]: the loop runs over the leading axis.
  to_blocks = lambda a: jnp.swapaxes(a.reshape((n, num_blocks, block) + a.shape[2:]), 0, 1)

  @jax.checkpoint
  def one(xs):
    q_NxXxKxQxW, mask_NxXxS = xs
    return attention(q_NxXxKxQxW, k_NxSxKxW, v_NxSxKxW, mask_NxXxS)

  out = jax.lax.map(one, (to_blocks(q_NxSxKxQxW), to_blocks(mask_NxSxS)))
  out = jnp.swapaxes(out, 0, 1).reshape((n, num_blocks * block) + out.shape[3:])
  return out[:, :s]


def cached_attention(q_NxXxKxQxW, k_NxKxWxS, v_NxKxSxW, mask_NxXxS):
  """Attention of X new tokens over the cache's S slots, in the cache's layout (KVCache).

  Scores and softmax in float32 (queries and keys are read as float32: under bfloat16 the
  products of bfloat16 values are then exact, as in the training pass's float32 accumulation).
  With X = 1 (decoding) both products are one batched matmul per (row, kv head) over the cache
  as stored.

  Returns:
    [N, X, K, Q, W] in the values' dtype.
  """
  head_dim = q_NxXxKxQxW.shape[-1]
  scores = jnp.einsum("nxkqw,nkws->nkqxs", q_NxXxKxQxW.astype(jnp.float32),
                      k_NxKxWxS.astype(jnp.float32)) * (head_dim ** -0.5)
  scores = jnp.where(mask_NxXxS[:, None, None], scores, _MASK_VALUE)
  # Probabilities rounded to the values' dtype (as ``attention``), the product in float32.
  probs = jax.nn.softmax(scores, axis=-1).astype(v_NxKxSxW.dtype).astype(jnp.float32)
  out = jnp.einsum("nkqxs,nksw->nxkqw", probs, v_NxKxSxW.astype(jnp.float32))
  return out.astype(v_NxKxSxW.dtype)


def decode_attention(q_NxKxQxW, k_NxKxWxS, v_NxKxSxW, mask_NxS):
  """``cached_attention`` for one new token per row, as broadcast multiplies and reductions.

  The same float32 math; XLA:CPU runs a batched matmul of N * K tiny [Q, W] @ [W, S] blocks
  as N * K separate small GEMMs, while here both reductions run over a major axis of the cache
  (W for the scores, S for the output) with the minor axis (S, then W) contiguous and
  vectorised, in two fused loops (docs/benchmarks.md: Step speed).

  Returns:
    [N, 1, K, Q, W] in the values' dtype.
  """
  head_dim = q_NxKxQxW.shape[-1]
  q_NxKxQxWx1 = q_NxKxQxW.astype(jnp.float32)[..., None]
  scores_NxKxQxS = jnp.sum(q_NxKxQxWx1 * k_NxKxWxS.astype(jnp.float32)[:, :, None], axis=3)
  scores_NxKxQxS = scores_NxKxQxS * (head_dim ** -0.5)
  scores_NxKxQxS = jnp.where(mask_NxS[:, None, None], scores_NxKxQxS, _MASK_VALUE)
  probs = jax.nn.softmax(scores_NxKxQxS, axis=-1).astype(v_NxKxSxW.dtype)
  out_NxKxQxW = jnp.sum(probs[..., None].astype(jnp.float32)
                        * v_NxKxSxW.astype(jnp.float32)[:, :, None], axis=3)
  return out_NxKxQxW.astype(v_NxKxSxW.dtype)[:, None]
