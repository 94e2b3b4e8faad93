"""Packed rows (``rl.packing=tokens``): the plan and layout by hand, the packed attention against
the dense mask, and the packed log-prob pass against the padded one (values and gradients)."""

import dataclasses

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import strategies as st

from grpo_jax.generate import packing
from grpo_jax.generate.logprobs import completion_logprobs_and_entropy
from grpo_jax.generate.packed_logprobs import packed_logprobs_and_entropy
from grpo_jax.models import attention as attention_lib
from grpo_jax.models.packed_attention import Segments, packed_attention

P, T = 4, 5


def _masks(prompt_lens, lengths, p=P, t=T):
  prompt = np.arange(p)[None] >= (p - np.asarray(prompt_lens))[:, None]
  completion = np.arange(t)[None] < np.asarray(lengths)[:, None]
  return jnp.asarray(prompt), jnp.asarray(completion)


def test_plan_and_layout_by_hand():
  # Two groups of G = 2: prompts of 3 and 2 real tokens, completions of 2, 5 and 1, 0 tokens.
  # C = P + T = 9 slots a packed row. Rows longest first (prompt + completion 8, 5, 3, 2):
  #   row 1 (group 0): packed row 0, its prompt copy at 0, completion at 3 (fill 8);
  #   row 0 (group 0): row 0 has the copy but 8 + 2 > 9; packed row 1, a copy at 0, completion
  #     at 3 (fill 5);
  #   row 2 (group 1): row 0 would need 8 + 2 + 1 > 9; row 1: a copy at 5, completion at 7
  #     (fill 8);
  #   row 3 (group 1, empty): row 1 has group 1's copy and room for 0 tokens: completion at 8.
  prompt_mask, completion_mask = _masks([3, 3, 2, 2], [2, 5, 1, 0])
  plan = packing.plan(prompt_mask, completion_mask, 2)
  np.testing.assert_array_equal(plan.bin, [1, 0, 1, 1])
  np.testing.assert_array_equal(plan.prompt_at, [0, 0, 5, 5])
  np.testing.assert_array_equal(plan.completion_at, [3, 3, 7, 8])
  np.testing.assert_array_equal(plan.writes_prompt, [True, True, True, False])
  # Real tokens count each group's prompt once: 3 + 2 + 8 = 13 (the second copy of prompt 0
  # is a position computed, not a real token).
  assert int(plan.used) == 2 and int(packing.real_tokens(plan, 2)) == 13
  np.testing.assert_array_equal(packing.first_slot(plan), [2, 2, 6, 6])
  # Prompt ids 1.. (padded left), completion ids 20 + 5 * row + j.
  prompt_ids = jnp.asarray(np.arange(1, 5)[None].repeat(4, 0), jnp.int32)
  completion_ids = jnp.asarray(20 + 5 * np.arange(4)[:, None] + np.arange(5)[None], jnp.int32)
  lay = packing.layout(plan, prompt_ids, prompt_mask, completion_ids, 2)
  assert lay.ids.shape == (4, 9)
  # Packed row 0: prompt 0 (ids 2, 3, 4; positions 0-2), row 1 (25..29; positions 3..7).
  # Packed row 1: prompt 0 again, row 0 (20, 21; 3, 4), prompt 1 (ids 3, 4; 0, 1), row 2 (30;
  # position 2); slot 8 empty.
  np.testing.assert_array_equal(lay.ids[:2], [[2, 3, 4, 25, 26, 27, 28, 29, 0],
                                              [2, 3, 4, 20, 21, 3, 4, 30, 0]])
  np.testing.assert_array_equal(lay.positions[:2, :8], [[0, 1, 2, 3, 4, 5, 6, 7],
                                                        [0, 1, 2, 3, 4, 0, 1, 2]])
  s = lay.segments
  np.testing.assert_array_equal(s.prompt_start[1], [0, 0, 0, 0, 0, 5, 5, 5, 8])
  np.testing.assert_array_equal(s.prompt_end[1], [0, 0, 0, 3, 3, 5, 5, 7, 8])
  np.testing.assert_array_equal(s.seg_start[1], [0, 0, 0, 3, 3, 5, 5, 7, 8])
  np.testing.assert_array_equal(s.seg_start[0], [0, 0, 0, 3, 3, 3, 3, 3, 8])
  np.testing.assert_array_equal(s.seg_start[2], np.arange(9))  # unused: each slot its own
  # Slot j of a completion predicts its token j + 1; a completion's last slot, prompts and
  # empty slots predict nothing.
  np.testing.assert_array_equal(lay.target[:2], [[-1, -1, -1, 26, 27, 28, 29, -1, -1],
                                                 [-1, -1, -1, 21, -1, -1, -1, -1, -1]])
  assert np.all(np.asarray(lay.target[2:]) == -1)


