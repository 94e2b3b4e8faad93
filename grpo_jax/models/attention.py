"""Attention kernels of the Qwen3-family decoder (pure functions over heads-grouped arrays).

Shape letters as in ``models/qwen3.py``: B rows, T queries, S key slots, K key/value heads,
G query heads per key/value head, Dh head dim; P prompt and N = B * group continuation rows
in the grouped kernels. Scores and softmax in float32. References: grouped-query attention
(arXiv 2305.13245); query chunking (Rabe & Staats, arXiv 2112.05682).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite "minus infinity": a fully masked row (a pad query) stays finite instead of NaN.
_MASK_VALUE = -1e30


def attention(q_BxTxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS):
  """Grouped-query softmax attention with float32 scores and softmax.

  Returns:
    [B, T, K, G, Dh] in the values' dtype.
  """
  head_dim = q_BxTxKxGxDh.shape[-1]
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxDh, k_BxSxKxDh,
                      preferred_element_type=jnp.float32) * (head_dim ** -0.5)
  scores = jnp.where(mask_BxTxS[:, None, None], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxDh.dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxDh)


def grouped_attention(qp_BxPxKxGxDh, kp_BxPxKxDh, vp_BxPxKxDh, qc_NxTxKxGxDh, kc_NxTxKxDh,
                      vc_NxTxKxDh, prompt_mask_BxP, group: int, query_block: int = 0):
  """``attention`` over B prompts, each continued by ``group`` rows (N = B * group).

  Row i of the continuations follows prompt i // group. Prompt tokens attend causally to their
  prompt's real tokens; continuation tokens attend to every real token of their prompt and
  causally to their own row: the same sets of keys, and the same float32 softmax, as
  ``attention`` over the N rows of [prompt; continuation], but each prompt's queries, keys and
  values are computed once instead of ``group`` times. The continuation softmax runs over the
  P prompt keys and T own keys together (one [N, K, G, T, P + T] score array, as before).
  ``query_block > 0`` runs both parts ``query_block`` queries at a time, each block
  rematerialised (as ``blocked_attention``): [N, K, G, query_block, P + T] scores at a time.

  Returns:
    (prompt outputs [B, P, K, G, Dh], continuation outputs [N, T, K, G, Dh]), values' dtype.
  """
  b, p = prompt_mask_BxP.shape
  n, t = qc_NxTxKxGxDh.shape[:2]
  prompt_mask_BxP = prompt_mask_BxP.astype(bool)
  causal = lambda size: jnp.tril(jnp.ones((size, size), bool))
  mask_pp = causal(p)[None] & prompt_mask_BxP[:, None, :]
  if 0 < query_block < p:
    out_p = blocked_attention(qp_BxPxKxGxDh, kp_BxPxKxDh, vp_BxPxKxDh, mask_pp, query_block)
  else:
    out_p = attention(qp_BxPxKxGxDh, kp_BxPxKxDh, vp_BxPxKxDh, mask_pp)
  attend = lambda q, causal_QxT: _continuation_attention(
      q, kp_BxPxKxDh, vp_BxPxKxDh, kc_NxTxKxDh, vc_NxTxKxDh, prompt_mask_BxP, causal_QxT, group)
  if not 0 < query_block < t:
    return out_p, attend(qc_NxTxKxGxDh, causal(t))
  num_blocks = -(-t // query_block)
  pad = num_blocks * query_block - t
  # Padding queries (zero, with no key of their own row) attend to the prompt and are dropped.
  q = jnp.pad(qc_NxTxKxGxDh, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
  rows = jnp.pad(causal(t), ((0, pad), (0, 0)))
  q_blocks = jnp.swapaxes(q.reshape((n, num_blocks, query_block) + q.shape[2:]), 0, 1)
  out = jax.lax.map(jax.checkpoint(lambda xs: attend(*xs)),
                    (q_blocks, rows.reshape(num_blocks, query_block, t)))
  out = jnp.swapaxes(out, 0, 1).reshape((n, num_blocks * query_block) + out.shape[3:])
  return out_p, out[:, :t]


def _continuation_attention(qc_NxQxKxGxDh, kp_BxPxKxDh, vp_BxPxKxDh, kc_NxTxKxDh, vc_NxTxKxDh,
                            prompt_mask_BxP, causal_QxT, group: int):
  """Q continuation queries per row over their prompt's P keys and their row's T keys.

  ``causal_QxT`` says which of the row's own T keys each query sees.

  Returns:
    [N, Q, K, G, Dh] in the values' dtype.
  """
  b, p = prompt_mask_BxP.shape
  n, q, k, g, dh = qc_NxQxKxGxDh.shape
  qc = qc_NxQxKxGxDh.reshape(b, group, q, k, g, dh)
  scores_p = jnp.einsum("bjtkgd,bskd->bjkgts", qc, kp_BxPxKxDh,
                        preferred_element_type=jnp.float32) * (dh ** -0.5)
  scores_p = jnp.where(prompt_mask_BxP[:, None, None, None, None, :], scores_p, _MASK_VALUE)
  scores_c = jnp.einsum("ntkgd,nskd->nkgts", qc_NxQxKxGxDh, kc_NxTxKxDh,
                        preferred_element_type=jnp.float32) * (dh ** -0.5)
  scores_c = jnp.where(causal_QxT, scores_c, _MASK_VALUE)
  scores = jnp.concatenate([scores_p.reshape(n, k, g, q, p), scores_c], axis=-1)
  probs = jax.nn.softmax(scores, axis=-1).astype(vc_NxTxKxDh.dtype)
  probs_p = probs[..., :p].reshape(b, group, k, g, q, p)
  # The prompt part and the row's own part are summed in float32 and rounded once, as the one
  # product of ``attention`` rounds: two bfloat16 halves rounded apart, then added, moved the
  # grouped pass's log-probs by 0.012 on average (up to 0.04) from the per-row pass (and from
  # the sampler) under bfloat16 matmuls; now they agree exactly (test_shared_prompts.py).
  f32 = jnp.float32
  out_p = jnp.einsum("bjkgts,bskd->bjtkgd", probs_p, vp_BxPxKxDh, preferred_element_type=f32)
  out_c = jnp.einsum("nkgts,nskd->ntkgd", probs[..., p:], vc_NxTxKxDh, preferred_element_type=f32)
  return (out_p.reshape(n, q, k, g, dh) + out_c).astype(vc_NxTxKxDh.dtype)


def blocked_attention(q_BxTxKxGxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS, block: int):
  """``attention`` for ``block`` queries at a time, each block rematerialised.

  Every query's softmax runs over all S keys as before, so each output row is computed by the
  same operations; only T is cut into blocks (a loop over T / block), and each block's scores
  [B, K, G, block, S] are recomputed in a backward pass instead of stored. Memory per layer
  O(block * S) instead of O(T * S): query chunking of Rabe & Staats, "Self-attention does not
  need O(n^2) memory" (arXiv 2112.05682), without their key chunking (S is at most P + T).

  Returns:
    [B, T, K, G, Dh] in the values' dtype.
  """
  b, t = q_BxTxKxGxDh.shape[:2]
  num_blocks = -(-t // block)
  pad = num_blocks * block - t
  if pad:  # padding queries attend to nothing (uniform weights, finite) and are dropped
    q_BxTxKxGxDh = jnp.pad(q_BxTxKxGxDh, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    mask_BxTxS = jnp.pad(mask_BxTxS, ((0, 0), (0, pad), (0, 0)))
  # [B, T', ...] -> [T' / block, B, block, ...]: the loop runs over the leading axis.
  to_blocks = lambda x: jnp.swapaxes(x.reshape((b, num_blocks, block) + x.shape[2:]), 0, 1)

  @jax.checkpoint
  def one(xs):
    q_blk, mask_blk = xs
    return attention(q_blk, k_BxSxKxDh, v_BxSxKxDh, mask_blk)

  out = jax.lax.map(one, (to_blocks(q_BxTxKxGxDh), to_blocks(mask_BxTxS)))
  out = jnp.swapaxes(out, 0, 1).reshape((b, num_blocks * block) + out.shape[3:])
  return out[:, :t]


def cached_attention(q_BxTxKxGxDh, k_BxKxDhxS, v_BxKxSxDh, mask_BxTxS):
  """Attention of T new tokens over the cache's S slots, in the cache's layout (KVCache).

  Scores and softmax in float32 (queries and keys are read as float32: under bfloat16 the
  products of bfloat16 values are then exact, as in the training pass's float32 accumulation).
  With T = 1 (decoding) both products are one batched matmul per (row, kv head) over the cache
  as stored.

  Returns:
    [B, T, K, G, Dh] in the values' dtype.
  """
  head_dim = q_BxTxKxGxDh.shape[-1]
  scores = jnp.einsum("btkgd,bkds->bkgts", q_BxTxKxGxDh.astype(jnp.float32),
                      k_BxKxDhxS.astype(jnp.float32)) * (head_dim ** -0.5)
  scores = jnp.where(mask_BxTxS[:, None, None], scores, _MASK_VALUE)
  # Probabilities rounded to the values' dtype (as ``attention``), the product in float32.
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxKxSxDh.dtype).astype(jnp.float32)
  out = jnp.einsum("bkgts,bksd->btkgd", probs, v_BxKxSxDh.astype(jnp.float32))
  return out.astype(v_BxKxSxDh.dtype)


def decode_attention(q_BxKxGxDh, k_BxKxDhxS, v_BxKxSxDh, mask_BxS):
  """``cached_attention`` for one new token per row, as broadcast multiplies and reductions.

  The same float32 math; XLA:CPU runs a batched matmul of B * K tiny [G, Dh] @ [Dh, S] blocks
  as B * K separate small GEMMs, while here both reductions run over a major axis of the cache
  (Dh for the scores, S for the output) with the minor axis (S, then Dh) contiguous and
  vectorised, in two fused loops (docs/benchmarks.md: Step speed).

  Returns:
    [B, 1, K, G, Dh] in the values' dtype.
  """
  head_dim = q_BxKxGxDh.shape[-1]
  q = q_BxKxGxDh.astype(jnp.float32)[..., None]  # [B, K, G, Dh, 1]
  scores_BxKxGxS = jnp.sum(q * k_BxKxDhxS.astype(jnp.float32)[:, :, None], axis=3)
  scores_BxKxGxS = scores_BxKxGxS * (head_dim ** -0.5)
  scores_BxKxGxS = jnp.where(mask_BxS[:, None, None], scores_BxKxGxS, _MASK_VALUE)
  probs = jax.nn.softmax(scores_BxKxGxS, axis=-1).astype(v_BxKxSxDh.dtype)
  out = jnp.sum(probs[..., None].astype(jnp.float32)
                * v_BxKxSxDh.astype(jnp.float32)[:, :, None], axis=3)  # [B, K, G, Dh]
  return out.astype(v_BxKxSxDh.dtype)[:, None]
