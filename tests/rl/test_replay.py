"""The on-device ring buffer against a plain-Python model of the same semantics."""

import chex
import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

from grpo_jax.rl import replay as replay_lib
from grpo_jax.types import Rollout

C, E, P, T, M = 5, 2, 3, 2, 4  # capacity, entry size, prompt/completion lengths, candidates


def _entries(ids, version=0):
  """M candidate entries whose prompt_id is ``ids[m]`` in every rollout (their identity), every
  token at ``version``."""
  ids = jnp.asarray(ids, jnp.int32)
  z = lambda *s, d=jnp.float32: jnp.zeros((M, E) + s, d)
  return Rollout(prompt_ids=jnp.broadcast_to(ids[:, None, None], (M, E, P)),
                 prompt_mask=z(P, d=bool), completion_ids=z(T, d=jnp.int32),
                 completion_mask=z(T, d=bool), behaviour_logp=z(T),
                 scores=z(), truncated=z(d=bool), success=z(d=bool),
                 prompt_id=jnp.broadcast_to(ids[:, None], (M, E)),
                 version=z(T, d=jnp.int32) + version)


@jax.jit
@chex.assert_max_traces(n=1)
def _insert(replay, ids, keep, version):
  adv = jnp.broadcast_to(ids[:, None].astype(jnp.float32), (M, E))
  return replay_lib.insert(replay, _entries(ids, version), adv, keep)


@jax.jit
@chex.assert_max_traces(n=1)
def _evict(replay, step):
  return replay_lib.evict(replay, step, max_age=3, max_uses=2)


@jax.jit
def _select_recent(replay):
  return replay_lib.select(replay, 3, "recency")


class Reference:
  """Plain-Python ring: a list of slots, written one by one."""

  def __init__(self):
    self.slots = [None] * C
    self.pos = 0
    self.count = 0

  def insert(self, ids, keep, version):
    for i, k in zip(ids, keep):
      if k:
        self.slots[self.pos] = dict(id=i, version=version, inserted=self.count, uses=0, valid=True)
        self.pos = (self.pos + 1) % C
        self.count += 1

  def evict(self, step):
    for s in self.slots:
      if s and (step - s["version"] > 3 or s["uses"] >= 2):
        s["valid"] = False

  def recent(self, k):
    live = sorted((s for s in self.slots if s and s["valid"]), key=lambda s: -s["inserted"])
    return live[:k]


op = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.booleans(), min_size=M, max_size=M)),
    st.tuples(st.just("evict"), st.integers(0, 3)),
    st.tuples(st.just("select"), st.just(None)))


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(st.lists(op, min_size=1, max_size=12))
@hypothesis.example(ops=[("insert", [False, False, False, True]), ("evict", 2),
                         ("insert", [False, False, False, False]), ("select", None)])
def test_matches_reference_model(ops):
  replay = replay_lib.init_replay(C, E, P, T)
  ref = Reference()
  step, next_id = 0, 100
  for kind, arg in ops:
    if kind == "insert":
      ids = list(range(next_id, next_id + M))
      next_id += M
      replay = _insert(replay, jnp.asarray(ids), jnp.asarray(arg), jnp.int32(step))
      ref.insert(ids, arg, step)
      step += 1
    elif kind == "evict":
      step += arg
      replay = _evict(replay, jnp.int32(step))
      ref.evict(step)
    else:
      # As in the train step: evict at the current step, then select.
      replay = _evict(replay, jnp.int32(step))
      ref.evict(step)
      idx, ok = _select_recent(replay)
      expected = ref.recent(3)
      got = [int(i) for i, v in zip(idx, ok) if v]
      # Recency order is exact and only live entries come back.
      assert [int(replay.rollouts.prompt_id[i, 0]) for i in got] == [s["id"] for s in expected]
      assert all(step - int(replay.version[i]) <= 3 for i in got)
      replay = replay_lib.mark_used(replay, idx, ok)
      for s in expected:
        s["uses"] += 1
    # Same live set, slot by slot: capacity and FIFO overwrite agree with the reference.
    for slot, s in enumerate(ref.slots):
      live = bool(replay.valid[slot])
      assert live == bool(s and s["valid"])
      if s:
        assert int(replay.rollouts.prompt_id[slot, 0]) == s["id"]
        assert int(replay.use_count[slot]) == s["uses"]
  assert int(replay.num_inserted) == ref.count
  assert int(np.sum(replay.valid)) <= C


def test_insert_more_than_capacity_keeps_the_last_ones():
  replay = replay_lib.init_replay(3, E, P, T)
  replay = replay_lib.insert(replay, _entries([1, 2, 3, 4]), jnp.zeros((M, E)),
                             jnp.ones(M, bool))
  # 4 kept into 3 slots written one by one from slot 0: 1->0, 2->1, 3->2, 4->0.
  np.testing.assert_array_equal(replay.rollouts.prompt_id[:, 0], [4, 2, 3])
  assert int(replay.write_pos) == 1 and int(replay.num_inserted) == 4