def test_blocks_are_packed_apart():
  # Two blocks of 4 rows (a mesh's two batch shards). Block 0 is the rows of
  # test_plan_and_layout_by_hand: packed rows 1, 0, 1, 1 as there. Block 1 (prompts of 1
  # token, completions 3, 0, 2, 1; C = 9), longest first, all in packed row 4, the block's
  # first: row 4 (a copy of its prompt at 0, completion at 1, fill 4), row 6 (a copy at 4,
  # completion at 5, fill 7), row 7 (group 1's copy there: completion at 7, fill 8), row 5
  # (empty, group 0's copy there: at 8). Packed as one block of 8 instead, row 4 (4 slots with
  # its prompt) would join packed row 1 beside row 0 (fill 5): block 0's row on another device.
  prompt_mask, completion_mask = _masks([3, 3, 2, 2, 1, 1, 1, 1], [2, 5, 1, 0, 3, 0, 2, 1])
  plan = packing.plan(prompt_mask, completion_mask, 2, shards=2)
  np.testing.assert_array_equal(plan.bin, [1, 0, 1, 1, 4, 4, 4, 4])
  np.testing.assert_array_equal(plan.prompt_at[4:], [0, 0, 4, 4])
  np.testing.assert_array_equal(plan.completion_at[4:], [1, 8, 5, 7])
  assert int(plan.used) == 2  # the most packed rows a block uses
  one = packing.plan(prompt_mask, completion_mask, 2)
  assert int(one.bin[4]) == int(one.bin[0]) == 1


def test_the_packed_mask_is_each_sequences_own():
  # The layout above, packed row 1: row 0's token 1 (slot 4) sees its prompt copy (0-2) and
  # itself (3, 4); prompt 1's token (slot 6) sees 5, 6; row 2's token (slot 7) sees prompt 1
  # and itself; the empty slot 8 sees itself.
  prompt_mask, completion_mask = _masks([3, 3, 2, 2], [2, 5, 1, 0])
  plan = packing.plan(prompt_mask, completion_mask, 2)
  lay = packing.layout(plan, jnp.zeros((4, P), jnp.int32), prompt_mask,
                       jnp.zeros((4, T), jnp.int32), 2)
  dense = np.asarray(lay.segments.dense()[1])
  assert np.flatnonzero(dense[4]).tolist() == [0, 1, 2, 3, 4]
  assert np.flatnonzero(dense[6]).tolist() == [5, 6]
  assert np.flatnonzero(dense[7]).tolist() == [5, 6, 7]
  assert np.flatnonzero(dense[8]).tolist() == [8]


def test_a_unit_never_fits_beside_a_full_one_and_no_row_is_dropped():
  # G = 1: every row its own prompt, C = P + T = 9: the full row fills its packed row; the 4-
  # and 5-token rows share one; the other 5 goes alone. Three packed rows used of four.
  prompt_mask, completion_mask = _masks([4, 2, 2, 4], [5, 2, 3, 1])
  plan = packing.plan(prompt_mask, completion_mask, 1)
  # Sizes 9, 4, 5, 5; longest first (ties in row order): row 0 (9) -> packed row 0; row 2 (5)
  # -> 1; row 3 (5) -> 1 has 4 left: 2; row 1 (4) -> 1 (5 + 4 = 9).
  np.testing.assert_array_equal(plan.bin, [0, 1, 1, 2])
  np.testing.assert_array_equal(plan.prompt_at, [0, 5, 0, 0])
  assert int(plan.used) == 3


