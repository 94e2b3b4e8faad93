"""Blocked attention with an online softmax: memory linear in length, forward and backward.

Shape letters: ``types.py`` (N rows, X queries, S key slots, K key/value heads, Q query heads
per key/value head, W head width). The mask is the one every pass of a causal decoder uses,
given by its parts rather than as an [N, X, S] array: query x (at slot ``offset + x``) sees key
s iff ``s <= offset + x`` and ``key_mask[n, s]``. That covers the per-row pass (offset 0, keys =
queries), the continuation of a shared prompt (keys = [prompt; own row], offset P) and a cache
prefill (offset = the cache index).

``flash_attention`` cuts queries into blocks of ``block_q`` and keys into blocks of
``block_k``; each query block walks the key blocks it can see (causal block skipping: the loop
stops at the diagonal) keeping a running maximum, normaliser and output (the online softmax of
Milakov & Gimelshein, arXiv 1805.02867, as FlashAttention uses it: Dao et al., arXiv 2205.14135;
the backward pass in FlashAttention-2's order, arXiv 2307.08691). Its custom VJP saves only the
output and the per-query log-sum-exp and recomputes each [block_q, block_k] probability tile in
the backward pass, so no [X, S] score or probability array exists in either pass: per layer,
O(N * H * block_q * block_k) scratch plus the O(N * X * H * W) inputs and outputs.

Scores, softmax statistics and every accumulation are float32; inputs may be bfloat16. A query
that sees no key (left padding) gets output 0 (the dense kernel's is a uniform average, equally
unused) and no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity" for masked scores
f32 = jnp.float32


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


# The two loops' bounds (causal block skipping), pure functions of the block positions:
# tests/test_attention.py checks them against hand-worked tables and reads the real loops'
# visits back. Query block i (queries q0 = i * block_q ..) and key block j (keys k0 =
# j * block_k ..) meet iff some query of i may see some key of j: k0 <= offset + q0 +
# block_q - 1, the block's last query's slot.


def key_blocks_seen(offset, q0, block_q: int, block_k: int, num_k: int):
  """The forward's bound: query block q0.. visits key blocks 0 .. this - 1, up to the one that
  holds its last query's slot (``offset`` and ``q0`` may be traced)."""
  last = offset + q0 + block_q - 1
  return jnp.clip(last // block_k + 1, 0, num_k)


def first_query_block(offset, k0, block_q: int, num_q: int):
  """The backward's bound: key block k0.. is visited by query blocks this .. num_q - 1, from the
  one that holds query x = k0 - offset, the first whose slot offset + x reaches k0."""
  return jnp.clip((k0 - offset) // block_q, 0, num_q)


def _forward(q, k, v, key_mask, offset, block_q: int, block_k: int):
  """Padded inputs -> (out [N, X, K, Q, W] in v's dtype, lse [N, K, Q, X] float32)."""
  n, x, kh, qh, w = q.shape
  s = k.shape[1]
  scale = w ** -0.5
  num_q, num_k = x // block_q, s // block_k

  def query_block(i):
    q0 = i * block_q
    qi = jax.lax.dynamic_slice_in_dim(q, q0, block_q, axis=1)

    def key_block(j, carry):
      m, l, acc = carry
      k0 = j * block_k
      kj = jax.lax.dynamic_slice_in_dim(k, k0, block_k, axis=1)
      vj = jax.lax.dynamic_slice_in_dim(v, k0, block_k, axis=1)
      visible = _tile_mask(key_mask, offset, q0, k0, block_q, block_k)
      sc = jnp.where(visible, _scores(qi, kj, scale), _NEG)
      m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
      p = jnp.where(visible, jnp.exp(sc - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      l = l * corr + jnp.sum(p, axis=-1)
      pv = jnp.einsum("nkqxs,nskw->nkqxw", p.astype(v.dtype), vj, preferred_element_type=f32)
      return m_new, l, acc * corr[..., None] + pv

    init = (jnp.full((n, kh, qh, block_q), _NEG, f32), jnp.zeros((n, kh, qh, block_q), f32),
            jnp.zeros((n, kh, qh, block_q, w), f32))
    m, l, acc = jax.lax.fori_loop(
        0, key_blocks_seen(offset, q0, block_q, block_k, num_k), key_block, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(v.dtype), lse

  out, lse = jax.lax.map(query_block, jnp.arange(num_q))
  # [num_q, N, block_q, K, Q, W] -> [N, X, K, Q, W]; [num_q, N, K, Q, block_q] -> [N, K, Q, X]
  out = jnp.moveaxis(out, 0, 1).reshape(n, x, kh, qh, w)
  lse = jnp.moveaxis(lse, 0, 3).reshape(n, kh, qh, x)
  return out, lse


def _backward(q, k, v, key_mask, offset, out, lse, dout, block_q: int, block_k: int):
  """Padded inputs -> (dq, dk, dv): one pass over key blocks, each over the query blocks that
  see it, with dq accumulated in float32 across key blocks."""
  n, x, kh, qh, w = q.shape
  s = k.shape[1]
  scale = w ** -0.5
  num_q, num_k = x // block_q, s // block_k
  # D_x = sum_w dout * out: the softmax Jacobian's correction term, [N, K, Q, X].
  delta = jnp.einsum("nxkqw,nxkqw->nkqx", dout.astype(f32), out.astype(f32))

  def key_block(dq, j):
    k0 = j * block_k
    kj = jax.lax.dynamic_slice_in_dim(k, k0, block_k, axis=1)
    vj = jax.lax.dynamic_slice_in_dim(v, k0, block_k, axis=1)

    def query_block(i, carry):
      dq, dk, dv = carry
      q0 = i * block_q
      qi = jax.lax.dynamic_slice_in_dim(q, q0, block_q, axis=1)
      doi = jax.lax.dynamic_slice_in_dim(dout, q0, block_q, axis=1)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, q0, block_q, axis=3)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, q0, block_q, axis=3)
      visible = _tile_mask(key_mask, offset, q0, k0, block_q, block_k)
      p = jnp.where(visible, jnp.exp(_scores(qi, kj, scale) - lse_i[..., None]), 0.0)
      dv = dv + jnp.einsum("nkqxs,nxkqw->nskw", p.astype(doi.dtype), doi,
                           preferred_element_type=f32)
      dp = jnp.einsum("nxkqw,nskw->nkqxs", doi, vj, preferred_element_type=f32)
      ds = p * (dp - delta_i[..., None]) * scale
      dq_i = jnp.einsum("nkqxs,nskw->nxkqw", ds, kj.astype(f32))
      dq = jax.lax.dynamic_update_slice_in_dim(
          dq, jax.lax.dynamic_slice_in_dim(dq, q0, block_q, axis=1) + dq_i, q0, axis=1)
      dk = dk + jnp.einsum("nkqxs,nxkqw->nskw", ds, qi.astype(f32))
      return dq, dk, dv

    zeros_kv = jnp.zeros((n, block_k, kh, w), f32)
    dq, dk, dv = jax.lax.fori_loop(first_query_block(offset, k0, block_q, num_q), num_q,
                                   query_block, (dq, zeros_kv, zeros_kv))
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, f32), jnp.arange(num_k))
  to_keys = lambda a: jnp.moveaxis(a, 0, 1).reshape(n, s, kh, w)
  return dq.astype(q.dtype), to_keys(dk).astype(k.dtype), to_keys(dv).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _flash(q, k, v, key_mask, offset, block_q, block_k):
  return _forward(q, k, v, key_mask, offset, block_q, block_k)[0]


def _flash_fwd(q, k, v, key_mask, offset, block_q, block_k):
  out, lse = _forward(q, k, v, key_mask, offset, block_q, block_k)
  return out, (q, k, v, key_mask, offset, out, lse)


def _flash_bwd(block_q, block_k, residuals, dout):
  q, k, v, key_mask, offset, out, lse = residuals
  dq, dk, dv = _backward(q, k, v, key_mask, offset, out, lse, dout, block_q, block_k)
  return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q_NxXxKxQxW, k_NxSxKxW, v_NxSxKxW, key_mask_NxS, offset=0, *,
                    block_q: int = 256, block_k: int = 256):
  """Causal grouped-query attention over keys in blocks, with an online softmax.

  Args:
    q_NxXxKxQxW: queries (query x sits at slot ``offset + x``).
    k_NxSxKxW: keys; v_NxSxKxW: values.
    key_mask_NxS: bool, True for real keys.
    offset: int (or int32 scalar) slot of query 0.
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
  out = _flash(q, k, v, key_mask, jnp.asarray(offset, jnp.int32), block_q, block_k)
  return out[:, :x]


def cached_flash_attention(q_NxXxKxQxW, k_NxKxWxS, v_NxKxSxW, key_mask_NxS, index,
                           block_k: int = 256):
  """X new tokens (at slots ``index`` ..) over the filled blocks of a KV cache (``KVCache``'s
  layout), with an online softmax; no gradient (the sampler's prefill and decode).

  Only the ceil((index + X) / block_k) key blocks that hold a written slot are read: a decode
  step at slot s costs O(s), not O(cache size). Keys and queries are read as float32 (as
  ``attention.cached_attention``); the unnormalised probabilities are rounded to the values'
  dtype before the product (bf16: not bit-equal to the dense kernel, which rounds the
  normalised ones). For X = 1 both products are broadcast multiplies and reductions over the
  block (``attention.decode_attention``'s form, fast on XLA:CPU): in a decode loop on this
  project's CPU, 1.3 / 7.2 / 11.3 ms a step at slots 256 / 2,048 / 4,000 of a 4,128-slot cache
  (16 rows, 2 key/value heads of 64) against 9-10 ms for the dense kernel at every slot; a
  ``lax.switch`` over prefix lengths of the dense kernel was slower (2.4 / 11.8 / 10.8 ms).

  Returns:
    [N, X, K, Q, W] in the values' dtype.
  """
  n, x, kh, qh, w = q_NxXxKxQxW.shape
  size = k_NxKxWxS.shape[-1]
  block_k = max(1, min(block_k, size))
  q = q_NxXxKxQxW.astype(f32) * (w ** -0.5)
  qpos = index + jnp.arange(x)

  def key_block(j, carry):
    m, l, acc = carry
    # Block j covers slots j * block_k ..; the last one, where block_k does not divide the
    # cache, is read from size - block_k on with the slots before j * block_k (already seen)
    # masked out.
    start = j * block_k
    k0 = jnp.minimum(start, size - block_k)
    kj = jax.lax.dynamic_slice_in_dim(k_NxKxWxS, k0, block_k, axis=3).astype(f32)
    vj = jax.lax.dynamic_slice_in_dim(v_NxKxSxW, k0, block_k, axis=2)
    keys = jax.lax.dynamic_slice_in_dim(key_mask_NxS, k0, block_k, axis=1)
    slots = k0 + jnp.arange(block_k)
    keys = keys & (slots >= start)[None, :]
    visible = (slots[None, :] <= qpos[:, None])[None] & keys[:, None, :]
    visible = visible[:, None, None]  # [N, 1, 1, X, block_k]
    if x == 1:  # decoding: broadcast multiplies and reductions (``attention.decode_attention``)
      sc = jnp.sum(jnp.moveaxis(q, 1, -1)[..., None] * kj[:, :, None, :, None, :], axis=3)
    else:
      sc = jnp.einsum("nxkqw,nkws->nkqxs", q, kj)
    sc = jnp.where(visible, sc, _NEG)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
    p = jnp.where(visible, jnp.exp(sc - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    p = p.astype(vj.dtype).astype(f32)
    if x == 1:
      pv = jnp.sum(p[..., None] * vj.astype(f32)[:, :, None, None], axis=4)
    else:
      pv = jnp.einsum("nkqxs,nksw->nkqxw", p, vj.astype(f32))
    return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

  init = (jnp.full((n, kh, qh, x), _NEG, f32), jnp.zeros((n, kh, qh, x), f32),
          jnp.zeros((n, kh, qh, x, w), f32))
  filled = jnp.clip((index + x + block_k - 1) // block_k, 1, -(-size // block_k))
  _, l, acc = jax.lax.fori_loop(0, filled, key_block, init)
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(v_NxKxSxW.dtype)
