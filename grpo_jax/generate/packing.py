"""Packing rows of a batch into packed rows of a fixed token capacity, in fixed shapes.

At reasoning lengths completions are heavy-tailed (most end early, a few reach T), and a
log-prob pass over [P + T] per row computes mostly padding. Packing places only the real
tokens, back to back, in K packed rows of C slots each (the layout of verl's
``use_remove_padding`` and MaxText's packed segments), and a pass over the packed rows costs
what the rows hold (``models.packed_attention`` keeps each sequence to its own keys).

Units are rows, placed first-fit decreasing (the longest completion first, each into the
first packed row with room): one ``lax.scan`` over the rows on the device, no host round trip.
With ``group`` G > 1 (group-major rows repeating one prompt, ``prompt_group``) a row's group's
prompt is placed once in each packed row that holds any of its rows, before the first of them:
the rows after it see it as their prompt (the shared-prompt saving of
``CausalLM.grouped_hidden_states``, per packed row); with G = 1 every row brings its own. A
packed row has C = P + T slots, so any row fits alone; then K = N packed rows always hold every
row (each at worst in its own), no row is ever dropped, and K x C = N (P + T): the packed
buffers are the padded layout's size, whatever the lengths.

Positions restart per sequence as in the padded layout (a prompt's real tokens from 0, its
completion's from the prompt's length), so every token gets the position, keys and queries of
the per-row pass. Shape letters: ``types.py`` (U units, K packed rows, C slots a row).
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from grpo_jax.models.packed_attention import Segments


@flax.struct.dataclass
class Plan:
  """Where each row went (int32 [N] each, but ``writes_prompt`` and ``used``).

  Attributes:
    bin: the packed row holding it.
    prompt_at: slot of the first real token of its prompt's copy in that packed row (rows of a
      group in one packed row share it).
    completion_at: slot of its completion's first token.
    prompt_len: its prompt's real tokens P_i.
    length: its completion's tokens L_i.
    writes_prompt: bool [N], the row placed that copy (the first of its group there).
    used: int32 scalar, packed rows holding any row (they are rows 0 .. used - 1; with
      shards, of each block: the most any block holds).
  """

  bin: jax.Array
  prompt_at: jax.Array
  completion_at: jax.Array
  prompt_len: jax.Array
  length: jax.Array
  writes_prompt: jax.Array
  used: jax.Array


def capacity(prompt_len: int, completion_len: int) -> int:
  """C: the slots of a packed row, one row's most tokens, P + T."""
  return prompt_len + completion_len


