"""Attention of the Qwen3-family decoder: the one switch, ``model.attention``, and its kernels.

Every pass goes through one of three entry points, which pick the kernel by name:
``self_attention`` (a row's tokens causally among themselves: the per-row log-prob pass and a
shared prompt), ``grouped_attention`` (B shared prompts and their N = B * G continuations) and
``cache_attention`` (new tokens over a KV cache: the sampler's prefill and decode).

=========  =================================================================================
name       kernel
=========  =================================================================================
``xla``    dense: the masked [N, H, X, S] float32 scores and probabilities (``attention``;
           with ``query_block`` > 0, ``blocked_attention``: X cut into rematerialised query
           blocks). Exact reference; memory quadratic in length in the backward pass.
``blocked`` ``flash.flash_attention``: keys and queries in blocks with an online softmax and a
           custom VJP; no [X, S] array in either pass, causal block skipping by a static
           schedule of block pairs; the cache passes read every slot, the unwritten ones
           masked (``flash.cached_flash_attention``). Plain JAX, any backend; the reference
           the accelerator kernels are tested against.
``cudnn``  cuDNN flash attention (``fused_attention.cudnn_attention``; GPU, bf16/fp16).
``splash`` Pallas TPU splash attention (``fused_attention.splash_attention``; TPU).
``auto``   ``cudnn`` on a GPU, ``splash`` on a TPU, else ``blocked`` from
           ``BLOCKED_FROM_KEYS`` key slots on and ``xla`` below.
=========  =================================================================================

``cudnn`` and ``splash`` compute the square causal case; the continuation of a shared prompt,
and any shape or dtype they do not take, run ``blocked``. The cache passes (the sampler's
prefill and decode) pick their kernel by ``cache_kernel``: on a GPU (``auto``, ``cudnn``) a
decode step runs ``decode_attention``'s Pallas kernel, which reads only the filled cache blocks
within one kernel; every other cache pass runs ``xla`` or ``blocked``, which read every slot.
No kernel has a loop whose trip count is a traced value (XLA:GPU copies such a loop's predicate
to the host and waits, every iteration): the train step has none, the sampler one, its decode
loop (tests/models/test_hlo_loops.py counts them).

All agree with ``xla`` on every real query (float32: outputs within 1e-5, gradients within
1e-4; tests/models/test_attention.py); a query that sees no key (left padding) is unused, and its
output may differ (uniform average vs 0).

Shape letters: ``types.py``. N rows, X queries (a block of positions), S key slots, K key/value
heads, Q query heads per key/value head, W head width; B prompts, P prompt and T continuation
positions, G continuations per prompt (N = B * G) in the grouped kernels. Scores and softmax in
float32. References: grouped-query attention (arXiv 2305.13245); query chunking (Rabe &
Staats, arXiv 2112.05682).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.models import decode_attention as decode_kernel
from grpo_jax.models import flash, fused_attention

IMPLEMENTATIONS = ("auto", "xla", "blocked", "cudnn", "splash")
# ``auto`` on a CPU: the dense kernel for short rows (where it is as fast and its memory small),
# ``blocked`` from this many key slots (P + T) on.
BLOCKED_FROM_KEYS = 1024
# The accelerator each fused kernel needs (``configuration`` refuses it elsewhere).
BACKEND = {"cudnn": "gpu", "splash": "tpu"}


def resolve(name: str, num_keys: int, backend: str | None = None) -> str:
  """The kernel ``name`` stands for at ``num_keys`` key slots on ``backend`` (default: this
  process's)."""
  if name != "auto":
    return name
  backend = backend or jax.default_backend()
  if backend == "gpu":
    return "cudnn"
  if backend == "tpu":
    return "splash"
  return "blocked" if num_keys >= BLOCKED_FROM_KEYS else "xla"


def causal_mask(key_mask_NxS, num_queries: int, offset=0):
  """[N, X, S] bool: query x (at slot ``offset + x``) sees key s iff s <= offset + x and the key
  is real. ``offset`` is one slot for every row, or one per row ([N]: a slot pool's rows)."""
  s = key_mask_NxS.shape[1]
  slots = jnp.asarray(offset)[..., None] + jnp.arange(num_queries)  # [X] or [N, X]
  causal = jnp.arange(s) <= slots[..., None]  # [X, S] or [N, X, S]
  return causal & key_mask_NxS.astype(bool)[:, None, :]


def self_attention(q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW, key_mask_NxS, impl: str = "xla",
                   query_block: int = 0, block: int = 256):
  """A row's S tokens attending causally among themselves, real keys only.

  Args:
    q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW: queries, keys, values of the same S positions.
    key_mask_NxS: True for real tokens (left padding False).
    impl: a name of ``IMPLEMENTATIONS``.
    query_block: ``xla`` only: queries per rematerialised block (0 = all at once).
    block: ``blocked``: queries and keys per block.

  Returns:
    [N, S, K, Q, W] in the values' dtype.
  """
  s = q_NxSxKxQxW.shape[1]
  impl = resolve(impl, s)
  if impl == "cudnn" and fused_attention.cudnn_supported(q_NxSxKxQxW):
    return fused_attention.cudnn_attention(q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW, key_mask_NxS)
  if impl == "splash":
    return fused_attention.splash_attention(q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW, key_mask_NxS)
  if impl in ("blocked", "cudnn"):
    return flash.flash_attention(q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW, key_mask_NxS, 0,
                                 block_q=block, block_k=block)
  mask_NxSxS = causal_mask(key_mask_NxS, s)
  if 0 < query_block < s:
    return blocked_attention(q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW, mask_NxSxS, query_block)
  return attention(q_NxSxKxQxW, k_NxSxKxW, v_NxSxKxW, mask_NxSxS)


def cache_kernel(name: str, num_queries: int, num_keys: int, backend: str | None = None,
                 pallas: bool = True) -> str:
  """The kernel of a cache pass of X = ``num_queries`` tokens over ``num_keys`` slots: ``xla``
  or ``blocked`` (every slot), or ``pallas`` (``decode_attention``: a decode step, X = 1, on a
  GPU, where ``pallas`` says the kernel takes the shape; only the filled blocks)."""
  backend = backend or jax.default_backend()
  impl = resolve(name, num_keys, backend)
  if impl == "xla":
    return "xla"
  if impl == "cudnn" and backend == "gpu" and num_queries == 1 and pallas:
    return "pallas"
  return "blocked"


def cache_attention(q_NxXxKxQxW, k_NxKxWxS, v_NxKxSxW, key_mask_NxS, index,
                    impl: str = "xla", block: int = 256):
  """X new tokens at slots ``index`` .. over a KV cache (``KVCache``'s layout; ``index`` one
  slot, or with X = 1 one per row, [N]): each sees the real slots up to its own, by the kernel ``cache_kernel`` picks for ``impl``: ``xla`` reads
  every slot (``decode_attention`` for X = 1, else ``cached_attention``), ``blocked`` too
  (``flash.cached_flash_attention``: key blocks for X > 1), ``pallas`` only the filled blocks.

  Returns:
    [N, X, K, Q, W] in the values' dtype.
  """
  x, s = q_NxXxKxQxW.shape[1], key_mask_NxS.shape[1]
  kernel = cache_kernel(impl, x, s, pallas=decode_kernel.supported(q_NxXxKxQxW, v_NxKxSxW))
  if kernel == "pallas":
    return decode_kernel.decode_attention(q_NxXxKxQxW, k_NxKxWxS, v_NxKxSxW, key_mask_NxS,
                                          index)
  if kernel == "blocked":
    return flash.cached_flash_attention(q_NxXxKxQxW, k_NxKxWxS, v_NxKxSxW, key_mask_NxS, index,
                                        block_k=block)
  mask_NxXxS = causal_mask(key_mask_NxS, x, index)
  if x == 1:
    return decode_attention(q_NxXxKxQxW[:, 0], k_NxKxWxS, v_NxKxSxW, mask_NxXxS[:, 0])
  return cached_attention(q_NxXxKxQxW, k_NxKxWxS, v_NxKxSxW, mask_NxXxS)


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
                      vc_NxTxKxW, prompt_mask_BxP, group: int, query_block: int = 0,
                      impl: str = "xla", block: int = 256):
  """``attention`` over B prompts, each continued by G = ``group`` rows (N = B * G).

  ``impl`` other than ``xla`` (``IMPLEMENTATIONS``): the prompts through ``self_attention``,
  the continuations as ``_grouped_fused`` says.

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
  impl = resolve(impl, p + t)
  if impl != "xla":
    return _grouped_fused(qp_BxPxKxQxW, kp_BxPxKxW, vp_BxPxKxW, qc_NxTxKxQxW, kc_NxTxKxW,
                          vc_NxTxKxW, prompt_mask_BxP, group, impl, block)
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


def _grouped_fused(qp_BxPxKxQxW, kp_BxPxKxW, vp_BxPxKxW, qc_NxTxKxQxW, kc_NxTxKxW, vc_NxTxKxW,
                   prompt_mask_BxP, group: int, impl: str, block: int):
  """``grouped_attention`` with a blocked or fused kernel.

  Each continuation row's keys are its prompt's followed by its own, [N, P + T] (the prompt's
  keys and values repeated G times: O(N * (P + T) * K * W), linear in length); its T queries sit
  at slots P .. P + T - 1 of that row. ``blocked`` attends them directly (offset P); the square
  kernels (``cudnn``, ``splash``) attend the whole [prompt; continuation] row, the prompt's
  queries repeated too, and keep the last T outputs.
  """
  p = prompt_mask_BxP.shape[1]
  n, t = qc_NxTxKxQxW.shape[:2]
  out_p = self_attention(qp_BxPxKxQxW, kp_BxPxKxW, vp_BxPxKxW, prompt_mask_BxP, impl,
                         block=block)
  rows = lambda a_p, a_c: jnp.concatenate([jnp.repeat(a_p, group, axis=0), a_c], axis=1)
  k_NxSxKxW, v_NxSxKxW = rows(kp_BxPxKxW, kc_NxTxKxW), rows(vp_BxPxKxW, vc_NxTxKxW)
  key_mask_NxS = rows(prompt_mask_BxP, jnp.ones((n, t), bool))
  square = (impl == "splash" or
            (impl == "cudnn" and fused_attention.cudnn_supported(qc_NxTxKxQxW)))
  if square:
    out = self_attention(rows(qp_BxPxKxQxW, qc_NxTxKxQxW), k_NxSxKxW, v_NxSxKxW, key_mask_NxS,
                         impl)
    return out_p, out[:, p:]
  return out_p, flash.flash_attention(qc_NxTxKxQxW, k_NxSxKxW, v_NxSxKxW, key_mask_NxS, p,
                                      block_q=block, block_k=block)


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
