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
  # Units: 3 + 2 + 5 = 10 and 2 + 1 + 0 = 3 tokens; C = 2 (4 + 5) = 18. First-fit decreasing:
  # the 10 at slot 0 of row 0, the 3 at slot 10 of row 0 (13 <= 18): one packed row used.
  # Row 0's completion after its prompt (slot 3), row 1's after row 0's (3 + 2 = 5); row 2's
  # after the second prompt (10 + 2 = 12), row 3's (empty) at 13.
  prompt_mask, completion_mask = _masks([3, 3, 2, 2], [2, 5, 1, 0])
  plan = packing.plan(prompt_mask, completion_mask, 2)
  np.testing.assert_array_equal(plan.bin, [0, 0, 0, 0])
  np.testing.assert_array_equal(plan.prompt_at, [0, 0, 10, 10])
  np.testing.assert_array_equal(plan.completion_at, [3, 5, 12, 13])
  assert int(plan.used) == 1 and int(packing.real_tokens(plan, 2)) == 13
  np.testing.assert_array_equal(packing.first_slot(plan), [2, 2, 11, 11])
  # Prompt ids 1.. (padded left), completion ids 20 + 5 * row + j.
  prompt_ids = jnp.asarray(np.arange(1, 5)[None].repeat(4, 0), jnp.int32)
  completion_ids = jnp.asarray(20 + 5 * np.arange(4)[:, None] + np.arange(5)[None], jnp.int32)
  lay = packing.layout(plan, prompt_ids, prompt_mask, completion_ids, 2)
  assert lay.ids.shape == (2, 18)
  # Slots 0-2 prompt 0 (ids 2, 3, 4; positions 0-2), 3-4 row 0 (20, 21; positions 3, 4), 5-9
  # row 1 (25..29; 3..7), 10-11 prompt 1 (ids 3, 4; 0, 1), 12 row 2 (30; position 2), the rest
  # empty.
  np.testing.assert_array_equal(lay.ids[0], [2, 3, 4, 20, 21, 25, 26, 27, 28, 29, 3, 4, 30,
                                             0, 0, 0, 0, 0])
  np.testing.assert_array_equal(lay.positions[0, :13], [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 0, 1, 2])
  s = lay.segments
  np.testing.assert_array_equal(s.prompt_start[0, :13], [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 10, 10,
                                                         10])
  np.testing.assert_array_equal(s.prompt_end[0, :13], [0, 0, 0, 3, 3, 3, 3, 3, 3, 3, 10, 10, 12])
  np.testing.assert_array_equal(s.seg_start[0, :13], [0, 0, 0, 3, 3, 5, 5, 5, 5, 5, 10, 10, 12])
  np.testing.assert_array_equal(s.seg_start[0, 13:], np.arange(13, 18))  # each its own
  # Slot 3 (row 0's token 0) predicts its token 1 (21); slot 4, its last, predicts nothing;
  # slots 5-8 predict 26-29; row 2's single token predicts nothing.
  np.testing.assert_array_equal(lay.target[0, :13], [-1, -1, -1, 21, -1, 26, 27, 28, 29, -1,
                                                     -1, -1, -1])
  assert np.all(np.asarray(lay.target[1]) == -1)


def test_the_packed_mask_is_each_sequences_own():
  # The layout above: row 1's token 2 (slot 7) sees prompt 0 (slots 0-2) and row 1's slots
  # 5-7, not row 0's (3, 4); prompt 1's slot 11 sees slots 10-11 only; row 2's slot 12 sees
  # prompt 1 and itself; an empty slot sees itself.
  prompt_mask, completion_mask = _masks([3, 3, 2, 2], [2, 5, 1, 0])
  plan = packing.plan(prompt_mask, completion_mask, 2)
  ids = jnp.zeros((4, P), jnp.int32)
  lay = packing.layout(plan, ids, prompt_mask, jnp.zeros((4, T), jnp.int32), 2)
  dense = np.asarray(lay.segments.dense()[0])
  assert np.flatnonzero(dense[7]).tolist() == [0, 1, 2, 5, 6, 7]
  assert np.flatnonzero(dense[11]).tolist() == [10, 11]
  assert np.flatnonzero(dense[12]).tolist() == [10, 11, 12]
  assert np.flatnonzero(dense[15]).tolist() == [15]


def test_a_unit_never_fits_beside_a_full_one_and_no_row_is_dropped():
  # G = 1: rows of P + T = 9 slots at most, C = 9: a full row fills its packed row; the 4- and
  # 5-token rows share one; the 9-token row goes alone. Three rows used of four.
  prompt_mask, completion_mask = _masks([4, 2, 2, 4], [5, 2, 3, 1])
  plan = packing.plan(prompt_mask, completion_mask, 1)
  # Sizes 9, 4, 5, 5; decreasing: row 0 (9) -> row 0; row 2 (5) -> row 1; row 3 (5) -> row 1
  # has 4 left: row 2; row 1 (4) -> row 1 (5 + 4 = 9).
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


@pytest.mark.parametrize("group,rows_per_pass,chunk", [(4, 1, 0), (1, 3, 16), (4, 2, 0)])
def test_packed_logprobs_equal_the_padded_pass(blocked_model, group, rows_per_pass, chunk):
  n, p, t = 8, 6, 12
  prompt_ids, prompt_mask, completion_ids, completion_mask = _rows(
      1, n, p, t, group, lengths=[0, 12, 3, 1, 7, 12, 2, 5])
  want, want_ent = completion_logprobs_and_entropy(
      blocked_model, prompt_ids, prompt_mask, completion_ids, 0.7, True, prompt_group=group)
  got, got_ent = packed_logprobs_and_entropy(
      blocked_model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7, True,
      chunk_tokens=chunk, group=group, rows_per_pass=rows_per_pass)
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
