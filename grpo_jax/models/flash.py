"""Blocked attention with an online softmax: memory linear in length, forward and backward.

Shape letters: ``types.py`` (N rows, X queries, S key slots, K key/value heads, Q query heads
per key/value head, W head width). The mask is the one every pass of a causal decoder uses,
given by its parts rather than as an [N, X, S] array: query x (at slot ``offset + x``) sees key
s iff ``s <= offset + x`` and ``key_mask[n, s]``. That covers the per-row pass (offset 0, keys =
queries), the continuation of a shared prompt (keys = [prompt; own row], offset P) and a cache
prefill (offset = the cache index).

``flash_attention`` cuts queries into blocks of ``block_q`` and keys into blocks of
``block_k``; each query block walks the key blocks it can see (causal block skipping: no block
past the diagonal is visited) keeping a running maximum, normaliser and output (the online
softmax of Milakov & Gimelshein, arXiv 1805.02867, as FlashAttention uses it: Dao et al., arXiv
2205.14135; the backward pass in FlashAttention-2's order, arXiv 2307.08691).

Its custom VJP saves only the output and the per-query log-sum-exp and recomputes each
[block_q, block_k] probability tile in the backward pass, so no [X, S] score or probability
array exists in either pass: per layer, O(N * H * block_q * block_k) scratch plus the
O(N * X * H * W) inputs and outputs. Inside a ``jax.checkpoint`` (the train step's layer scan)
that holds only if its policy saves those two (``saved_by``) and nothing moves the tiles' masks
out of the loop (``in_loop``); tests/models/test_memory_growth.py bounds the compiled step's
growth in length.

Which (query block, key block) pairs a pass visits is decided at trace time (``block_pairs``):
one ``lax.scan`` over that static list, so every loop has a trip count XLA knows. A loop whose
trip count is a traced value costs XLA:GPU a device-to-host copy of its predicate and a wait at
every iteration (layers x blocks round trips per step); a known one runs its body with no such
copy (tests/models/test_hlo_loops.py counts the unknown-trip-count loops of the compiled train step:
none). The query offset is a Python int at every call site (0, or the prompt length P); a traced
offset, which no call site passes, visits every pair and leaves the skipping to the mask.

Scores, softmax statistics and every accumulation are float32; inputs may be bfloat16. A query
that sees no key (left padding) gets output 0 (the dense kernel's is a uniform average, equally
unused) and no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

_NEG = -1e30  # finite "minus infinity" for masked scores
f32 = jnp.float32
# The name of the values the custom VJP saves (the output and the log-sum-exp;
# ``jax.ad_checkpoint.checkpoint_name``): a checkpoint policy that saves it (``saved_by``) keeps
# them and never recomputes the forward pass's loop. Without it, a policy that saves dots
# (``dots_saveable``) keeps every tile's products instead, stacked over the M block pairs:
# [M, N, K, Q, block_q, block_k] float32 per layer, quadratic in length.
RESIDUALS = "blocked_attention_residuals"


def _pad_to(a, axis: int, multiple: int):
  size = a.shape[axis]
  pad = -(-size // multiple) * multiple - size
  if not pad:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, pad)
  return jnp.pad(a, widths)


def _tile_mask(key_mask_NxS, offset, q0, k0, block_q: int, block_k: int):
  """[N, 1, 1, block_q, block_k] visibility of keys k0.. to queries q0.. (causal + key mask)."""
  qpos = offset + q0 + jnp.arange(block_q)
  kpos = k0 + jnp.arange(block_k)
  causal = kpos[None, :] <= qpos[:, None]
  keys = jax.lax.dynamic_slice_in_dim(key_mask_NxS, k0, block_k, axis=1)
  return (causal[None] & keys[:, None, :])[:, None, None]


def _scores(q_NxXxKxQxW, k_NxSxKxW, scale):
  return jnp.einsum("nxkqw,nskw->nkqxs", q_NxXxKxQxW, k_NxSxKxW,
                    preferred_element_type=f32) * scale


# The schedule's bounds (causal block skipping), pure functions of static block positions:
# tests/models/test_attention.py checks them against hand-worked tables and reads the real loops'
# visits back. Query block i (queries q0 = i * block_q ..) and key block j (keys k0 =
# j * block_k ..) meet iff some query of i may see some key of j: k0 <= offset + q0 +
# block_q - 1, the block's last query's slot.


def key_blocks_seen(offset: int, q0: int, block_q: int, block_k: int, num_k: int) -> int:
  """The forward's bound: query block q0.. visits key blocks 0 .. this - 1, up to the one that
  holds its last query's slot."""
  last = offset + q0 + block_q - 1
  return min(max(last // block_k + 1, 0), num_k)


def first_query_block(offset: int, k0: int, block_q: int, num_q: int) -> int:
  """The backward's bound: key block k0.. is visited by query blocks this .. num_q - 1, from the
  one that holds query x = k0 - offset, the first whose slot offset + x reaches k0."""
  return min(max((k0 - offset) // block_q, 0), num_q)


def block_pairs(offset, num_q: int, num_k: int, block_q: int, block_k: int,
                key_major: bool = False):
  """The static schedule of a pass: (i [M], j [M]) int32 numpy arrays, the M (query block, key
  block) pairs it visits, in the order it visits them.

  Query-major (the forward): query block i's key blocks 0 .. ``key_blocks_seen`` - 1.
  ``key_major`` (the backward, FlashAttention-2's order): key block j's query blocks
  ``first_query_block`` .. num_q - 1. Both give the same set, about half of num_q * num_k for a
  square causal pass. ``offset`` None (traced): all num_q * num_k pairs.
  """
  if offset is None:
    pairs = [(i, j) for i in range(num_q) for j in range(num_k)]
  elif key_major:
    pairs = [(i, j) for j in range(num_k)
             for i in range(first_query_block(offset, j * block_k, block_q, num_q), num_q)]
  else:
    pairs = [(i, j) for i in range(num_q)
             for j in range(key_blocks_seen(offset, i * block_q, block_q, block_k, num_k))]
  if key_major and offset is None:
    pairs.sort(key=lambda ij: (ij[1], ij[0]))
  ij = np.asarray(pairs, np.int32).reshape(-1, 2)
  return ij[:, 0], ij[:, 1]


def in_loop(pairs, q):
  """The schedule ``pairs`` as values of the queries ``q`` (an optimization barrier over both),
  so that every tile's mask is computed inside the forward pass's loop.

  Under a differentiated ``lax.scan`` around the pass (the layer scan of the train step), JAX's
  partial evaluation of that scan moves what its body computes from loop-invariant values
  alone out of it (``jax.lax.scan``'s loop-invariant residuals): here the visibility mask of
  every (query block, key block) pair, computed from the schedule and the key mask alone, would
  be computed once before the layers and kept, stacked over the M pairs: [M, N, K, Q, block_q,
  block_k] bool, quadratic in length. Tied to the queries, which differ at every layer, nothing
  in the loop is loop-invariant. The barrier changes no value.
  """
  _, pairs = jax.lax.optimization_barrier((q, tuple(jnp.asarray(a) for a in pairs)))
  return pairs


def saved_by(policy):
  """``policy`` (a ``jax.checkpoint`` policy) that also saves the blocked kernels' residuals
  (``RESIDUALS``): under it, a backward pass reads the forward's output and log-sum-exp instead
  of recomputing the forward pass's loop from what ``policy`` saved of it."""
  names = jax.checkpoint_policies.save_only_these_names(RESIDUALS)
  return jax.checkpoint_policies.save_from_both_policies(policy, names)


def _forward(q, k, v, key_mask, offset, static_offset, block_q: int, block_k: int):
  """Padded inputs -> (out [N, X, K, Q, W] in v's dtype, lse [N, K, Q, X] float32).

  One scan over the schedule's pairs; each step updates its query block's running maximum,
  normaliser and output, kept for all X queries ([N, K, Q, X] and [N, K, Q, X, W] float32: the
  size of the output) and read and written back at the block.
  """
  n, x, kh, qh, w = q.shape
  scale = w ** -0.5
  num_q, num_k = x // block_q, k.shape[1] // block_k

  def visit(carry, ij):
    m, l, acc = carry
    i, j = ij
    q0, k0 = i * block_q, j * block_k
    qi = jax.lax.dynamic_slice_in_dim(q, q0, block_q, axis=1)
    kj = jax.lax.dynamic_slice_in_dim(k, k0, block_k, axis=1)
    vj = jax.lax.dynamic_slice_in_dim(v, k0, block_k, axis=1)
    m_i, l_i, acc_i = (jax.lax.dynamic_slice_in_dim(a, q0, block_q, axis=3) for a in carry)
    visible = _tile_mask(key_mask, offset, q0, k0, block_q, block_k)
    sc = jnp.where(visible, _scores(qi, kj, scale), _NEG)
    m_new = jnp.maximum(m_i, jnp.max(sc, axis=-1))
    p = jnp.where(visible, jnp.exp(sc - m_new[..., None]), 0.0)
    corr = jnp.exp(m_i - m_new)
    l_i = l_i * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("nkqxs,nskw->nkqxw", p.astype(v.dtype), vj, preferred_element_type=f32)
    acc_i = acc_i * corr[..., None] + pv
    put = lambda a, a_i: jax.lax.dynamic_update_slice_in_dim(a, a_i, q0, axis=3)
    return (put(m, m_new), put(l, l_i), put(acc, acc_i)), None

  init = (jnp.full((n, kh, qh, x), _NEG, f32), jnp.zeros((n, kh, qh, x), f32),
          jnp.zeros((n, kh, qh, x, w), f32))
  pairs = in_loop(block_pairs(static_offset, num_q, num_k, block_q, block_k), q)
  (m, l, acc), _ = jax.lax.scan(visit, init, pairs)
  seen = l > 0
  out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(v.dtype), lse


def _backward(q, k, v, key_mask, offset, static_offset, out, lse, dout, block_q: int,
              block_k: int):
  """Padded inputs -> (dq, dk, dv): one scan over the schedule's pairs, key-major, with dq, dk
  and dv accumulated in float32 at the pair's blocks."""
  n, x, kh, qh, w = q.shape
  s = k.shape[1]
  scale = w ** -0.5
  num_q, num_k = x // block_q, s // block_k
  # D_x = sum_w dout * out: the softmax Jacobian's correction term, [N, K, Q, X].
  delta = jnp.einsum("nxkqw,nxkqw->nkqx", dout.astype(f32), out.astype(f32))

  def visit(carry, ij):
    dq, dk, dv = carry
    i, j = ij
    q0, k0 = i * block_q, j * block_k
    kj = jax.lax.dynamic_slice_in_dim(k, k0, block_k, axis=1)
    vj = jax.lax.dynamic_slice_in_dim(v, k0, block_k, axis=1)
    qi = jax.lax.dynamic_slice_in_dim(q, q0, block_q, axis=1)
    doi = jax.lax.dynamic_slice_in_dim(dout, q0, block_q, axis=1)
    lse_i = jax.lax.dynamic_slice_in_dim(lse, q0, block_q, axis=3)
    delta_i = jax.lax.dynamic_slice_in_dim(delta, q0, block_q, axis=3)
    visible = _tile_mask(key_mask, offset, q0, k0, block_q, block_k)
    p = jnp.where(visible, jnp.exp(_scores(qi, kj, scale) - lse_i[..., None]), 0.0)
    dv_j = jnp.einsum("nkqxs,nxkqw->nskw", p.astype(doi.dtype), doi, preferred_element_type=f32)
    dp = jnp.einsum("nxkqw,nskw->nkqxs", doi, vj, preferred_element_type=f32)
    ds = p * (dp - delta_i[..., None]) * scale
    dq_i = jnp.einsum("nkqxs,nskw->nxkqw", ds, kj.astype(f32))
    dk_j = jnp.einsum("nkqxs,nxkqw->nskw", ds, qi.astype(f32))
    add = lambda a, a_b, at, size: jax.lax.dynamic_update_slice_in_dim(
        a, jax.lax.dynamic_slice_in_dim(a, at, size, axis=1) + a_b, at, axis=1)
    return (add(dq, dq_i, q0, block_q), add(dk, dk_j, k0, block_k),
            add(dv, dv_j, k0, block_k)), None

  init = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32))
  pairs = block_pairs(static_offset, num_q, num_k, block_q, block_k, key_major=True)
  (dq, dk, dv), _ = jax.lax.scan(visit, init, pairs)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q, k, v, key_mask, offset, static_offset, block_q, block_k):
  return _forward(q, k, v, key_mask, offset, static_offset, block_q, block_k)[0]


def _flash_fwd(q, k, v, key_mask, offset, static_offset, block_q, block_k):
  out, lse = _forward(q, k, v, key_mask, offset, static_offset, block_q, block_k)
  out, lse = (checkpoint_name(a, RESIDUALS) for a in (out, lse))  # saved_by
  return out, (q, k, v, key_mask, offset, out, lse)


def _flash_bwd(static_offset, block_q, block_k, residuals, dout):
  q, k, v, key_mask, offset, out, lse = residuals
  dq, dk, dv = _backward(q, k, v, key_mask, offset, static_offset, out, lse, dout, block_q,
                         block_k)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_NxXxKxQxW, k_NxSxKxW, v_NxSxKxW, key_mask_NxS, offset=0, *,
                    block_q: int = 256, block_k: int = 256):
  """Causal grouped-query attention over keys in blocks, with an online softmax.

  Args:
    q_NxXxKxQxW: queries (query x sits at slot ``offset + x``).
    k_NxSxKxW: keys; v_NxSxKxW: values.
    key_mask_NxS: bool, True for real keys.
    offset: int slot of query 0 (the blocks past the diagonal are never visited), or an int32
      scalar (traced: every block pair is visited, the mask skips).
    block_q: queries per block (X is padded up to a multiple; the padding is dropped).
    block_k: keys per block (S padded likewise with masked keys).

  Returns:
    [N, X, K, Q, W] in the values' dtype; differentiable in q, k and v (custom VJP: the
    backward pass recomputes each probability tile from the saved log-sum-exp).
  """
  x, s = q_NxXxKxQxW.shape[1], k_NxSxKxW.shape[1]
  block_q, block_k = max(1, min(block_q, x)), max(1, min(block_k, s))
  q = _pad_to(q_NxXxKxQxW, 1, block_q)
  k, v = _pad_to(k_NxSxKxW, 1, block_k), _pad_to(v_NxSxKxW, 1, block_k)
  key_mask = _pad_to(key_mask_NxS.astype(bool), 1, block_k)
  static_offset = None if isinstance(offset, jax.core.Tracer) else int(offset)
  out = _flash(q, k, v, key_mask, jnp.asarray(offset, jnp.int32), static_offset, block_q,
               block_k)
  return out[:, :x]