def plan(prompt_mask_NxP: jax.Array, completion_mask_NxT: jax.Array, group: int,
         shards: int = 1) -> Plan:
  """First-fit decreasing of the rows into N packed rows of ``capacity`` slots, each row's
  group's prompt once per packed row (module doc).

  With ``shards`` S > 1 the rows and the packed rows are S contiguous blocks of N / S (the
  blocks a mesh's batch axes give each device) and each block is packed on its own: a row
  goes only to a packed row of its block, so a device's packed rows hold its own rows. Then
  ``used`` is the most packed rows any block uses (the passes every device runs).

  A row costs its L_i tokens, plus P_i when its group has no prompt copy in the packed row
  yet; it goes to the first packed row where that fits. The carry is each packed row's fill
  [N] and where each group's prompt copy sits in it [N, N / G] (-1: none yet).

  Args:
    prompt_mask_NxP: bool, the real (left-padded) prompt tokens.
    completion_mask_NxT: bool, the completion tokens to place (a prefix of each row: a
      completion's tokens up to its end).
    group: G (N / S a multiple of it; rows i // G share a prompt when G > 1).
    shards: S, blocks packed apart (N a multiple of it).

  Returns:
    The Plan (``bin`` the packed row among all N).
  """
  n, p = prompt_mask_NxP.shape
  if shards > 1:
    m = n // shards
    block = lambda a: a.reshape((shards, m) + a.shape[1:])
    each = jax.vmap(lambda pm, cm: plan(pm, cm, group))(block(prompt_mask_NxP),
                                                         block(completion_mask_NxT))
    whole = lambda a: a.reshape(n)
    return Plan(bin=whole(each.bin + m * jnp.arange(shards, dtype=jnp.int32)[:, None]),
                prompt_at=whole(each.prompt_at), completion_at=whole(each.completion_at),
                prompt_len=whole(each.prompt_len), length=whole(each.length),
                writes_prompt=whole(each.writes_prompt), used=jnp.max(each.used))
  t = completion_mask_NxT.shape[1]
  c = capacity(p, t)
  prompt_len = jnp.sum(prompt_mask_NxP, axis=1, dtype=jnp.int32)
  length = jnp.sum(completion_mask_NxT, axis=1, dtype=jnp.int32)
  group_N = jnp.arange(n, dtype=jnp.int32) // group
  order = jnp.argsort(-(length + prompt_len), stable=True)

  def place(carry, i):
    fill_K, copy_KxB = carry
    g = group_N[i]
    have_K = copy_KxB[:, g] >= 0
    cost_K = length[i] + jnp.where(have_K, 0, prompt_len[i])
    b = jnp.argmax(fill_K + cost_K <= c).astype(jnp.int32)  # the first with room
    new = ~have_K[b]
    prompt_at = jnp.where(new, fill_K[b], copy_KxB[b, g])
    completion_at = fill_K[b] + jnp.where(new, prompt_len[i], 0)
    copy_KxB = copy_KxB.at[b, g].set(prompt_at)
    fill_K = fill_K.at[b].add(cost_K[b])
    return (fill_K, copy_KxB), (b, prompt_at, completion_at, new)

  init = (jnp.zeros((n,), jnp.int32), jnp.full((n, n // group), -1, jnp.int32))
  (fill, _), placed = jax.lax.scan(place, init, order)
  back = lambda x: jnp.zeros((n,), x.dtype).at[order].set(x)
  bins, prompt_at, completion_at, new = map(back, placed)
  return Plan(bin=bins, prompt_at=prompt_at, completion_at=completion_at,
              prompt_len=prompt_len, length=length, writes_prompt=new,
              used=jnp.sum(fill > 0, dtype=jnp.int32))


@flax.struct.dataclass
class Layout:
  """The packed rows' inputs (int32 [K, C] each, but ``segments``).

  Attributes:
    ids: token ids (0 in empty slots).
    positions: position ids (restarting per sequence, as the padded layout's).
    segments: which keys each slot sees (``packed_attention.Segments``).
    target: the token each slot's hidden state predicts within its completion (the next
      completion token), or -1 (prompt slots, a completion's last token, empty slots); a
      completion's first token is predicted from its prompt's last slot (``first_slot``).
  """

  ids: jax.Array
  positions: jax.Array
  segments: Segments
  target: jax.Array


def layout(plan_: Plan, prompt_ids_NxP: jax.Array, prompt_mask_NxP: jax.Array,
           completion_ids_NxT: jax.Array, group: int) -> Layout:
  """The packed rows of ``plan_`` (``plan``): each unit's prompt once, its completions after.

  Args:
    plan_: the Plan.
    prompt_ids_NxP, prompt_mask_NxP: left-padded prompts (a group's rows repeat one).
    completion_ids_NxT: completions (the first ``plan_.length`` tokens of each placed).
    group: G, as planned.

  Returns:
    The Layout, [N, C] each.
  """
  del group  # the plan says which rows write their prompt's copies
  n, p = prompt_ids_NxP.shape
  t = completion_ids_NxT.shape[1]
  k, c = n, capacity(p, t)
  slots = jnp.arange(c, dtype=jnp.int32)
  pl = plan_
  # Prompt tokens: the row that placed its packed row's copy writes it; a real token at padded
  # position j sits at prompt_at + j - (P - P_i) with position j - (P - P_i).
  pad_N = p - pl.prompt_len
  prompt_pos_NxP = jnp.arange(p, dtype=jnp.int32)[None] - pad_N[:, None]
  prompt_ok = prompt_mask_NxP.astype(bool) & pl.writes_prompt[:, None]
  prompt_slot = jnp.where(prompt_ok, pl.bin[:, None] * c + pl.prompt_at[:, None]
                          + prompt_pos_NxP, k * c)  # k * c: out of range, dropped
  # Completion tokens j < L_i at completion_at + j, positions P_i + j.
  j_T = jnp.arange(t, dtype=jnp.int32)[None]
  comp_ok = j_T < pl.length[:, None]
  comp_slot = jnp.where(comp_ok, pl.bin[:, None] * c + pl.completion_at[:, None] + j_T, k * c)
  flat = lambda fill: jnp.full((k * c,), fill, jnp.int32)
  put = lambda base, at, values: base.at[at.reshape(-1)].set(
      jnp.broadcast_to(values, at.shape).reshape(-1).astype(jnp.int32), mode="drop")
  own = jnp.broadcast_to(slots, (k, c)).reshape(-1)  # an empty slot: its own sequence
  ids = put(put(flat(0), prompt_slot, prompt_ids_NxP), comp_slot, completion_ids_NxT)
  positions = put(put(flat(0), prompt_slot, prompt_pos_NxP),
                  comp_slot, pl.prompt_len[:, None] + j_T)
  prompt_start = put(put(own, prompt_slot, pl.prompt_at[:, None]),
                     comp_slot, pl.prompt_at[:, None])
  prompt_end = put(put(own, prompt_slot, pl.prompt_at[:, None]),
                   comp_slot, (pl.prompt_at + pl.prompt_len)[:, None])
  seg_start = put(put(own, prompt_slot, pl.prompt_at[:, None]),
                  comp_slot, pl.completion_at[:, None])
  # Slot completion_at + j - 1 predicts token j, for 1 <= j < L_i.
  next_ok = (j_T >= 1) & comp_ok
  target = put(flat(-1), jnp.where(next_ok, comp_slot - 1, k * c), completion_ids_NxT)
  shape = lambda a: a.reshape(k, c)
  return Layout(ids=shape(ids), positions=shape(positions),
                segments=Segments(prompt_start=shape(prompt_start),
                                  prompt_end=shape(prompt_end), seg_start=shape(seg_start)),
                target=shape(target))


def first_slot(plan_: Plan) -> jax.Array:
  """int32 [N]: the slot (in its packed row ``plan_.bin``) whose hidden state predicts each
  row's first completion token: its prompt's last real token."""
  return plan_.prompt_at + plan_.prompt_len - 1


def real_tokens(plan_: Plan, group: int) -> jax.Array:
  """int32 scalar: the real tokens of the rows: each group's prompt once (the rows of one
  prompt a run of ``group``), every completion's tokens. A prompt copied into several packed
  rows counts once: the copies are positions computed, not real tokens."""
  return jnp.sum(plan_.prompt_len[::group]) + jnp.sum(plan_.length)
