"""Partial rollouts (``generate.producer.Producer``): groups complete across steps, each token
stamped with the version that drew it, stale rows discarded with their group, every position
counted."""

import hypothesis
import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import strategies as st

from grpo_jax.generate import producer as producer_lib
from grpo_jax.generate.sampler import SamplingConfig

P, T = 6, 8
EOS = 5


def _prompts(stops, g=1, eos_free=True):
  """``prompts()`` giving group i the stop lengths ``stops[i]`` (cycled), prompt ids >= 6."""
  serial = [0]

  def prompts():
    i = serial[0]
    serial[0] += 1
    ids = np.full(P, 7 + i % 50, np.int32)
    mask = np.ones(P, bool)
    stop = np.full(g, stops[i % len(stops)], np.int32)
    return (i, ids, mask, stop, producer_lib.key_data(jax.random.key(i), g))
  return prompts


def _producer(split, *, g=1, slots=2, chunk=1, staleness=8, stops=(2, 8, 2), **kw):
  # EOS is an id the tiny model never reaches with ids < 128 (vocab 128): the stop rule decides.
  config = SamplingConfig(max_new_tokens=T, eos_ids=(10_000,), pad_id=0, prompt_group=g)
  return producer_lib.Producer(split[0], config, nnx.merge(*split).config, slots=slots,
                          prompt_len=P, chunk=chunk, max_staleness=staleness,
                          prompts=_prompts(stops, g), **kw)


def test_a_long_row_spans_versions_and_keeps_each_tokens_version(split):
  # Two slots, one group of one row per step, chunks of one decode step. Group 0 (2 tokens)
  # and group 1 (8 tokens) start at version 0; each step one short group (2 tokens: the
  # prefill's token and one decode step) completes while group 1 gains one token. Group 1's
  # token 0 comes from the prefill at version 0 and token j >= 1 from the decode step of step
  # j - 1, at version j - 1: versions [0, 0, 1, 2, 3, 4, 5, 6]. It completes in step 6 beside
  # that step's short group, which was harvested first (slot 0), and is handed out at step 7,
  # staleness 7 - 0 = 7.
  producer = _producer(split, stops=(2, 8, 2, 2, 2, 2, 2, 2))
  taken = []
  for _ in range(8):
    taken += producer.take(split[1], 1)
    producer.advance(split[1])
  tags = [g.tag for g in taken]
  assert tags == [0, 2, 3, 4, 5, 6, 7, 1]
  long = taken[-1]
  np.testing.assert_array_equal(long.versions[0], [0, 0, 1, 2, 3, 4, 5, 6])
  np.testing.assert_array_equal(taken[1].versions[0, :2], [1, 1])
  assert long.lengths[0] == T and [int(g.lengths[0]) for g in taken[:-1]] == [2] * 7
  c = producer.counts
  assert c.groups_discarded == 0 and c.tokens_trained == 7 * 2 + T
  # One decode step in each of steps 0..6, over both slots; step 7 hands out the ready group
  # 1 without decoding or admitting. One prefill of P per group admitted: groups 0..7.
  assert c.decode_steps == 7 and c.decode_positions == 14
  assert c.prefill_positions == 8 * P


def test_a_row_past_the_staleness_bound_is_discarded_with_its_group(split):
  # As above with max_staleness 6: after the update to version 7 group 1 (oldest token at
  # version 0) is 7 > 6 stale and is dropped from the ready queue, counted as generated.
  producer = _producer(split, staleness=6, stops=(2, 8, 2, 2, 2, 2, 2, 2))
  taken = []
  for _ in range(8):
    taken += producer.take(split[1], 1)
    producer.advance(split[1])
  assert 1 not in [g.tag for g in taken]
  c = producer.counts
  assert c.groups_discarded == 1 and c.rows_discarded == 1
  assert c.tokens_generated >= c.tokens_trained + T