def test_staleness_and_drift_and_proportional_priorities():
  replay = replay_lib.init_replay(4, E, P, T)
  for version in range(4):  # one entry per step, versions 0..3 in slots 0..3
    keep = jnp.asarray([True, False, False, False])
    replay = replay_lib.insert(replay, _entries([10 + version, 0, 0, 0], version),
                               jnp.zeros((M, E)), keep)
  # step 4, staleness 3: version closest to 4 - 3 = 1 is slot 1, then versions 0 and 2 at
  # distance 1 with the more recent (version 2) first.
  idx, ok = replay_lib.select(replay, 3, "staleness", step=4, staleness=3)
  assert list(np.asarray(idx)) == [1, 2, 0] and bool(ok.all())
  idx, _ = replay_lib.select(replay, 2, "lowest_kl", score_C=jnp.asarray([0.3, 0.1, 0.4, 0.2]))
  assert list(np.asarray(idx)) == [1, 3]
  # Proportional with one zero score: that entry is never chosen; asking for 4 gives 3 valid.
  score = jnp.asarray([1.0, 0.0, 2.0, 3.0])
  idx, ok = replay_lib.select(replay, 4, "proportional", score_C=score, rng=jax.random.key(0))
  assert int(ok.sum()) == 3 and 1 not in set(np.asarray(idx)[np.asarray(ok)].tolist())


def test_select_pads_when_fewer_entries_exist_and_gather_layout():
  replay = replay_lib.init_replay(C, E, P, T)
  replay = _insert(replay, jnp.asarray([7, 8, 9, 10]), jnp.asarray([True, True, False, False]),
                   jnp.int32(0))
  idx, ok = replay_lib.select(replay, 4, "recency")
  np.testing.assert_array_equal(ok, [True, True, False, False])
  rows, adv, gen = replay_lib.gather(replay, idx[:2])
  assert rows.prompt_ids.shape == (2 * E, P) and adv.shape == (2 * E,)
  # No trainer log-probs given at insertion: they default to the entries' log mu.
  np.testing.assert_array_equal(gen, rows.behaviour_logp)
  np.testing.assert_array_equal(rows.prompt_id, [8, 8, 7, 7])  # most recent first
  with pytest.raises(ValueError, match="unknown replay priority"):
    replay_lib.select(replay, 1, "newest")


def test_capacity_zero_is_a_no_op_and_bytes_are_fixed():
  empty = replay_lib.init_replay(0, E, P, T)
  assert replay_lib.insert(empty, _entries([1, 2, 3, 4]), jnp.zeros((M, E)),
                           jnp.ones(M, bool)) is empty
  idx, ok = replay_lib.select(empty, 2, "recency")
  assert idx.shape == (2,) and not bool(ok.any())
  full = replay_lib.init_replay(C, E, P, T)
  # Per rollout: P ids 4*3 + P mask 1*3 + T ids 4*2 + T mask 1*2 + T logp 4*2 + truncated 1 +
  # score 4 + success 1 + prompt id 4 + T versions 4*2 = 12+3+8+2+8+1+4+1+4+8 = 51 bytes;
  # x E=2 -> 102, plus advantages 2*4 = 8 and trainer log-probs at generation E*T*4 = 16 ->
  # 126 per entry, plus version, inserted, use count, drift, headroom 4+4+4+4+4 and valid 1 =
  # 21 per entry -> 147; C=5 -> 735, plus write_pos and num_inserted 8 -> 743.
  assert full.nbytes == 743


def test_entries_keep_their_token_versions_and_age_from_the_oldest_real_row():
  # Entry 0: row 0's tokens drawn at versions 5 and 6 (a continued row), row 1 at 3 and 3 ->
  # entry version min(5, 3) = 3. Entry 1: row 0 at 1, but empty (no real token), row 1 at 4
  # -> 4. Entries 2, 3 have no real row: their first row's version, 0.
  entries = _entries([1, 2, 3, 4])
  version = jnp.zeros((M, E, T), jnp.int32)
  version = version.at[0, 0].set(jnp.array([5, 6])).at[0, 1].set(3)
  version = version.at[1, 0].set(1).at[1, 1].set(4)
  mask = jnp.zeros((M, E, T), bool).at[0].set(True).at[1, 1].set(True)
  entries = entries.replace(version=version, completion_mask=mask)
  replay = replay_lib.insert(replay_lib.init_replay(C, E, P, T), entries, jnp.zeros((M, E)),
                             jnp.ones(M, bool))
  np.testing.assert_array_equal(replay.version[:4], [3, 4, 0, 0])
  np.testing.assert_array_equal(replay.rollouts.version[0, 0], [5, 6])  # kept, per token
  # Age eviction counts from the entry's version: at step 7 with max_age 3, entry 0 (age 4)
  # goes, entry 1 (age 3) stays.
  kept = replay_lib.evict(replay, 7, max_age=3).valid
  np.testing.assert_array_equal(kept[:2], [False, True])
