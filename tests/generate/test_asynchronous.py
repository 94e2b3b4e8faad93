"""Generation on its own devices (``generate.asynchronous.Generator``), its schedule on one
device: the staleness bound, each token's version, the lead on admission, and the lockstep
schedule's relation to the colocated one. The disjoint meshes, the device-to-device transfer
and whole runs are checked on 8 fake devices (``tests/test_async_devices.py``)."""

import hypothesis
import jax
import numpy as np
import pytest
from hypothesis import strategies as st

from grpo_jax.generate import asynchronous
from tests.generate.test_producer import T, _producer, _Scripted


def _generator(split, *, b=1, schedule="lockstep", chunks=0, ahead=1, **kw):
  producer = _producer(split, **kw)
  gen = asynchronous.Generator(producer, lambda params: params, num_groups=b,
                               schedule=schedule, lockstep_chunks=chunks, ahead=ahead)
  gen.start(split[1])
  return gen


def _run(gen, params, steps):
  """``steps`` steps of take then overlap (the update itself is not run: the version
  stamps and the bound do not depend on the parameters' values)."""
  taken = []
  for step in range(steps):
    taken.append(gen.take(step))
    gen.overlap(params, step)
  return taken


def _same(a, b):
  assert [g.tag for g in a] == [g.tag for g in b]
  for x, y in zip(a, b):
    for f in ("tokens", "logp", "versions", "lengths"):
      np.testing.assert_array_equal(getattr(x, f), getattr(y, f))


def test_lockstep_without_chunks_is_the_colocated_partial_schedule(split):
  # No chunk while the update runs: the generator swaps to version s + 1 before step s + 1
  # takes its groups, exactly as the colocated producer advances before it takes them.
  kw = dict(slots=2, chunk=1, staleness=4, stops=(2, 8, 3, 2, 5))
  colocated = _producer(split, **kw)
  expected = []
  for _ in range(6):
    expected.append(colocated.take(split[1], 1))
    colocated.advance(split[1])
  taken = _run(_generator(split, **kw), split[1], 6)
  for a, b in zip(expected, taken):
    _same(a, b)
  # A row spanned versions (group 1's 8 tokens, decoded beside shorter groups' steps).
  assert any(g.versions[0, g.lengths[0] - 1] > g.versions[0, 0] for s in taken for g in s)


def test_at_staleness_zero_nothing_is_decoded_while_the_update_runs(split):
  # Every token drawn under version s would be trained at step s + 1 or later (staleness >= 1):
  # the groups in flight expire when the update is dispatched and the lead is 0, so nothing is
  # decoded and the generator waits; three lockstep chunks then change nothing against none.
  kw = dict(slots=2, chunk=1, staleness=0, stops=(2, 8, 3, 2, 5))
  gens = [_generator(split, chunks=c, **kw) for c in (0, 3)]
  none, three = (_run(gen, split[1], 5) for gen in gens)
  counts = [gen.producer.counts for gen in gens]
  assert counts[0].decode_steps == counts[1].decode_steps  # none decoded while updating
  assert counts[1].rows_discarded == 0
  for step, (a, b) in enumerate(zip(none, three)):
    _same(a, b)
    for g in b:
      assert np.all(g.versions[g.tokens_mask()] == step)


def test_the_lead_stops_admission_the_bound_cannot_use(split):
  # B = 1, S = 1, four slots, rows of 8 tokens. take(0) may fill B x (S + 1) = 2 groups (not
  # the 4 the free slots hold); the 7 decode steps that end them end both: one is taken, one
  # waits. While update 0 runs the lead is B x (0 + 1 - 1 + 1) = 1 group: the waiting one
  # fills it, nothing is admitted or decoded (the pool is empty), and step 1 takes it at
  # staleness 1.
  gen = _generator(split, chunks=4, slots=4, chunk=1, staleness=1, stops=(8,))
  p = gen.producer
  (first,) = gen.take(0)
  assert p.counts.rows_admitted == 2 and p.counts.decode_steps == 7 and len(p.ready) == 1
  gen.overlap(split[1], 0)
  assert p._admitted == 0 and p.counts.decode_steps == 7  # pylint: disable=protected-access
  (second,) = gen.take(1)
  assert (first.tag, second.tag) == (0, 1) and second.oldest == 0