def test_rows_in_flight_are_dropped_when_they_can_no_longer_be_trained(split):
  # max_staleness 1: group 1 (8 tokens) is still decoding at the update to version 2 with its
  # oldest token at version 0: dropped from the pool then, its slot free for new prompts.
  producer = _producer(split, staleness=1, stops=(2, 8, 2, 2))
  for _ in range(2):
    producer.take(split[1], 1)
    producer.advance(split[1])
  assert producer.counts.groups_discarded == 1
  assert producer.in_flight() == 0  # slot 1 released (no group waits in slot 0 either)


def test_groups_complete_from_rows_in_any_slots_and_static_runs_to_the_longest(split):
  # G = 2, four slots: a group completes when both its rows have ended, wherever they sit.
  pipe = _producer(split, g=2, slots=4, chunk=2, stops=(3, 8, 5))
  static = _producer(split, g=2, slots=4, stops=(3, 8, 5), static=True)
  taken = {}
  for producer in (pipe, static):
    groups = taken[producer] = producer.take(split[1], 2)
    assert len(groups) == 2
    for group in groups:
      assert group.tokens.shape == (2, T) and np.all(group.lengths == group.lengths[0])
    assert producer.counts.decode_positions == producer.counts.decode_steps * 4
  # The static batch (groups of 3 and 8 tokens) decodes until its longest row ends: 7 steps.
  assert static.counts.decode_steps == 7 and not static.pool_live()
  # The pipeline (two groups in flight, chunks of 2): group 0 (3 tokens) ends in chunk 1
  # (steps 1-2) and group 2 (5 tokens) takes its slots, ending in chunk 3 (steps 5-6) while
  # group 1 (8 tokens) is at 7 tokens: groups 0 and 2 after 6 decode steps, group 1 in flight.
  assert pipe.counts.decode_steps == 6 and pipe.in_flight() == 2
  assert [(g.tag, int(g.lengths[0])) for g in taken[pipe]] == [(0, 3), (2, 5)]


@pytest.mark.parametrize("budget,staleness", [(3, 1), (1, 5)])
def test_a_budget_that_can_never_finish_a_row_is_refused_in_one_line(split, budget, staleness):
  # T = 8 needs 7 decode steps: 3 x (1 + 1) = 6 and 1 x (5 + 1) = 6 are short of it.
  with pytest.raises(ValueError, match="can never finish a row of 8 tokens") as e:
    _producer(split, budget=budget, staleness=staleness)
  assert "\n" not in str(e.value)
  _producer(split, budget=budget, staleness=staleness + 1)  # 7 or more: accepted


def test_a_budget_ends_the_step_with_the_groups_complete_by_then(split):
  producer = _producer(split, slots=2, budget=1, stops=(8, 8), staleness=7)
  assert producer.take(split[1], 1) == []  # one decode step: no 8-token row has ended
  assert producer.counts.decode_steps == 1


class _Rule:
  """A rule by hand: ``first`` rows a group, then ``more[tag]`` (a list of verdicts, one per
  decision) -- rows to add, 0 (complete) or DROP; records each decision's row count."""

  def __init__(self, first, more):
    self.first, self.more, self.seen, self.forgotten = first, more, [], []

  def first_rows(self):
    return self.first

  def decide(self, prompt, rows):
    tag = prompt[0]
    self.seen.append((tag, len(rows)))
    return self.more[tag].pop(0)

  def forget(self, tag):
    self.forgotten.append(tag)


