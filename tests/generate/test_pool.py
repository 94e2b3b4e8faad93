"""The slot pool: rows at their own positions, decoded in chunks, refilled, resumed.

A row's tokens may depend only on its prompt, its key and the parameters: not on the chunks it
was decoded in, the slot it sits in, when it was admitted or what its neighbours are. Its
behaviour log-probs are the teacher-forced ones of the tokens it drew.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.generate import pool as pool_lib
from grpo_jax.generate.logprobs import completion_logprobs
from grpo_jax.generate.sampler import SamplingConfig

SLOTS, P, T = 6, 6, 8
EOS, PAD = 5, 0
CONFIG = SamplingConfig(max_new_tokens=T, eos_ids=(EOS,), pad_id=PAD, temperature=1.0)


@pytest.fixture(scope="module")
def fns(split):
  """{chunk: (admit, decode, release, reprefill)}, compiled once for the module."""
  return {c: pool_lib.make_pool_fns(split[0], CONFIG, c) for c in (1, 3, T)}


@pytest.fixture(scope="module")
def rows():
  """Four prompts (left padding of different lengths), keys, tickets."""
  rng = np.random.RandomState(0)
  ids = rng.randint(6, 128, (4, P)).astype(np.int32)
  mask = np.ones((4, P), bool)
  mask[0, :3] = False
  mask[2, :5] = False
  ids[~mask] = PAD
  keys = jax.random.key_data(jax.random.split(jax.random.key(7), 4))
  return jnp.asarray(ids), jnp.asarray(mask), keys


def _run(split, fns, rows, chunk, slots_of, admit_at, stop_at=T, version_of=lambda c: 0):
  """Admits row i into slot ``slots_of[i]`` before chunk ``admit_at[i]``, decodes chunks of
  ``chunk`` until every row ended; returns {row: (tokens, logp, versions, length, ended)}."""
  admit, decode, release, _ = fns[chunk]
  ids, mask, keys = rows
  pool = pool_lib.init(_config(split), SLOTS, P, CONFIG)
  out, c = {}, 0
  while len(out) < len(slots_of):
    for i in [i for i, a in enumerate(admit_at) if a == c]:
      pool = admit(split[1], pool, ids[i:i + 1], mask[i:i + 1], jnp.asarray([slots_of[i]]),
                   keys[i:i + 1], jnp.asarray([i]), jnp.asarray([stop_at]), version_of(c))
    pool, _ = decode(split[1], pool, version_of(c))
    c += 1
    done = np.asarray(pool.done & pool.live)
    for s in np.flatnonzero(done):
      i = int(pool.ticket[s])
      n = int(pool.length[s])
      out[i] = (np.asarray(pool.tokens[s]), np.asarray(pool.logp[s]),
                np.asarray(pool.versions[s]), n, bool(pool.ended[s]))
    pool = release(pool, jnp.asarray(done))
    assert c < 50
  return out


def _config(split):
  from flax import nnx  # pylint: disable=g-import-not-at-top
  return nnx.merge(*split).config


def test_a_row_draws_the_same_tokens_whatever_its_chunks_slot_and_neighbours(split, fns, rows):
  # Reference: all four rows admitted at once into slots 0..3, one chunk of T.
  ref = _run(split, fns, rows, T, [0, 1, 2, 3], [0, 0, 0, 0])
  # Chunks of 1 and 3, other slots, rows admitted at different times (while others decode).
  for chunk, slots, at in ((1, [5, 2, 0, 3], [0, 2, 1, 4]), (3, [1, 4, 5, 0], [1, 0, 0, 2])):
    got = _run(split, fns, rows, chunk, slots, at)
    for i in range(4):
      np.testing.assert_array_equal(got[i][0], ref[i][0])
      np.testing.assert_allclose(got[i][1], ref[i][1], atol=1e-6)
      assert got[i][3:] == ref[i][3:]


def test_behaviour_logprobs_are_the_teacher_forced_ones(tiny_qwen3, split, fns, rows):
  got = _run(split, fns, rows, 3, [5, 2, 0, 3], [0, 2, 1, 4])
  ids, mask, _ = rows
  tokens = jnp.asarray(np.stack([got[i][0] for i in range(4)]))
  lengths = np.asarray([got[i][3] for i in range(4)])
  assert lengths.sum() > 4  # rows went past their first token
  teacher = np.asarray(completion_logprobs(tiny_qwen3, ids, mask, tokens, 1.0))
  logp = np.stack([got[i][1] for i in range(4)])
  real = np.arange(T)[None, :] < lengths[:, None]
  assert np.abs(teacher - logp)[real].max() <= 1e-5
  assert np.all(logp[~real] == 0.0) and np.all(np.asarray(tokens)[~real] == PAD)
  for i in range(4):  # ends: EOS (last token) or T tokens
    assert got[i][4] == (got[i][0][lengths[i] - 1] == EOS)
    assert got[i][4] or lengths[i] == T


def test_stop_at_ends_rows_and_versions_stamp_each_token(split, fns, rows):
  got = _run(split, fns, rows, 1, [0, 1, 2, 3], [0, 0, 0, 0], stop_at=3,
             version_of=lambda c: 10 + c)
  for i in range(4):
    tokens, _, versions, n, _ = got[i]
    assert n <= 3
    # Chunk c of one step draws token c + 1 (token 0 at admission, version 10): versions
    # 10, 10, 11 for tokens 0, 1, 2 (token 1 in chunk 0 at version 10, token 2 in chunk 1).
    np.testing.assert_array_equal(versions[:n], [10, 10, 11][:n])
    assert np.all(versions[n:] == 0)


def test_a_saved_pool_resumes_to_the_same_tokens(split, fns, rows):
  # Reference: the four rows decoded to their end in one chunk of T. Resumed: one chunk of 3,
  # then saved as a checkpoint saves it (its fields on the host, no KV cache), restored into a
  # fresh pool, the cache rebuilt (``reprefill``, as the producer does on restore) and decoded
  # on in chunks of 1: other chunk boundaries, so each token's key must come from the token's
  # position, not the chunk's loop counter, and the rebuilt cache must give the same tokens.
  from grpo_jax.generate import producer_state  # pylint: disable=g-import-not-at-top
  ids, mask, keys = rows
  fresh = lambda admit: admit(split[1], pool_lib.init(_config(split), SLOTS, P, CONFIG), ids,
                              mask, jnp.arange(4), keys, jnp.arange(4), jnp.full((4,), T), 0)
  whole, _ = fns[T][1](split[1], fresh(fns[T][0]), 0)
  part, _ = fns[3][1](split[1], fresh(fns[3][0]), 0)
  saved = producer_state.pool_arrays(part)
  assert "cache" not in saved and np.all(saved["length"] < T)  # saved mid-row
  admit, decode, _, reprefill = fns[1]
  resumed = reprefill(split[1], producer_state.restore_pool(
      pool_lib.init(_config(split), SLOTS, P, CONFIG), saved))
  for _ in range(T):
    resumed, _ = decode(split[1], resumed, 0)
  for name in ("tokens", "length", "ended", "done"):
    np.testing.assert_array_equal(np.asarray(getattr(resumed, name)),
                                  np.asarray(getattr(whole, name)), err_msg=name)
  np.testing.assert_allclose(np.asarray(resumed.logp), np.asarray(whole.logp), atol=1e-5)


def test_reprefill_under_the_same_parameters_changes_nothing(split, fns, rows):
  admit, decode, _, reprefill = fns[3]
  ids, mask, keys = rows
  start = lambda: decode(split[1], admit(split[1], pool_lib.init(_config(split), SLOTS, P,
                                                                 CONFIG), ids, mask,
                                         jnp.arange(4), keys, jnp.arange(4),
                                         jnp.full((4,), T), 0), 0)[0]
  kept, _ = decode(split[1], start(), 0)
  rebuilt, _ = decode(split[1], reprefill(split[1], start()), 0)
  np.testing.assert_array_equal(np.asarray(kept.tokens), np.asarray(rebuilt.tokens))
  np.testing.assert_allclose(np.asarray(kept.logp), np.asarray(rebuilt.logp), atol=1e-5)