def test_ahead_sets_how_stale_the_trained_tokens_are(split):
  # B = 1, S = 3, rows of 2 tokens (the prefill's and one decode step), 8 slots, 2 lockstep
  # chunks an update. ahead = 0: while update s runs the lead is 1 x (min(0, s + 3 - (s + 1))
  # + 1) = 1 group, drawn at version s and taken by step s + 1: staleness 1 from step 1 on.
  # ahead = 3: the lead is min(3, 2) + 1 = 3 groups while updating, min(3, 3) + 1 = 4 at a
  # take; the oldest ready group is taken first, so the queue ages to the bound: staleness 3
  # from step 3 on (step 1 takes a group of version 0, step 2 one of version 0, step 3 one of
  # version 0: the three admitted in update 0's first chunk).
  staleness = {}
  for ahead in (0, 3):
    gen = _generator(split, chunks=2, slots=8, chunk=1, staleness=3, stops=(2,), ahead=ahead)
    staleness[ahead] = [step - int(g.oldest) for step, groups in enumerate(_run(gen, split[1], 6))
                        for g in groups]
  assert staleness[0] == [0, 1, 1, 1, 1, 1]
  assert staleness[3] == [0, 1, 2, 3, 3, 3]


class _CommitAll:
  """SARA's shape, every group committed: 2 probe rows, then the rest of G."""

  def __init__(self, g):
    self.g = g

  def first_rows(self):
    return 2

  def decide(self, prompt, rows):
    del prompt
    return self.g - len(rows)

  def forget(self, tag):
    del tag


def test_groups_that_ask_for_more_rows_are_taken_every_step(split):
  # B = 2, G = 4, 2 probe rows a group, S = 4, ahead = 1, 16 slots, rows of 2 tokens (one
  # decode step each), 2 lockstep chunks an update. take(0): the lead is 2 x (min(1, 4) + 1) =
  # 4 groups: 4 groups' probes (8 rows) in the first chunk, their other 8 rows in the second;
  # 4 complete, 2 taken. While update s runs the lead is 2 x (min(1, 3) + 1) = 4 again: the 2
  # waiting fill half of it, 2 new groups complete in the 2 chunks. Every step takes 2 groups,
  # as the colocated producer does. (A lead counted in rows let 16 / 2 = 8 groups' probes in,
  # then held back the rows they asked for: no group completed until they expired.)
  kw = dict(g=4, slots=16, chunk=1, staleness=4, stops=(2,))
  gen = _generator(split, b=2, chunks=2, ahead=1, rule=_CommitAll(4), **kw)
  p = gen.producer
  taken = []
  for step in range(6):
    taken.append(gen.take(step))
    gen.overlap(split[1], step)
    assert len(p.ready) + len(p._groups) <= p.lead  # pylint: disable=protected-access
  assert [len(groups) for groups in taken] == [2] * 6
  assert [g.tag for groups in taken for g in groups] == list(range(12))
  colocated = _producer(split, rule=_CommitAll(4), **kw)
  assert len(colocated.take(split[1], 2)) == 2


def test_a_step_is_taken_only_with_the_previous_update_parameters(split):
  gen = _generator(split)
  gen.take(0)
  with pytest.raises(RuntimeError, match="holds version 0, step 1"):
    gen.take(1)


def _logged(gen):
  """Records the version each token was drawn at: {(ticket, position): version}; asserts that
  no decode step runs a row that the next step can no longer train."""
  producer, log = gen.producer, {}

  def wrap_admit(fn):
    def admit(params, pool, ids, mask, slots, keys, tickets, stop, version):
      for ticket in np.asarray(tickets):
        if ticket >= 0:
          log[(int(ticket), 0)] = int(version)
      return fn(params, pool, ids, mask, slots, keys, tickets, stop, version)
    return admit

  def wrap_decode(fn):
    def decode(params, pool, version):
      before = np.asarray(pool.length)
      tickets, live = np.asarray(pool.ticket), np.asarray(pool.live)
      oldest = np.asarray(pool.versions)[live, 0]
      assert np.all(oldest >= gen.next_step - producer.max_staleness), (oldest, gen.next_step)
      pool, steps = fn(params, pool, version)
      for slot in np.flatnonzero(live):
        for pos in range(before[slot], int(pool.length[slot])):
          log[(int(tickets[slot]), pos)] = int(version)
      return pool, steps
    return decode

  producer._admit = wrap_admit(producer._admit)  # pylint: disable=protected-access
  producer._admit_rows = wrap_admit(producer._admit_rows)  # pylint: disable=protected-access
  producer._decode = wrap_decode(producer._decode)  # pylint: disable=protected-access
  return log