def test_a_rule_adds_rows_to_a_group_and_drops_another(split):
  # G = 4 in 4 slots, 2 probe rows a group, 3-token rows (2 decode steps after the prefill's).
  # Group 0: 2 rows, then one more, then the last one (complete). Group 1: its 2 probes are
  # dropped. Group 2: 2 probes, then the other 2 at once. By hand, slots in order:
  #   admit g0 (slots 0, 1), g1 (2, 3); 2 steps; all end: decide (0, 2) -> +1, (1, 2) -> DROP;
  #   admit g0's row 2 (slot 0) before the new g2 (slots 1, 2); slot 3 stays free (g3 needs 2);
  #   2 steps: decide (0, 3) -> +1, (2, 2) -> +2;
  #   admit g0's row 3, then g2's rows 2, 3 (requests first, in order); 2 steps: (0, 4) and
  #   (2, 4) complete, ready in that order; the step takes g0.
  rule = _Rule(2, {0: [1, 1, 0], 1: [producer_lib.DROP], 2: [2, 0], 3: [2, 0], 4: [2, 0]})
  producer = _producer(split, g=4, slots=4, chunk=1, stops=(3,), rule=rule)
  groups = producer.take(split[1], 1)
  assert [g.tag for g in groups] == [0] and [g.tag for g in producer.ready] == [2]
  assert rule.seen == [(0, 2), (1, 2), (0, 3), (2, 2), (0, 4), (2, 4)]
  c = producer.counts
  assert c.groups_dropped == 1 and c.rows_dropped == 2
  uniform = _producer(split, g=4, slots=4, chunk=1, stops=(3,)).take(split[1], 1)[0]
  np.testing.assert_array_equal(groups[0].tokens, uniform.tokens)
  np.testing.assert_allclose(groups[0].logp, uniform.logp, atol=1e-5)
  assert np.all(groups[0].lengths == 3)


def test_a_group_waiting_for_rows_ages_from_its_first_rows(split):
  # Two slots, G = 2, one probe row a group, 8-token rows: in the step's 7 decode steps the
  # probes of groups 0 and 1 (version 0) end and each asks for one more row, which waits for
  # the next step. With max_staleness 0 the update to version 1 discards both groups (their
  # oldest token is of version 0, whatever version their next row would have), their requests
  # with them, and tells the rule; each had 1 row admitted.
  rule = _Rule(1, {0: [1, 0], 1: [1, 0], 2: [1, 0]})
  producer = _producer(split, g=2, slots=2, chunk=1, staleness=0, stops=(8,), rule=rule,
                       budget=7)
  assert producer.take(split[1], 1) == []
  assert rule.seen == [(0, 1), (1, 1)]
  producer.advance(split[1])
  assert sorted(rule.forgotten) == [0, 1]
  c = producer.counts
  assert c.groups_discarded == 2 and c.rows_discarded == 2
  assert not producer._pending and not producer._groups  # pylint: disable=protected-access


def test_the_admission_cap_ends_a_step_with_what_completed(split):
  # A rule that drops every group, a cap of 4 rows: 2 groups of 2 admitted and dropped, then
  # nothing in flight and nothing admitted: the step ends with no group instead of looping.
  rule = _Rule(2, {i: [producer_lib.DROP] for i in range(10)})
  producer = _producer(split, g=2, slots=2, chunk=1, stops=(2,), rule=rule, admit_cap=4)
  assert producer.take(split[1], 1) == []
  assert producer.counts.rows_admitted == 4 and producer.counts.groups_dropped == 2


class _Scripted:
  """A rule of fixed shape decided by the tag: "sara" (``first`` probe rows; tag % 3 == 0
  commits the rest, 1 asks one row at a time, 2 drops once it has 2 rows or more) or "dapo"
  (whole groups, odd tags dropped)."""

  def __init__(self, kind, g, first):
    self.kind, self.g, self.first = kind, g, first

  def first_rows(self):
    return self.g if self.kind == "dapo" else self.first

  def decide(self, prompt, rows):
    tag, n = prompt[0], len(rows)
    if self.kind == "dapo":
      return producer_lib.DROP if tag % 2 else 0
    if n == self.g:
      return 0
    return {0: self.g - n, 1: 1}.get(tag % 3, producer_lib.DROP if n >= 2 else 1)

  def forget(self, tag):
    del tag


