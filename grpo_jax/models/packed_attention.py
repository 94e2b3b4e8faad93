"""Attention over packed rows: many sequences in one row, each query seeing only its own.

A packed row of C slots holds several sequences back to back (``generate.packing``): a
group's prompt once, then its completions, each completion seeing the prompt and itself. Each
query q carries three slots of its row: ``prompt_start`` and ``prompt_end`` (the range of the
prompt it continues; empty for a prompt token, whose own sequence holds the prompt) and
``seg_start`` (where its own sequence starts). Query q sees key k iff

    k <= q  and  (prompt_start[q] <= k < prompt_end[q]  or  k >= seg_start[q])

which is the per-row pass's causal mask over [prompt; completion] for every query, in a row
that holds many. A padding slot has its own one-slot sequence (it sees itself only).

The pass is blocked as ``flash.flash_attention`` (online softmax, custom VJP recomputing each
probability tile from the saved log-sum-exp; FlashAttention, Dao et al. arXiv 2205.14135 and
2307.08691), over the static list of causal (query block, key block) pairs, and each pair is
computed only when some query of the block sees some key of the block (``lax.cond``): a
packed row of C slots costs the sequences' own blocks and their prompts', about
sum(L_i (P + L_i)), not C^2 / 2. Scores, softmax statistics and every accumulation are
float32. Shape letters: ``types.py`` (N packed rows, C slots, K key/value heads, Q query heads
per key/value head, W head width).
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from grpo_jax.models import attention as attention_lib
from grpo_jax.models import flash

_NEG = -1e30
f32 = jnp.float32


@flax.struct.dataclass
class Segments:
  """Which keys each query of a packed row sees (module doc): int32 [N, C] each."""

  prompt_start: jax.Array
  prompt_end: jax.Array
  seg_start: jax.Array

  def visible(self, q0: int | jax.Array, k0: int | jax.Array, block_q: int,
              block_k: int) -> jax.Array:
    """bool [N, 1, 1, block_q, block_k]: queries q0.. against keys k0.."""
    take = lambda a: jax.lax.dynamic_slice_in_dim(a, q0, block_q, axis=1)[:, :, None]
    qpos = (q0 + jnp.arange(block_q))[None, :, None]
    kpos = (k0 + jnp.arange(block_k))[None, None, :]
    ps, pe, ss = take(self.prompt_start), take(self.prompt_end), take(self.seg_start)
    seen = (kpos <= qpos) & (((ps <= kpos) & (kpos < pe)) | (kpos >= ss))
    return seen[:, None, None]

  def dense(self) -> jax.Array:
    """bool [N, C, C]: the whole mask (tests; the dense reference)."""
    c = self.seg_start.shape[1]
    return self.visible(0, 0, c, c)[:, 0, 0]


def _pad_segments(segments: Segments, size: int) -> Segments:
  """Padded to ``size`` slots, each new slot its own one-slot sequence."""
  c = segments.seg_start.shape[1]
  if size == c:
    return segments
  tail = jnp.broadcast_to(jnp.arange(c, size, dtype=jnp.int32), (segments.seg_start.shape[0],
                                                                  size - c))
  pad = lambda a: jnp.concatenate([a, tail], axis=1)
  return Segments(prompt_start=pad(segments.prompt_start), prompt_end=pad(segments.prompt_end),
                  seg_start=pad(segments.seg_start))


def _forward(q, k, v, segments: Segments, block: int):
  """Padded inputs -> (out [N, C, K, Q, W] in v's dtype, lse [N, K, Q, C] float32)."""
  n, c, kh, qh, w = q.shape
  scale = w ** -0.5
  num = c // block

  def visit(carry, ij):
    m, l, acc = carry
    i, j = ij
    q0, k0 = i * block, j * block
    visible = segments.visible(q0, k0, block, block)
    get = lambda a: jax.lax.dynamic_slice_in_dim(a, q0, block, axis=3)
    m_i, l_i, acc_i = get(m), get(l), get(acc)

    def tile(args):
      m_i, l_i, acc_i = args
      qi = jax.lax.dynamic_slice_in_dim(q, q0, block, axis=1)
      kj = jax.lax.dynamic_slice_in_dim(k, k0, block, axis=1)
      vj = jax.lax.dynamic_slice_in_dim(v, k0, block, axis=1)
      sc = jnp.where(visible, flash._scores(qi, kj, scale), _NEG)  # pylint: disable=protected-access
      m_new = jnp.maximum(m_i, jnp.max(sc, axis=-1))
      p = jnp.where(visible, jnp.exp(sc - m_new[..., None]), 0.0)
      corr = jnp.exp(m_i - m_new)
      pv = jnp.einsum("nkqxs,nskw->nkqxw", p.astype(v.dtype), vj, preferred_element_type=f32)
      return m_new, l_i * corr + jnp.sum(p, axis=-1), acc_i * corr[..., None] + pv

    m_i, l_i, acc_i = jax.lax.cond(jnp.any(visible), tile, lambda a: a, (m_i, l_i, acc_i))
    put = lambda a, a_i: jax.lax.dynamic_update_slice_in_dim(a, a_i, q0, axis=3)
    return (put(m, m_i), put(l, l_i), put(acc, acc_i)), None

  init = (jnp.full((n, kh, qh, c), _NEG, f32), jnp.zeros((n, kh, qh, c), f32),
          jnp.zeros((n, kh, qh, c, w), f32))
  pairs = flash.in_loop(flash.block_pairs(0, num, num, block, block), q)
  (m, l, acc), _ = jax.lax.scan(visit, init, pairs)
  seen = l > 0
  out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
  lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).astype(v.dtype), lse