@hypothesis.settings(max_examples=12, deadline=None, derandomize=True)
@hypothesis.given(staleness=st.integers(0, 3), schedule=st.sampled_from(["lockstep", "free"]),
                  chunks=st.integers(0, 3), b=st.integers(1, 2), slots=st.sampled_from([2, 4]),
                  chunk=st.sampled_from([1, 3]), stops=st.lists(st.integers(1, T), min_size=1,
                                                                 max_size=6),
                  arrivals=st.lists(st.booleans(), max_size=12), ahead=st.integers(0, 3),
                  g=st.sampled_from([1, 2, 4]), rule=st.sampled_from([None, "sara", "dapo"]))
def test_any_schedule_holds_the_bound_and_stamps_each_token_with_its_version(
    split, staleness, schedule, chunks, b, slots, chunk, stops, arrivals, ahead, g, rule):
  # The free schedule's "have the parameters arrived?" answers follow ``arrivals`` (then yes):
  # any interleaving of chunks and updates, with or without a rule that asks for more rows or
  # drops groups. Every step takes B groups, every trained token is within the bound, carries
  # the version its chunk (or prefill) was drawn at, and every admitted row is accounted for.
  rules = None if rule is None else _Scripted(rule, g, max(1, g // 2))
  gen = _generator(split, b=b, schedule=schedule, chunks=chunks, slots=slots * g, chunk=chunk,
                   staleness=staleness, stops=tuple(stops), ahead=ahead, g=g, rule=rules)
  p = gen.producer
  log = _logged(gen)
  answers = iter(arrivals)
  ready = asynchronous._InTransit.ready  # pylint: disable=protected-access
  asynchronous._InTransit.ready = lambda self: next(answers, True)  # pylint: disable=W0212
  try:
    taken = _run(gen, split[1], 6)
  finally:
    asynchronous._InTransit.ready = ready  # pylint: disable=protected-access
  for step, groups in enumerate(taken):
    assert len(groups) == b
    for g in groups:
      mask = g.tokens_mask()
      assert 0 <= (step - g.versions[mask]).min() and (step - g.versions[mask]).max() <= staleness
      for row in range(g.tokens.shape[0]):
        ticket = g.tag * g.tokens.shape[0] + row
        want = [log[(ticket, pos)] for pos in range(int(g.lengths[row]))]
        np.testing.assert_array_equal(g.versions[row, :g.lengths[row]], want)
  c = p.counts
  admitted = c.rows_admitted + p._admitted  # pylint: disable=protected-access
  assert admitted == c.rows_trained + c.rows_discarded + c.rows_dropped + p.in_flight()
  assert gen.version == 6 and gen.transfers == 6


def test_staleness_stats_by_hand():
  # Tokens of versions [3, 3, 2, 0] trained at step 3: staleness [0, 0, 1, 3]: max 3, mean 1,
  # fractions 2/4, 1/4, 0, 1/4 at bound 3.
  stats = asynchronous.staleness_stats(3, np.array([3, 3, 2, 0]), 3)
  assert stats["rollout/staleness_max"] == 3.0 and stats["rollout/staleness_mean"] == 1.0
  assert [stats[f"rollout/staleness_{k}"] for k in range(4)] == [0.5, 0.25, 0.0, 0.25]
  empty = asynchronous.staleness_stats(3, np.zeros(0, np.int32), 1)
  assert empty["rollout/staleness_max"] == 0.0 and empty["rollout/staleness_0"] == 0.0