@hypothesis.settings(max_examples=25, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture])
@hypothesis.given(g=st.sampled_from([1, 2, 4]), groups=st.sampled_from([1, 2]),
                  chunk=st.sampled_from([1, 3, 8]), staleness=st.integers(0, 3),
                  budget=st.sampled_from([0, 2, 4, 7]), reprefill=st.booleans(),
                  rule=st.sampled_from([None, "sara", "dapo"]), cap=st.sampled_from([0, 6]),
                  b=st.integers(1, 2), stops=st.lists(st.integers(1, T), min_size=1, max_size=5))
def test_any_accepted_pool_settings_run_and_account_for_every_row(
    split, g, groups, chunk, staleness, budget, reprefill, rule, cap, b, stops):
  """Settings the producer accepts run for 4 steps: every handed-out token is within the
  staleness bound, and every admitted row is trained, discarded, dropped or still held."""
  slots = groups * g
  rules = None if rule is None else _Scripted(rule, g, max(1, g // 2))
  try:
    producer = _producer(split, g=g, slots=slots, chunk=chunk, staleness=staleness,
                         stops=tuple(stops), budget=budget, reprefill=reprefill, rule=rules,
                         admit_cap=cap if rule else 0)
  except ValueError as e:  # the one refusal: a budget that can never finish a row of T
    assert "can never finish a row" in str(e) and budget * (staleness + 1) < T - 1
    return
  trained = 0
  for _ in range(4):
    version = producer.version
    out = producer.take(split[1], b)
    assert len(out) <= b
    for group in out:
      assert version - group.oldest <= staleness and group.tokens.shape == (g, T)
      trained += int(group.lengths.sum())
    producer.advance(split[1])
  c = producer.counts
  assert c.tokens_trained == trained
  held = (int(np.asarray(producer.pool.live).sum())
          + sum(len(v.rows) for v in producer._groups.values())  # pylint: disable=protected-access
          + g * len(producer.ready))
  assert producer.in_flight() == held
  assert c.rows_admitted == c.rows_trained + c.rows_discarded + c.rows_dropped + held


def test_rows_in_flight_include_complete_groups_waiting_to_be_taken(split):
  # 4 slots, G = 1, B = 1, rows of 2 tokens: the step admits 4 groups, one decode step ends
  # them all; it takes one and 3 wait, complete: 3 rows in flight, none of them live.
  producer = _producer(split, slots=4, stops=(2,))
  assert len(producer.take(split[1], 1)) == 1
  assert len(producer.ready) == 3 and not producer.pool_live()
  assert producer.in_flight() == 3


def test_a_restored_pool_rebuilds_its_cache_once_and_counts_it_once(split):
  # Under reprefill each update recomputes the live rows' cache: slots x (P + T) positions. A
  # run saves its producer after a step's take, before the update (version 1 here, group 1's
  # 8-token row live); restored, its next call is the update's ``advance``, whose reprefill is
  # the restored cache's rebuild: the same counts and tokens as the uninterrupted producer (not
  # one more rebuild of slots x (P + T) = 28 positions under the same parameters).
  kw = dict(slots=2, stops=(2, 8, 3), reprefill=True)
  straight, first = _producer(split, **kw), _producer(split, **kw)
  for producer in (straight, first):
    producer.take(split[1], 1)
    producer.advance(split[1])
    producer.take(split[1], 1)
  assert first.pool_live()
  resumed = _producer(split, **kw)
  resumed.prompts = first.prompts  # the prompt stream goes on (the run's is checkpointed)
  resumed.load_state_dict(first.state_dict())
  for producer in (straight, resumed):
    producer.advance(split[1])
    producer.take(split[1], 1)
  assert vars(resumed.counts) == vars(straight.counts)
  assert straight.counts.reprefill_positions == 2 * 2 * (P + T)  # one an update, both slots
  a, b = straight.take(split[1], 1), resumed.take(split[1], 1)
  assert [g.tag for g in a] == [g.tag for g in b]
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.tokens, y.tokens)