def _segments_case():
  # Two packed rows of 24 slots: row 0 a group (prompt 0-4, completions 5-11 and 12-19) and
  # an empty tail; row 1 two single sequences (0-9 and 10-16) and an empty tail.
  c = 24
  own = np.arange(c)
  ps, pe, ss = (np.tile(own, (2, 1)) for _ in range(3))
  ps[0, :20], ss[0, :5], pe[0, :5] = 0, 0, 0
  pe[0, 5:20] = 5
  ss[0, 5:12], ss[0, 12:20] = 5, 12
  for a, b in ((0, 10), (10, 17)):
    ps[1, a:b] = pe[1, a:b] = ss[1, a:b] = a
  return Segments(*(jnp.asarray(x, jnp.int32) for x in (ps, pe, ss)))


@pytest.mark.parametrize("block", [4, 8, 24])
def test_packed_attention_equals_the_dense_mask_and_its_gradients(block):
  segments = _segments_case()
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (2, 24, 2, 2, 8))
  k = jax.random.normal(keys[1], (2, 24, 2, 8))
  v = jax.random.normal(keys[2], (2, 24, 2, 8))
  mask = segments.dense()
  dense = lambda q, k, v: attention_lib.attention(q, k, v, mask)
  packed = lambda q, k, v: packed_attention(q, k, v, segments, block=block)
  np.testing.assert_allclose(packed(q, k, v), dense(q, k, v), atol=2e-6)
  w = jax.random.normal(keys[3], q.shape)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
  for a, b in zip(jax.grad(loss(packed), (0, 1, 2))(q, k, v),
                  jax.grad(loss(dense), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(a, b, atol=2e-5)


def test_blocks_no_query_sees_are_skipped():
  # Block 4 over row 1 (sequences 0-9, 10-16): query block 3 (slots 12-15) sees key blocks 2
  # and 3 (slots 8-15 hold 10-15) but not 0-1; counted over both rows by the schedule's cond.
  segments = _segments_case()
  visited = sum(bool(jnp.any(segments.visible(i * 4, j * 4, 4, 4)[1]))
                for i in range(6) for j in range(i + 1))
  # Row 1: blocks (0,0), (1,0), (1,1), (2,0), (2,1), (2,2) for the first sequence (slots 0-9
  # span blocks 0-2); the second (10-16, blocks 2-4) adds (3,2), (3,3), (4,2), (4,3), (4,4);
  # empty slots 17-23 see themselves: (4,4) counted, (5,5). 12 of the 21 causal pairs.
  assert visited == 12


@pytest.fixture(scope="module")
def blocked_model(tiny_qwen3):
  """The tiny Qwen3 with 8-slot attention blocks, so packed rows span several blocks."""
  graphdef, params = nnx.split(tiny_qwen3)
  model = nnx.merge(graphdef, params)
  model.config = dataclasses.replace(model.config, attention_block=8)
  for layer_attn in (model.layers.self_attn,):
    layer_attn.config = model.config
  return model


def _rows(seed, n, p, t, group, lengths=None):
  rng = np.random.default_rng(seed)
  prompts = rng.integers(6, 120, (n // group, p))
  prompt_lens = rng.integers(1, p + 1, n // group)
  prompt_ids = np.repeat(prompts, group, axis=0).astype(np.int32)
  prompt_mask = np.repeat(np.arange(p)[None] >= (p - prompt_lens)[:, None], group, axis=0)
  completion_ids = rng.integers(6, 120, (n, t)).astype(np.int32)
  if lengths is None:
    lengths = rng.integers(0, t + 1, n)
  completion_mask = np.arange(t)[None] < np.asarray(lengths)[:, None]
  return tuple(map(jnp.asarray, (prompt_ids, prompt_mask, completion_ids, completion_mask)))


@pytest.mark.parametrize("group,rows_per_pass,chunk,shards",
                         [(4, 1, 0, 1), (1, 3, 16, 1), (4, 2, 0, 1), (2, 1, 0, 2)])
def test_packed_logprobs_equal_the_padded_pass(blocked_model, group, rows_per_pass, chunk,
                                               shards):
  n, p, t = 8, 6, 12
  prompt_ids, prompt_mask, completion_ids, completion_mask = _rows(
      1, n, p, t, group, lengths=[0, 12, 3, 1, 7, 12, 2, 5])
  want, want_ent = completion_logprobs_and_entropy(
      blocked_model, prompt_ids, prompt_mask, completion_ids, 0.7, True, prompt_group=group)
  got, got_ent = packed_logprobs_and_entropy(
      blocked_model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7, True,
      chunk_tokens=chunk, group=group, rows_per_pass=rows_per_pass, shards=shards)
  m = np.asarray(completion_mask)
  np.testing.assert_allclose(np.asarray(got)[m], np.asarray(want)[m], atol=2e-5)
  np.testing.assert_allclose(np.asarray(got_ent)[m], np.asarray(want_ent)[m], atol=2e-5)
  assert np.all(np.asarray(got)[~m] == 0)


def test_packed_gradients_equal_the_padded_passes(tiny_qwen3):
  graphdef, params = nnx.split(tiny_qwen3)
  prompt_ids, prompt_mask, completion_ids, completion_mask = _rows(2, 8, 6, 12, 4)
  weights = jax.random.normal(jax.random.key(3), completion_ids.shape) * completion_mask

  def loss(params, packed):
    model = nnx.merge(graphdef, params)
    if packed:
      logp, _ = packed_logprobs_and_entropy(model, prompt_ids, prompt_mask, completion_ids,
                                            completion_mask, group=4)
    else:
      logp, _ = completion_logprobs_and_entropy(model, prompt_ids, prompt_mask, completion_ids,
                                                with_entropy=False, prompt_group=4)
    return jnp.sum(logp * weights)

  a = jax.grad(loss)(params, True)
  b = jax.grad(loss)(params, False)
  scale = max(float(jnp.abs(x).max()) for x in jax.tree.leaves(b))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=1e-5 * scale)


@hypothesis.settings(max_examples=12, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(lengths=st.lists(st.integers(0, 12), min_size=8, max_size=8),
                  group=st.sampled_from([1, 2, 4]))
def test_packed_logprobs_over_any_lengths(blocked_model, lengths, group):
  """Any completion lengths (empty rows and full ones included), any group size: the packed
  pass equals the padded one on every real token."""
  prompt_ids, prompt_mask, completion_ids, completion_mask = _rows(4, 8, 6, 12, group, lengths)
  want, _ = completion_logprobs_and_entropy(blocked_model, prompt_ids, prompt_mask,
                                            completion_ids, with_entropy=False,
                                            prompt_group=group)
  got, _ = packed_logprobs_and_entropy(blocked_model, prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, group=group)
  m = np.asarray(completion_mask)
  np.testing.assert_allclose(np.asarray(got)[m], np.asarray(want)[m], atol=2e-5)


def test_packed_logprobs_under_bfloat16_track_the_padded_pass(data_dir):
  """bf16 matmuls: the packed pass (the dense kernel at C = 18 keys, as the padded pass's) and
  the padded grouped one agree to float32 rounding of bf16 values: measured mean 5.7e-8,
  largest 4.8e-7 on log-probs of O(-5), where a wiring bug gives errors of their own size."""
  import os  # pylint: disable=g-import-not-at-top
  from grpo_jax.models import from_pretrained  # pylint: disable=g-import-not-at-top
  bf16 = from_pretrained(os.fspath(data_dir / "tiny_qwen3"), dtype="bfloat16")
  prompt_ids, prompt_mask, completion_ids, completion_mask = _rows(
      5, 8, 6, 12, 4, lengths=[0, 12, 3, 1, 7, 12, 2, 5])
  want, _ = completion_logprobs_and_entropy(bf16, prompt_ids, prompt_mask, completion_ids,
                                            with_entropy=False, prompt_group=4)
  got, _ = packed_logprobs_and_entropy(bf16, prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, group=4)
  m = np.asarray(completion_mask)
  diff = np.abs(np.asarray(got)[m] - np.asarray(want)[m])
  assert diff.mean() < 1e-6 and diff.max() < 5e-6
