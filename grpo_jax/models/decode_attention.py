"""One decode step over a KV cache as one Pallas GPU kernel: no loop for XLA to run.

XLA:GPU runs a ``while`` whose trip count is a traced value by copying its predicate to the
host and waiting, at every iteration. Reading only the filled blocks of the cache with XLA ops
takes such a loop per layer (the ``blocked`` kernel's decode step was one: layers x blocks host
round trips per generated token; it now reads every slot, ``flash.cached_flash_attention``).
Here the loop over the filled blocks runs inside one kernel, on the device (Triton's own loop,
its bound read from device memory), so a decode step has no host synchronisation of its own
and still reads O(s) slots at slot s, not the whole cache.

The kernel is JAX's Pallas decode attention (``jax.experimental.pallas.ops.gpu.
decode_attention``: ``gqa`` / ``attn_forward_kernel``; split-K with a final log-sum-exp
combine as in Flash-Decoding, Dao et al. 2023) adapted to this project's cache rather than
called as it is, because

* its keys are [S, W] per row and head, ours ``KVCache``'s [N, K, W, S] (transposed, so that
  the XLA paths read them without a copy): ``gqa`` would need a transposed copy of every
  layer's key cache at every token, more traffic than the dense kernel's one read; here the
  [W, block_k] key tile is read in place and is the dot's right operand as it stands;
* its mask is one range [start_idx, kv_seq_len) per row; ours is the cache's key mask (left
  padding, any holes), read as a tile next to the keys, with the causal bound ``index``;
* its length must be a multiple of 16 splits of a multiple of ``block_k``; the cache has
  P + T slots, whatever they are: the tail is a masked load.

Math as ``flash.cached_flash_attention`` for X = 1 (scores and softmax float32, queries and
keys read as float32 with IEEE float32 dots, unnormalised probabilities rounded to the values'
dtype before the product, float32 accumulation): tests/models/test_attention.py runs it in Pallas'
interpreter on the CPU against the ``xla`` kernel; compiling and timing it needs a GPU
(``attention.cache_kernel`` picks it there).

Shape letters: ``types.py`` (N rows, K key/value heads, Q query heads per key/value head, W head
width, S cache slots).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite "minus infinity", as in flash.py
# Triton's dot needs at least 16 rows: the Q query heads of a key/value head are padded to this
# (JAX's kernel's ``block_h``).
_MIN_ROWS = 16
# Slots per tile (JAX's ``gqa`` default), whatever ``model.attention_block`` is.
BLOCK_K = 128
# At most this many programs per (row, key/value head) split the cache (JAX's ``k_splits``).
MAX_SPLITS = 16
f32 = jnp.float32


def _pallas():
  """Pallas and its Triton primitives, imported when a kernel is built (about a second of
  import that no CPU run needs)."""
  # pylint: disable=g-import-not-at-top
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plgpu
  return pl, plgpu


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def supported(q_NxXxKxQxW, v_NxKxSxW, block_k: int = BLOCK_K) -> bool:
  """Shapes and dtypes the kernel takes (one query per row; Triton's tiles are powers of 2 of
  at least 16 along every dot dimension)."""
  x, w = q_NxXxKxQxW.shape[1], q_NxXxKxQxW.shape[-1]
  return (x == 1 and _pow2(w) and w >= 16 and _pow2(block_k) and block_k >= 16
          and v_NxKxSxW.dtype in (jnp.float32, jnp.bfloat16, jnp.float16))


def splits(size: int, block_k: int, max_splits: int = MAX_SPLITS) -> tuple[int, int]:
  """(number of splits, slots per split, a multiple of ``block_k``) covering ``size`` slots."""
  blocks = -(-size // block_k)
  per_split = -(-blocks // min(blocks, max_splits))
  return -(-blocks // per_split), per_split * block_k


def _kernel(q_ref, k_ref, v_ref, mask_ref, length_ref, o_ref, l_ref, m_ref, *, size: int,
            split: int, block_k: int):
  """One (row, key/value head, split): slots [split_id * split, ..) up to the row's length.

  q_ref [R, W] float32, pre-scaled (R padded query heads); k_ref [W, S]; v_ref [S, W];
  mask_ref [S] int32 (the cache's key mask); length_ref [] int32 (index + 1, the slots a
  query at ``index`` may see). Writes the unnormalised output o_ref [R, W], the normaliser
  l_ref [R] and the running maximum m_ref [R] (float32) for the combine.
  """
  pl, plgpu = _pallas()
  rows = q_ref.shape[0]
  lo = pl.program_id(2) * split
  hi = jnp.minimum(jnp.minimum(lo + split, length_ref[()]), size)
  q = q_ref[...]
  offsets = jnp.arange(block_k)

  def block(b, carry):
    o, m, l = carry
    start = lo + b * block_k
    slots = start + offsets
    inside = slots < size  # the cache's tail: a masked load, no padded copy
    kb = plgpu.load(k_ref.at[:, pl.ds(start, block_k)], mask=inside[None, :], other=0)
    vb = plgpu.load(v_ref.at[pl.ds(start, block_k), :], mask=inside[:, None], other=0)
    real = plgpu.load(mask_ref.at[pl.ds(start, block_k)], mask=inside, other=0)
    visible = ((real != 0) & (slots < hi))[None, :]
    sc = plgpu.dot(q, kb.astype(f32), allow_tf32=False)  # [R, block_k]
    sc = jnp.where(visible, sc, _NEG)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    p = jnp.where(visible, jnp.exp(sc - m_new[:, None]), 0.0)
    corr = jnp.exp(m - m_new)
    p = p.astype(vb.dtype)
    pv = plgpu.dot(p, vb, allow_tf32=False) if vb.dtype == f32 else plgpu.dot(p, vb)
    return o * corr[:, None] + pv, m_new, l * corr + jnp.sum(p.astype(f32), axis=1)

  init = (jnp.zeros(o_ref.shape, f32), jnp.full((rows,), _NEG, f32), jnp.zeros((rows,), f32))
  # The loop's bound is the row's length, read on the device: a split past it runs no block.
  trips = jnp.maximum(hi - lo + block_k - 1, 0) // block_k
  o, m, l = jax.lax.fori_loop(0, trips, block, init)
  plgpu.store(o_ref, o)
  plgpu.store(l_ref, l)
  plgpu.store(m_ref, m)


def decode_attention(q_NxXxKxQxW, k_NxKxWxS, v_NxKxSxW, key_mask_NxS, index, *,
                     block_k: int = BLOCK_K, interpret: bool = False, num_warps: int = 4,
                     num_stages: int = 2):
  """One new token per row (at slot ``index``) over a KV cache in ``KVCache``'s layout.

  Under a mesh (``sharding.use_mesh``) the kernel runs per shard in ``shard_map``, rows split
  like the cache's batch and key/value heads like its ``kv_heads`` (where they divide): XLA
  cannot partition a Triton call and would otherwise gather every shard's cache to each device
  at every token. Each (row, key/value head) is independent, so the split changes no value.

  Args:
    q_NxXxKxQxW: the new tokens' queries, X = 1.
    k_NxKxWxS, v_NxKxSxW: the cache's keys and values (any float dtype; read in place).
    key_mask_NxS: True where a slot holds a real token.
    index: int32, the new token's slot, one for every row or one per row ([N]: a slot pool);
      it sees slots 0 .. index whose key is real.
    block_k: slots per tile (a power of 2, >= 16).
    interpret: run in Pallas' interpreter (any backend; the tests' CPU check).
    num_warps, num_stages: Triton's launch settings (JAX's kernel's defaults).

  Returns:
    [N, 1, K, Q, W] in the values' dtype.
  """
  call = functools.partial(_decode, block_k=block_k, interpret=interpret, num_warps=num_warps,
                           num_stages=num_stages)
  args = (q_NxXxKxQxW, k_NxKxWxS, v_NxKxSxW, key_mask_NxS, jnp.asarray(index, jnp.int32))
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return call(*args)
  from grpo_jax import sharding  # pylint: disable=g-import-not-at-top
  rows, heads = sharding.logical_spec(("batch", "kv_heads"))
  rows = rows if q_NxXxKxQxW.shape[0] % sharding.axis_size(mesh, rows) == 0 else None
  heads = heads if q_NxXxKxQxW.shape[2] % sharding.axis_size(mesh, heads) == 0 else None
  spec = jax.sharding.PartitionSpec
  in_specs = (spec(rows, None, heads), spec(rows, heads), spec(rows, heads), spec(rows),
              spec(rows) if args[-1].ndim else spec())
  return jax.shard_map(call, mesh=mesh, in_specs=in_specs, out_specs=spec(rows, None, heads),
                       check_vma=False)(*args)


@functools.partial(jax.jit, static_argnames=("block_k", "interpret", "num_warps", "num_stages"))
def _decode(q_NxXxKxQxW, k_NxKxWxS, v_NxKxSxW, key_mask_NxS, index, *, block_k: int,
            interpret: bool, num_warps: int, num_stages: int):
  """``decode_attention`` on one device's rows and heads."""
  pl, plgpu = _pallas()
  n, _, kh, qh, w = q_NxXxKxQxW.shape
  size = k_NxKxWxS.shape[-1]
  rows = max(_MIN_ROWS, 1 << (qh - 1).bit_length())
  num_splits, split = splits(size, block_k)
  q = q_NxXxKxQxW[:, 0].astype(f32) * (w ** -0.5)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - qh), (0, 0)))  # [N, K, R, W], a few KiB
  length_N = jnp.broadcast_to(jnp.asarray(index, jnp.int32) + 1, (n,))
  kernel = functools.partial(_kernel, size=size, split=split, block_k=block_k)
  per_program = lambda *block: pl.BlockSpec(block, lambda i, h, s: (s, i, h) + (0,) * (
      len(block) - 3))
  o, l, m = pl.pallas_call(
      kernel,
      grid=(n, kh, num_splits),
      in_specs=[
          pl.BlockSpec((None, None, rows, w), lambda i, h, s: (i, h, 0, 0)),
          pl.BlockSpec((None, None, w, size), lambda i, h, s: (i, h, 0, 0)),
          pl.BlockSpec((None, None, size, w), lambda i, h, s: (i, h, 0, 0)),
          pl.BlockSpec((None, size), lambda i, h, s: (i, 0)),
          pl.BlockSpec((None,), lambda i, h, s: (i,)),
      ],
      out_specs=[per_program(None, None, None, rows, w), per_program(None, None, None, rows),
                 per_program(None, None, None, rows)],
      out_shape=[jax.ShapeDtypeStruct((num_splits, n, kh, rows, w), f32),
                 jax.ShapeDtypeStruct((num_splits, n, kh, rows), f32),
                 jax.ShapeDtypeStruct((num_splits, n, kh, rows), f32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="cache_decode_attention",
  )(q, k_NxKxWxS, v_NxKxSxW, key_mask_NxS.astype(jnp.int32), length_N)
  # The splits' log-sum-exp combine (JAX's ``decode_attn_unbatched``; its barrier on the
  # maximum works around wrong values after XLA's fusion, b/389925439).
  m_all = jax.lax.optimization_barrier(jnp.max(m, axis=0))
  corr = jnp.exp(m - m_all)
  l_all = jnp.sum(l * corr, axis=0)
  out = jnp.sum(o * corr[..., None], axis=0) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
  return out[:, None, :, :qh].astype(v_NxKxSxW.dtype)
