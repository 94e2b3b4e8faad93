"""Teacher-forced log-probs of completions over packed rows: the pass at the real tokens.

``logprobs.completion_logprobs_and_entropy`` computes every row at [P + T] (or each prompt once
and every completion at T); at reasoning lengths most of that is padding. Here the rows' real
tokens are packed (``packing.plan`` / ``layout``: rows first-fit decreasing, each group's
prompt once per packed row) into N packed rows of C = P + T slots, and the model runs over
them ``rows_per_pass`` packed rows at a time: a ``lax.scan`` over the packed rows in passes, a
pass whose rows hold nothing (past ``Plan.used``) skipped (``lax.cond``), so the work is what
the rows hold, rounded up to a pass. Each slot's hidden state predicts the next token of its own
completion; a completion's first token is predicted from its prompt's last slot. The log-probs
come back in the padded [N, T] layout, so every loss, aggregation and metric reads them as
before (0 past each row's length, where callers mask).

Values: those of the padded pass up to float rounding (the same tokens, positions and keys;
sums over other sizes). Memory: the packed buffers are the padded layout's size (K x C = N (P
+ T)), and a differentiated pass keeps one pass's activations per pass of the scan (what it
holds: at most the padded layout's). Under a mesh (``shards``) the rows are packed per device:
each device's block of rows into its own packed rows, so a pass never moves a token between
devices and the parameters are gathered per layer as in the padded pass (FSDP unchanged).
Shape letters: ``types.py`` (S blocks, M = N / S rows a block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.generate import logprobs as logprobs_lib
from grpo_jax.generate import packing
from grpo_jax.models.causal_lm import CausalLM
from grpo_jax.models.packed_attention import Segments
from grpo_jax.sharding import constrain


def packed_logprobs_and_entropy(model: CausalLM, prompt_ids_NxP, prompt_mask_NxP,
                                completion_ids_NxT, completion_mask_NxT,
                                temperature: float = 1.0, with_entropy: bool = False,
                                chunk_tokens: int = 0, remat: bool = False, group: int = 1,
                                rows_per_pass: int = 1, query_block: int = 0,
                                shards: int = 1):
  """Log-probs (and entropy) of each completion's tokens, computed over packed rows.

  Args:
    model: the policy.
    prompt_ids_NxP, prompt_mask_NxP: left-padded prompts (rows i // G share one when G > 1;
      the caller guarantees it).
    completion_ids_NxT: completions.
    completion_mask_NxT: bool, each completion's tokens (a prefix: through its end); the
      tokens computed. None: all T.
    temperature: the sampling temperature.
    with_entropy: also the entropy of each next-token distribution.
    chunk_tokens: positions per LM-head block (``logprobs``; 0: a pass's C slots at once).
    remat: checkpoint each decoder block.
    query_block: queries per attention block of the dense kernel (0 = all at once).
    group: G: rows in runs of G repeating one prompt (N a multiple), whose prompt is placed
      once per packed row; 1: every row its own prompt.
    rows_per_pass: packed rows per model pass, of each block (a block's N / S packed rows
      padded up to a multiple).
    shards: S: the rows are S contiguous blocks packed apart (``packing.plan``), the blocks a
      mesh's batch axes give each device: each pass runs ``rows_per_pass`` packed rows of every
      block, split over the batch axes, so a device computes its own rows' packed rows. N / S
      a multiple of ``group``.

  Returns:
    (logp float32 [N, T], entropy float32 [N, T] or None): 0 past each row's length.
  """
  n, t = completion_ids_NxT.shape
  if completion_mask_NxT is None:
    completion_mask_NxT = jnp.ones((n, t), bool)
  completion_mask_NxT = completion_mask_NxT.astype(bool)
  s = shards
  plan = packing.plan(prompt_mask_NxP, completion_mask_NxT, group, s)
  lay = packing.layout(plan, prompt_ids_NxP, prompt_mask_NxP, completion_ids_NxT, group)
  c = lay.ids.shape[1]
  m = n // s  # rows, and packed rows, of a block
  r = max(1, min(rows_per_pass, m))
  passes = -(-m // r)
  lay = _pad_rows(lay, s, passes * r)
  # Each row's place in its block's packed rows, [S, N / S].
  in_block = lambda a: a.reshape(s, m)
  local_bin = in_block(plan.bin % m)
  first = in_block(packing.first_slot(plan))
  d = model.config.hidden_size

  def one_pass(h_first_SxMxD, xs):
    i, ids, positions, segments, target = xs  # [S, R, C] each: the pass's rows of every block
    flat = lambda a: constrain(a.reshape((s * r,) + a.shape[2:]), ("batch", None))

    def run(_):
      h_SRxCxD = model.packed_hidden_states(flat(ids), flat(positions),
                                            jax.tree.map(flat, segments), remat, query_block)
      logp, ent = logprobs_lib.hidden_logprobs_and_entropy(
          model, h_SRxCxD, jnp.maximum(flat(target), 0), temperature, with_entropy,
          chunk_tokens)
      # Each row's prompt-end state, for the rows whose unit is in this pass (a gather within
      # each block: a device reads its own packed rows).
      local = local_bin - i * r
      mine = (local >= 0) & (local < r)
      h = jax.vmap(lambda h_RxCxD, at, slot: h_RxCxD[at, slot])(
          h_SRxCxD.reshape(s, r, c, d), jnp.clip(local, 0, r - 1), first)
      h = jnp.where(mine[..., None], h.astype(jnp.float32), 0.0)
      block = lambda a: a.reshape(s, r, c)
      return block(logp), block(ent if with_entropy else jnp.zeros_like(logp)), h

    def skip(_):
      z = jnp.zeros((s, r, c), jnp.float32)
      return z, z, jnp.zeros((s, m, d), jnp.float32)

    logp, ent, h = jax.lax.cond(i * r < plan.used, run, skip, None)
    return h_first_SxMxD + h, (logp, ent)

  # Each pass is rematerialised in the backward pass: the scan's residuals are then a pass's
  # inputs (the parameters, closed over, stay loop-invariant: one copy). Without it a
  # differentiated scan keeps every pass's activations, the skipped passes' as zeros of the
  # same size (a cond's branches share their residuals): on 16 rows at T = 1,024 with
  # bench.rollouts' lengths the gradient took 2.48 s without and 1.84 s with (the padded
  # pass's: 4.05 s; the forwards 0.32 s and 0.91 s). The checkpoint wraps the whole pass, cond
  # included: around ``run`` alone its inputs, the parameters among them, became the cond's
  # per-pass residuals, stacked once per pass (Qwen3-0.6B, 16 rows of T = 4,096: a planned
  # peak of 62 GB against the padded step's 34 GB).
  one_pass = jax.checkpoint(one_pass, prevent_cse=False)

  # [S x passes x R, C] -> [passes, S, R, C]: pass i holds rows i R .. (i + 1) R - 1 of every
  # block, split over the batch axes as the blocks are.
  by_pass = lambda a: constrain(
      jnp.swapaxes(a.reshape((s, passes, r) + a.shape[1:]), 0, 1), (None, "batch"))
  xs = (jnp.arange(passes), by_pass(lay.ids), by_pass(lay.positions),
        jax.tree.map(by_pass, lay.segments), by_pass(lay.target))
  h_first, (logp_packed, ent_packed) = jax.lax.scan(
      one_pass, jnp.zeros((s, m, d), jnp.float32), xs)
  h_first = h_first.reshape(n, d).astype(jnp.dtype(model.config.dtype))
  first_logp, first_ent = logprobs_lib.hidden_logprobs_and_entropy(
      model, h_first[:, None], completion_ids_NxT[:, :1], temperature, with_entropy, 0)

  j_T = jnp.arange(t, dtype=jnp.int32)[None]
  at = (local_bin.reshape(n, 1) * c + plan.completion_at[:, None] + j_T - 1)  # token j >= 1
  valid = j_T < plan.length[:, None]

  def assemble(packed_PxSxRxC, first_N):
    # Each block's packed rows, flat, read at its own rows' slots.
    flat = jnp.swapaxes(packed_PxSxRxC, 0, 1).reshape(s, -1)
    rest = jax.vmap(lambda f, a: f[jnp.clip(a, 0, f.shape[0] - 1)])(
        flat, at.reshape(s, m, t)).reshape(n, t)
    return jnp.where(valid, jnp.where(j_T == 0, first_N, rest), 0.0)

  logp = assemble(logp_packed, first_logp)
  ent = assemble(ent_packed, first_ent) if with_entropy else None
  return logp, ent


def _pad_rows(lay: packing.Layout, blocks: int, rows: int) -> packing.Layout:
  """The layout with each of its ``blocks`` padded by empty packed rows up to ``rows`` (each
  slot its own sequence)."""
  k, c = lay.ids.shape
  m = k // blocks
  if rows == m:
    return lay
  own = jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (blocks, rows - m, c))

  def pad(a, extra):
    return jnp.concatenate([a.reshape(blocks, m, c), extra], axis=1).reshape(blocks * rows, c)

  full = lambda fill: jnp.full((blocks, rows - m, c), fill, jnp.int32)
  seg = lambda a: pad(a, own)
  return packing.Layout(ids=pad(lay.ids, full(0)), positions=pad(lay.positions, full(0)),
                        segments=Segments(prompt_start=seg(lay.segments.prompt_start),
                                          prompt_end=seg(lay.segments.prompt_end),
                                          seg_start=seg(lay.segments.seg_start)),
                        target=pad(lay.target, full(-1)))