def _backward(q, k, v, segments: Segments, out, lse, dout, block: int):
  """Padded inputs -> (dq, dk, dv), key-major over the causal pairs, each skipped as in the
  forward."""
  n, c, kh, qh, w = q.shape
  scale = w ** -0.5
  num = c // block
  delta = jnp.einsum("nxkqw,nxkqw->nkqx", dout.astype(f32), out.astype(f32))

  def visit(carry, ij):
    dq, dk, dv = carry
    i, j = ij
    q0, k0 = i * block, j * block
    visible = segments.visible(q0, k0, block, block)

    def tile(_):
      kj = jax.lax.dynamic_slice_in_dim(k, k0, block, axis=1)
      vj = jax.lax.dynamic_slice_in_dim(v, k0, block, axis=1)
      qi = jax.lax.dynamic_slice_in_dim(q, q0, block, axis=1)
      doi = jax.lax.dynamic_slice_in_dim(dout, q0, block, axis=1)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, q0, block, axis=3)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, q0, block, axis=3)
      p = jnp.where(visible, jnp.exp(flash._scores(qi, kj, scale) - lse_i[..., None]), 0.0)  # pylint: disable=protected-access
      dv_j = jnp.einsum("nkqxs,nxkqw->nskw", p.astype(doi.dtype), doi,
                        preferred_element_type=f32)
      dp = jnp.einsum("nxkqw,nskw->nkqxs", doi, vj, preferred_element_type=f32)
      ds = p * (dp - delta_i[..., None]) * scale
      dq_i = jnp.einsum("nkqxs,nskw->nxkqw", ds, kj.astype(f32))
      dk_j = jnp.einsum("nkqxs,nxkqw->nskw", ds, qi.astype(f32))
      return dq_i, dk_j, dv_j

    zeros = lambda _: (jnp.zeros((n, block, kh, qh, w), f32), jnp.zeros((n, block, kh, w), f32),
                       jnp.zeros((n, block, kh, w), f32))
    dq_i, dk_j, dv_j = jax.lax.cond(jnp.any(visible), tile, zeros, None)
    add = lambda a, a_b, at: jax.lax.dynamic_update_slice_in_dim(
        a, jax.lax.dynamic_slice_in_dim(a, at, block, axis=1) + a_b, at, axis=1)
    return (add(dq, dq_i, q0), add(dk, dk_j, k0), add(dv, dv_j, k0)), None

  init = (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32))
  pairs = flash.block_pairs(0, num, num, block, block, key_major=True)
  (dq, dk, dv), _ = jax.lax.scan(visit, init, pairs)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _packed(q, k, v, segments, block):
  return _forward(q, k, v, segments, block)[0]


def _packed_fwd(q, k, v, segments, block):
  out, lse = _forward(q, k, v, segments, block)
  out, lse = (checkpoint_name(a, flash.RESIDUALS) for a in (out, lse))  # flash.saved_by
  return out, (q, k, v, segments, out, lse)


def _packed_bwd(block, residuals, dout):
  q, k, v, segments, out, lse = residuals
  dq, dk, dv = _backward(q, k, v, segments, out, lse, dout, block)
  zero = jax.tree.map(lambda a: jnp.zeros(a.shape, jax.dtypes.float0), segments)
  return dq, dk, dv, zero


_packed.defvjp(_packed_fwd, _packed_bwd)


def packed_attention(q_NxCxKxQxW, k_NxCxKxW, v_NxCxKxW, segments: Segments, *,
                     impl: str = "blocked", block: int = 256, query_block: int = 0):
  """Grouped-query attention over packed rows (module doc).

  Args:
    q_NxCxKxQxW: queries (query c at slot c of its row).
    k_NxCxKxW, v_NxCxKxW: keys and values.
    segments: which keys each query sees (``Segments``, [N, C] each).
    impl: ``model.attention`` resolved at C keys (``attention.resolve``): "xla" computes the
      dense [N, K, Q, C, C] scores under the whole mask (``query_block`` queries at a time when
      > 0); anything else runs the blocked pass above (a fused kernel cannot express the
      mask).
    block: at most this many queries and keys per block of the blocked pass (as many blocks as
      that needs, of equal size; C padded up to a multiple, the padding its own sequences).
    query_block: "xla" only: queries per rematerialised block (0 = all at once).

  Returns:
    [N, C, K, Q, W] in the values' dtype; differentiable in q, k and v.
  """
  c = q_NxCxKxQxW.shape[1]
  if attention_lib.resolve(impl, c) == "xla":
    mask = segments.dense()
    if 0 < query_block < c:
      return attention_lib.blocked_attention(q_NxCxKxQxW, k_NxCxKxW, v_NxCxKxW, mask,
                                             query_block)
    return attention_lib.attention(q_NxCxKxQxW, k_NxCxKxW, v_NxCxKxW, mask)
  # As many blocks as ``block`` needs, of equal size: C = 1,056 in blocks of 256 would pad to
  # 1,280; five blocks of 212 pad to 1,060.
  num = -(-c // max(1, min(block, c)))
  block = -(-c // num)
  size = num * block
  q = flash._pad_to(q_NxCxKxQxW, 1, block)  # pylint: disable=protected-access
  k, v = flash._pad_to(k_NxCxKxW, 1, block), flash._pad_to(v_NxCxKxW, 1, block)  # pylint: disable=protected-access
  out = _packed(q, k, v, _pad_segments(segments, size), block)
  return out[:, :c]
