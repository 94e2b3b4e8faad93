"""Packing rows of a batch into packed rows of a fixed token capacity, in fixed shapes.

At reasoning lengths completions are heavy-tailed (most end early, a few reach T), and a
log-prob pass over [P + T] per row computes mostly padding. Packing places only the real
tokens, back to back, in K packed rows of C slots each (the layout of verl's
``use_remove_padding`` and MaxText's packed segments), and a pass over the packed rows costs
what the rows hold (``models.packed_attention`` keeps each sequence to its own keys).

Units: with ``group`` G > 1 (group-major rows repeating one prompt, ``prompt_group``) a unit is
a group: its prompt's real tokens once, then its G completions' real tokens, each completion
seeing the prompt and itself: the shared-prompt saving of ``CausalLM.grouped_hidden_states``
kept. With G = 1 a unit is one row, [prompt; completion]. Units are placed first-fit
decreasing (the largest first, each into the first packed row with room): one ``lax.scan``
over the units on the device, no host round trip. The capacity is chosen so that any unit
fits alone (C >= G (P + T)); then K = N / G packed rows always hold every unit (each at worst
in its own), so no row is ever dropped, and K x C = N (P + T): the packed buffers are the
padded layout's size, whatever the lengths.

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
  """Where each row went (int32 [N] each, but ``used``).

  Attributes:
    bin: the packed row holding it.
    prompt_at: slot of its prompt's first real token (a group's rows share it).
    completion_at: slot of its completion's first token.
    prompt_len: its prompt's real tokens P_i.
    length: its completion's tokens L_i.
    used: int32 scalar, packed rows holding any unit (they are rows 0 .. used - 1).
  """

  bin: jax.Array
  prompt_at: jax.Array
  completion_at: jax.Array
  prompt_len: jax.Array
  length: jax.Array
  used: jax.Array


def capacity(prompt_len: int, completion_len: int, group: int) -> int:
  """C: the slots of a packed row, one unit's most tokens, G (P + T)."""
  return group * (prompt_len + completion_len)


def plan(prompt_mask_NxP: jax.Array, completion_mask_NxT: jax.Array, group: int) -> Plan:
  """First-fit decreasing of the units into N / G packed rows of ``capacity`` slots.

  Args:
    prompt_mask_NxP: bool, the real (left-padded) prompt tokens.
    completion_mask_NxT: bool, the completion tokens to place (a prefix of each row: a
      completion's tokens up to its end).
    group: G (N a multiple of it; rows i // G share a prompt when G > 1).

  Returns:
    The Plan.
  """
  n, p = prompt_mask_NxP.shape
  t = completion_mask_NxT.shape[1]
  g = group
  c = capacity(p, t, g)
  prompt_len = jnp.sum(prompt_mask_NxP, axis=1, dtype=jnp.int32)
  length = jnp.sum(completion_mask_NxT, axis=1, dtype=jnp.int32)
  length_UxG = length.reshape(n // g, g)
  size_U = prompt_len[::g] + jnp.sum(length_UxG, axis=1)
  order = jnp.argsort(-size_U, stable=True)
  k = n // g

  def place(fill_K, u):
    size = size_U[u]
    b = jnp.argmax(fill_K + size <= c).astype(jnp.int32)  # the first with room
    return fill_K.at[b].add(size), (b, fill_K[b])

  fill, (bins, offsets) = jax.lax.scan(place, jnp.zeros((k,), jnp.int32), order)
  unit_bin = jnp.zeros((k,), jnp.int32).at[order].set(bins)
  unit_at = jnp.zeros((k,), jnp.int32).at[order].set(offsets)
  before_UxG = jnp.cumsum(length_UxG, axis=1) - length_UxG  # completions before, in the unit
  prompt_at = jnp.repeat(unit_at, g)
  return Plan(bin=jnp.repeat(unit_bin, g), prompt_at=prompt_at,
              completion_at=prompt_at + jnp.repeat(prompt_len[::g], g) + before_UxG.reshape(n),
              prompt_len=prompt_len, length=length,
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
    The Layout, [N / G, C] each.
  """
  n, p = prompt_ids_NxP.shape
  t = completion_ids_NxT.shape[1]
  k, c = n // group, capacity(p, t, group)
  slots = jnp.arange(c, dtype=jnp.int32)
  pl = plan_
  # Prompt tokens: a group's first row writes its prompt; a real token at padded position j
  # sits at prompt_at + j - (P - P_i) with position j - (P - P_i).
  pad_N = p - pl.prompt_len
  prompt_pos_NxP = jnp.arange(p, dtype=jnp.int32)[None] - pad_N[:, None]
  writes_N = (jnp.arange(n) % group) == 0
  prompt_ok = prompt_mask_NxP.astype(bool) & writes_N[:, None]
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
  """int32 scalar: the tokens placed (each group's prompt once, every completion's tokens)."""
  return jnp.sum(plan_.prompt_len[::group]) + jnp.sum(plan_.length)