def _decode_every_slot(q_NxKxQxW, k_NxKxWxS, v_NxKxSxW, visible_NxS):
  """One query per row over every cache slot in one pass, no loop: ``cached_flash_attention``'s
  math (float32 scores, the unnormalised probabilities rounded to the values' dtype) in
  ``attention.decode_attention``'s form (broadcast multiplies and reductions over the cache as
  stored, fast on XLA:CPU). Its scratch is [N, K, Q, S] float32, a cache row's worth."""
  sc = jnp.sum(q_NxKxQxW[..., None] * k_NxKxWxS.astype(f32)[:, :, None], axis=3)
  visible = visible_NxS[:, None, None]
  sc = jnp.where(visible, sc, _NEG)
  m = jnp.max(sc, axis=-1, keepdims=True)
  p = jnp.where(visible, jnp.exp(sc - m), 0.0).astype(v_NxKxSxW.dtype).astype(f32)
  l = jnp.sum(p, axis=-1)
  out = jnp.sum(p[..., None] * v_NxKxSxW.astype(f32)[:, :, None], axis=3)
  return out / jnp.where(l > 0, l, 1.0)[..., None]  # [N, K, Q, W]


def cached_flash_attention(q_NxXxKxQxW, k_NxKxWxS, v_NxKxSxW, key_mask_NxS, index,
                           block_k: int = 256):
  """X new tokens (at slots ``index`` ..) over a KV cache (``KVCache``'s layout); no gradient
  (the sampler's prefill and decode). With X = 1, ``index`` may be one slot per row ([N]).

  Every slot is read, those past ``index + X - 1`` masked, with no loop whose trip count
  depends on the (traced) index: X > 1 (a prefill) key block by key block with an online
  softmax in a ``lax.scan`` over all ceil(S / block_k) blocks, [N, K, Q, X, block_k] scores at
  a time; X = 1 (a decode step) in one pass over the cache (``_decode_every_slot``). Reading
  only the filled blocks would take a loop whose trip count is the traced index, which on a GPU
  copies its predicate to the host and waits at every iteration, per layer and token (a GPU's
  decode step runs ``decode_attention``'s Pallas kernel, which reads only those, instead); on
  this project's CPU it was not faster either. A decode step (16 rows, 2 key/value heads of 64,
  a 4,128-slot float32 cache): filled blocks only, a ``fori_loop``, 1.2 / 3.1 / 6.9 / 16.6 ms
  at slots 256 / 1,024 / 2,048 / 4,000; every slot in one pass 7.4 ms at any slot (the dense
  kernel 7-9 ms); every slot block by block, a scan, 16-17 ms. Sampling on growth's reference
  model (16 rows, P = 32), against the filled-blocks loop this replaced, in interleaved pairs:
  T = 1,024 0.69-1.05x the wall time (median 0.73x, six pairs), T = 4,096 0.90-0.94x the CPU
  time (two pairs).

  Keys and queries are read as float32 (as ``attention.cached_attention``); the unnormalised
  probabilities are rounded to the values' dtype before the product (bf16: not bit-equal to the
  dense kernel, which rounds the normalised ones).

  Returns:
    [N, X, K, Q, W] in the values' dtype.
  """
  n, x, kh, qh, w = q_NxXxKxQxW.shape
  size = k_NxKxWxS.shape[-1]
  block_k = max(1, min(block_k, size))
  q = q_NxXxKxQxW.astype(f32) * (w ** -0.5)
  if x == 1:
    visible_NxS = key_mask_NxS & (jnp.arange(size) <= jnp.reshape(index, (-1, 1)))
    out = _decode_every_slot(q[:, 0], k_NxKxWxS, v_NxKxSxW, visible_NxS)
    return out[:, None].astype(v_NxKxSxW.dtype)
  qpos = index + jnp.arange(x)

  def key_block(carry, j):
    m, l, acc = carry
    # Block j covers slots j * block_k ..; the last one, where block_k does not divide the
    # cache, is read from size - block_k on with the slots before j * block_k (already seen)
    # masked out.
    start = j * block_k
    k0 = jnp.minimum(start, size - block_k)
    kj = jax.lax.dynamic_slice_in_dim(k_NxKxWxS, k0, block_k, axis=3).astype(f32)
    vj = jax.lax.dynamic_slice_in_dim(v_NxKxSxW, k0, block_k, axis=2).astype(f32)
    keys = jax.lax.dynamic_slice_in_dim(key_mask_NxS, k0, block_k, axis=1)
    slots = k0 + jnp.arange(block_k)
    keys = keys & (slots >= start)[None, :]
    visible = (slots[None, :] <= qpos[:, None])[None] & keys[:, None, :]
    visible = visible[:, None, None]  # [N, 1, 1, X, block_k]
    sc = jnp.where(visible, jnp.einsum("nxkqw,nkws->nkqxs", q, kj), _NEG)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
    p = jnp.where(visible, jnp.exp(sc - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    p = p.astype(v_NxKxSxW.dtype).astype(f32)
    pv = jnp.einsum("nkqxs,nksw->nkqxw", p, vj)
    return (m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv), None

  init = (jnp.full((n, kh, qh, x), _NEG, f32), jnp.zeros((n, kh, qh, x), f32),
          jnp.zeros((n, kh, qh, x, w), f32))
  (_, l, acc), _ = jax.lax.scan(key_block, init, jnp.arange(-(-size // block_k)))
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(v_NxKxSxW.dtype)
