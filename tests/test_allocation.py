"""Rollout allocation: SARA's predictor and rule, dynamic sampling, MoPPS and DPS by hand, budget
accounting, fixed-shape rounds (one sampler compilation), empty groups in the train step."""

import jax
import numpy as np
import optax
import pytest
import transformers
from flax import nnx

from grpo_jax import assets
from grpo_jax import rollouts as rollouts_lib
from grpo_jax import sampler as sampler_lib
from grpo_jax import step as step_lib
from grpo_jax.allocation import (DpsSelector, DynamicSampling, FullGroups, MoppsSelector, Prompt,
                                 Rows, Sara, StreamSelector, p_effective, rounds)
from grpo_jax.allocation.sara import decide
from grpo_jax.models import from_pretrained
from grpo_jax.replay import init_replay
from grpo_jax.tasks import countdown
from tests.test_step import MIXED, SHIFT_N, _copy, _rollout

P, T = 3, 2


# --- SARA's closed-form predictor ------------------------------------------------------------

@pytest.mark.parametrize("n, expected", [(2, 6 / 9), (3, 5 / 9), (4, 4 / 9)])
def test_p_effective_after_agreeing_probes_beta11_g8(n, expected):
  # Beta(1,1), G = 8, n agreeing probes: P_inef = prod_{j<m} (n+1+j)/(n+2+j) with m = 8 - n
  # telescopes to (n+1)/9, so P_eff = 1 - (n+1)/9: 0.667, 0.556, 0.444 for n = 2, 3, 4.
  assert p_effective(n, n, 8) == pytest.approx(expected, abs=1e-12)  # all successes
  assert p_effective(n, 0, 8) == pytest.approx(expected, abs=1e-12)  # all failures
  assert round(p_effective(n, n, 8), 2) == {2: 0.67, 3: 0.56, 4: 0.44}[n]


def test_p_effective_edge_cases_and_another_prior():
  assert p_effective(2, 1, 8) == 1.0 and p_effective(7, 3, 8) == 1.0  # mixed: certain
  assert p_effective(8, 8, 8) == 0.0 and p_effective(8, 0, 8) == 0.0  # complete, agreeing
  # No probe yet, Beta(1,1): E[p^8] = E[(1-p)^8] = 1/9, so P_eff = 1 - 2/9.
  assert p_effective(0, 0, 8) == pytest.approx(7 / 9, abs=1e-12)
  # Beta(2,1), one success of G = 3: a = 3, b = 1, m = 2: P_inef = 3/4 * 4/5 = 0.6.
  assert p_effective(1, 1, 3, alpha0=2.0, beta0=1.0) == pytest.approx(0.4, abs=1e-12)
  # ... and one failure: a = 2, b = 2: P_inef = 2/4 * 3/5 = 0.3.
  assert p_effective(1, 0, 3, alpha0=2.0, beta0=1.0) == pytest.approx(0.7, abs=1e-12)
  with pytest.raises(ValueError, match="successes <= probes"):
    p_effective(3, 4, 8)
  with pytest.raises(ValueError, match="probes <= group_size"):
    p_effective(9, 0, 8)


def test_commit_abandon_continue():
  lo, hi = 0.45, 0.9
  assert decide(4, 0, 8, lo, hi) == "abandon"  # 0.444 <= 0.45
  assert decide(4, 4, 8, lo, hi) == "abandon"
  assert decide(4, 1, 8, lo, hi) == "commit"  # mixed: 1.0
  assert decide(3, 3, 8, lo, hi) == "continue"  # 0.556
  assert decide(2, 0, 8, lo, hi) == "continue"  # 0.667
  assert decide(2, 0, 8, lo, 0.6) == "commit"  # 0.667 >= 0.6


# --- allocators on a scripted sampler ---------------------------------------------------------

class ScriptedRounds:
  """A RoundSampler stand-in: prompt i's k-th rollout (over the whole step, spare included)
  succeeds when ``script[i][k]``; it checks that no round exceeds its slots."""

  def __init__(self, slots, script):
    self.slots, self.script = slots, script
    self.used = {}  # prompt index -> rollouts drawn so far
    self.rounds = []  # per round: the request counts

  def _rows(self, prompt, count):
    start = self.used.get(prompt.index, 0)
    self.used[prompt.index] = start + count
    success = np.array(self.script[prompt.index][start:start + count], bool)
    return Rows(prompt_ids_RxP=np.full((count, P), 7, np.int32),
                prompt_mask_RxP=np.ones((count, P), bool),
                tokens_RxT=np.ones((count, T), np.int32), mask_RxT=np.ones((count, T), bool),
                logp_RxT=np.full((count, T), -0.5, np.float32),
                scores_R=success.astype(np.float32), success_R=success,
                lengths_R=np.full((count,), T, np.int32), truncated_R=np.zeros((count,), bool),
                errors_R=np.zeros((count,), bool), texts=["x"] * count)

  def run(self, params, requests, rng, spare=None):
    del params, rng
    used = sum(c for _, c in requests)
    assert used <= self.slots
    per_request = [self._rows(p, c) for p, c in requests]
    fitted, free = [], self.slots - used
    for i, (p, c) in enumerate(spare or ()):
      if 1 <= c <= free:
        fitted.append((i, self._rows(p, c)))
        free -= c
    self.rounds.append([c for _, c in requests])
    return per_request, fitted


class ListSelector:
  """Prompts 0, 1, 2, ... in order; records what it observes."""

  name = "list"

  def __init__(self):
    self.next, self.seen = 0, []

  def draw(self, n, exclude=()):
    out = []
    while len(out) < n:
      if self.next not in exclude:
        out.append(Prompt(self.next, self.next, f"prompt {self.next}"))
      self.next += 1
    return out

  def observe(self, results):
    self.seen.append(list(results))

  def state_dict(self):
    return {"next": self.next}

  def load_state_dict(self, state):
    self.next = state["next"]


def _ids(rollout):
  return np.asarray(rollout.prompt_id_N).tolist()


def test_uniform_is_one_round_of_full_groups():
  b, g = 2, 4
  script = {0: [1, 0, 0, 0], 1: [0, 0, 0, 0]}
  selector = ListSelector()
  alloc = FullGroups(selector, ScriptedRounds(b * g, script), num_groups=b, group_size=g)
  rollout, stats = alloc.collect(None, 3, jax.random.key(0))
  assert _ids(rollout) == [0] * 4 + [1] * 4
  np.testing.assert_array_equal(rollout.version_N, [3] * 8)
  assert stats["rollouts"] == 8 and stats["alloc/rollouts_in_update"] == 8
  assert stats["alloc/rounds"] == 1 and stats["alloc/empty_groups"] == 0
  assert stats["alloc/effective_groups"] == 1  # prompt 0 is mixed, prompt 1 is not
  assert selector.seen == [[(0, 1, 4), (1, 0, 4)]]  # (index, successes, trials)


def test_dynamic_sampling_fills_the_batch_with_effective_groups():
  b, g = 2, 4
  # Prompt i is effective (mixed) iff i % 3 == 0: round 0 draws 0, 1 (keeps 0), round 1 draws
  # 2, 3 (keeps 3): B = 2 kept after 2 rounds; every one of the 16 rollouts is counted.
  script = {i: ([1, 0, 1, 1] if i % 3 == 0 else [0, 0, 0, 0]) for i in range(12)}
  alloc = DynamicSampling(ListSelector(), ScriptedRounds(b * g, script), num_groups=b,
                          group_size=g, max_rounds=10)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  assert _ids(rollout) == [0] * 4 + [3] * 4
  assert stats["alloc/rounds"] == 2 and stats["rollouts"] == 16
  assert stats["alloc/rollouts_in_update"] == 8 and stats["alloc/effective_groups"] == 2
  assert stats["alloc/effective_per_1k_rollouts"] == pytest.approx(1000 * 2 / 16)
  assert stats["alloc/capped"] == 0 and stats["alloc/prompts_touched"] == 4
  assert alloc.selector.seen == [[(0, 3, 4), (1, 0, 4), (2, 0, 4), (3, 3, 4)]]


def test_dynamic_sampling_stops_at_its_cap_with_empty_groups():
  b, g = 2, 4
  script = {i: [1, 1, 1, 1] for i in range(20)}  # nothing is ever effective
  alloc = DynamicSampling(ListSelector(), ScriptedRounds(b * g, script), num_groups=b,
                          group_size=g, max_rounds=3)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # 3 rounds x 2 prompts x 4 rollouts = 24 generated, none usable: 2 empty groups.
  assert stats["alloc/rounds"] == 3 and stats["rollouts"] == 24
  assert stats["alloc/capped"] == 1 and stats["alloc/empty_groups"] == 2
  assert stats["alloc/rollouts_in_update"] == 0
  assert not np.asarray(rollout.completion_mask_NxT).any()
  assert not np.asarray(rollout.success_N).any() and not np.asarray(rollout.scores_N).any()


def test_sara_commits_abandons_and_counts_every_rollout():
  b, g, k = 2, 8, 4
  script = {0: [1, 0, 1, 1, 0, 0, 1, 0],  # mixed probes: commit, then complete
            1: [0, 0, 0, 0, 0, 1, 0, 0],  # agreeing probes: abandon (completing it: effective)
            2: [1, 1, 1, 1, 1, 1, 1, 1],  # abandon (completing it: still all successes)
            3: [0, 1, 0, 0, 0, 0, 0, 0]}  # commit
  rounds_ = ScriptedRounds(b * g, script)
  alloc = Sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, seed=0)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # Round 0: commit rate 0.5, 2 groups needed -> ceil(2 / 0.5) = 4 new prompts x 4 probes = the
  # 16 slots. Prompts 0 and 3 commit, 1 and 2 are abandoned (P_eff = 0.44 <= 0.45).
  # Round 1: completions 4 + 4 = 8 rows; the 8 free slots audit both abandoned prompts (4
  # each, not counted). Then both groups are complete.
  assert rounds_.rounds == [[4, 4, 4, 4], [4, 4]]
  assert _ids(rollout) == [0] * 8 + [3] * 8
  np.testing.assert_array_equal(np.asarray(rollout.success_N),
                                np.array(script[0] + script[3], bool))
  assert stats["rollouts"] == 16 + 8  # probes + completions; the 8 audit rows are not counted
  assert sum(rounds_.used.values()) == 16 + 8 + 8
  assert stats["alloc/committed"] == 2 and stats["alloc/abandoned"] == 2
  assert stats["alloc/abandon_rate"] == 0.5 and stats["alloc/surplus"] == 0
  assert stats["alloc/audited"] == 2 and stats["alloc/wrong_abandoned"] == 1  # prompt 1
  assert stats["alloc/wrong_abandon_rate"] == 0.5
  assert stats["alloc/rounds"] == 2 and stats["alloc/empty_groups"] == 0
  # The selector sees every prompt's counted rollouts only: 1 and 2 after their 4 probes.
  assert alloc.selector.seen == [[(0, 4, 8), (1, 0, 4), (2, 4, 4), (3, 1, 8)]]
  # Commit rate: 0.5 * 0.5 + 0.5 * 2/4 = 0.5.
  assert alloc.commit_rate == 0.5


def test_sara_continues_one_rollout_at_a_time_between_thresholds():
  b, g, k = 1, 8, 2
  script = {0: [0] * 8, 1: [0, 0, 1, 0, 0, 0, 0, 0]}
  rounds_ = ScriptedRounds(b * g, script)
  alloc = Sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, seed=0)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # Round 0: ceil(1 / 0.5) = 2 new prompts x 2 probes. Both agree: P_eff = 0.667 -> continue.
  # Round 1: one more each: prompt 0 (3 agreeing, 0.556) continues, prompt 1 mixes -> commit.
  # Round 2: prompt 1 completes (8 - 3 = 5 rows), prompt 0 gets a 4th: 0.444 -> abandon.
  assert rounds_.rounds == [[2, 2], [1, 1], [5, 1]]
  assert _ids(rollout) == [1] * 8
  assert stats["rollouts"] == 4 + 2 + 6 and stats["alloc/abandoned"] == 1
  assert stats["alloc/committed"] == 1


def test_sara_does_not_complete_commits_beyond_b():
  b, g, k = 1, 8, 4
  script = {0: [1, 0, 0, 0, 1, 1, 1, 1], 1: [0, 1, 0, 0, 0, 0, 0, 0]}
  rounds_ = ScriptedRounds(b * g, script)
  alloc = Sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, seed=0)
  _, stats = alloc.collect(None, 0, jax.random.key(0))
  # Two prompts probed (ceil(1 / 0.5) = 2), both mixed: the first is committed and completed,
  # the second is surplus (4 probes spent, not completed).
  assert rounds_.rounds == [[4, 4], [4]]
  assert stats["alloc/surplus"] == 1 and stats["rollouts"] == 12


def test_sara_round_cap_leaves_empty_groups():
  b, g, k = 2, 4, 2
  script = {i: [1] * 4 for i in range(40)}  # always agreeing: always abandoned
  alloc = Sara(ListSelector(), ScriptedRounds(b * g, script), num_groups=b, group_size=g,
               probes=k, max_rounds=3, seed=0)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # G = 4, K = 2: 2 agreeing -> P_eff = 1 - 3/5 = 0.4 <= 0.45: abandon at once. The last of
  # the 3 rounds starts no prompt and has nothing to sample.
  assert stats["alloc/committed"] == 0 and stats["alloc/empty_groups"] == 2
  assert not np.asarray(rollout.completion_mask_NxT).any()


# --- MoPPS and DPS posteriors by hand -------------------------------------------------------

class PoolStream:
  """What the pool selectors need from a PromptStream: problem i is i; all prompts fit but
  ``long``."""

  def __init__(self, long=()):
    self.long, self.skipped = set(long), 0

  def problem(self, i):
    return i

  def render(self, problem):
    return f"long {problem}" if problem in self.long else f"prompt {problem}"

  def fits(self, text):
    return not text.startswith("long")


def test_mopps_posterior_update_by_hand():
  sel = MoppsSelector(PoolStream(), 3, decay=0.5, seed=0)
  sel.observe([(0, 3, 4)])
  # a = 0.5 * 1 + 0.5 + 3 = 4, b = 0.5 * 1 + 0.5 + 1 = 2.
  assert (sel.alpha[0], sel.beta[0]) == (4.0, 2.0)
  sel.observe([(0, 0, 4), (2, 4, 4)])
  # Prompt 0: a = 0.5 * 4 + 0.5 + 0 = 2.5, b = 0.5 * 2 + 0.5 + 4 = 5.5; prompt 2: 5, 1.
  assert (sel.alpha[0], sel.beta[0]) == (2.5, 5.5) and (sel.alpha[2], sel.beta[2]) == (5, 1)
  assert (sel.alpha[1], sel.beta[1]) == (1.0, 1.0)  # not observed: untouched


def test_mopps_picks_the_prompt_closest_to_one_half():
  sel = MoppsSelector(PoolStream(), 4, ratio=4, seed=0)
  sel.alpha[:] = [1, 50, 100, 1]
  sel.beta[:] = [100, 50, 1, 100]
  # Thompson samples: ~0.01, ~0.5 +- 0.05, ~0.99, ~0.01; ratio 4 x 1 covers the pool.
  for _ in range(5):
    assert [p.index for p in sel.draw(1)] == [1]


def test_dps_update_by_hand():
  sel = DpsSelector(PoolStream(), 2, decay=0.5, prior=1.0, seed=0)
  sel.observe([(0, 2, 4)])  # prompt 0 is 'partial'
  # P = 1/3 everywhere, prev = 1/3: the soft count outer(e_partial, prev) * P normalises to
  # 1/3 in each [partial, prev]; counts = 0.5 * 1 + 0.5 * 1 + soft: row 'partial' 4/3, others 1.
  np.testing.assert_allclose(sel.counts[0], [[1, 1, 1], [4 / 3] * 3, [1, 1, 1]])
  # P[. | partial] = [1, 4/3, 1] / (10/3) = [0.3, 0.4, 0.3] is the prediction.
  np.testing.assert_allclose(sel.pi[0], [0.3, 0.4, 0.3])
  np.testing.assert_allclose(sel.prev[0], [0, 1, 0])
  # Prompt 1 was not observed: counts decay toward the prior (stay 1), prediction stays 1/3.
  np.testing.assert_allclose(sel.counts[1], np.ones((3, 3)))
  np.testing.assert_allclose(sel.pi[1], [1 / 3] * 3)
  sel.observe([(0, 4, 4)])  # now 'solved'
  # Soft count only at [solved, partial] (prev is one-hot partial): 1. Counts: 0.5 * old +
  # 0.5 -> row 'partial' 7/6, others 1; then [solved, partial] += 1 -> 2.
  np.testing.assert_allclose(sel.counts[0], [[1, 1, 1], [7 / 6] * 3, [1, 2, 1]])
  # Prediction from 'solved': column prev = solved, [1, 7/6, 1] / (19/6).
  np.testing.assert_allclose(sel.pi[0], [6 / 19, 7 / 19, 6 / 19])


def test_dps_prefers_the_likely_partial_and_skips_long_prompts():
  sel = DpsSelector(PoolStream(long={2}), 4, ratio=4, seed=0)
  sel.observe([(3, 2, 4)])  # prompt 3: P(partial next) = 0.4 > 1/3 for the others
  assert sel.draw(1)[0].index == 3
  assert sel.draw(1, exclude={3})[0].index in (0, 1)  # 2 never: its prompt is too long
  # Asking for 4 of a pool of 4 reaches prompt 2, which is marked and skipped: 3 come back.
  got = sorted(p.index for p in sel.draw(4))
  assert got == [0, 1, 3] and sel.too_long[2] and sel.stream.skipped == 1
  assert sorted(p.index for p in sel.draw(4)) == [0, 1, 3] and sel.stream.skipped == 1


def test_pool_selector_state_round_trips_exactly():
  a = DpsSelector(PoolStream(), 8, ratio=2, seed=3)
  a.observe([(1, 1, 4), (5, 4, 4)])
  a.draw(2)
  b = DpsSelector(PoolStream(), 8, ratio=2, seed=99)
  b.load_state_dict(a.state_dict())
  # The same generator state and posteriors: the same next draws.
  assert [p.index for p in a.draw(3)] == [p.index for p in b.draw(3)]
  np.testing.assert_array_equal(a.counts, b.counts)


# --- real rounds: one sampler compilation however the rollouts are split ---------------------

def test_rounds_compile_the_sampler_once_for_sara_and_dynamic_sampling():
  tokenizer = transformers.AutoTokenizer.from_pretrained(assets.EMBEDDED_MODEL)
  graphdef, params = nnx.split(from_pretrained(assets.EMBEDDED_MODEL))
  task = countdown.CountdownTask(countdown.GeneratorConfig(max_number=100))
  b, g = 2, 4
  sample_fn = sampler_lib.make_sampler(graphdef, sampler_lib.sampling_config_for(
      tokenizer, 8, model_path=assets.EMBEDDED_MODEL))
  sampler = rounds.RoundSampler(sample_fn, tokenizer, task, slots=b * g, prompt_len=24)
  stream = rollouts_lib.PromptStream(task, tokenizer, 24)
  sara = Sara(StreamSelector(stream), sampler, num_groups=b, group_size=g, probes=2, seed=0)
  ds = DynamicSampling(StreamSelector(stream), sampler, num_groups=b, group_size=g,
                       max_rounds=3)
  total = 0
  for step in range(2):
    for alloc in (sara, ds):
      rollout, stats = alloc.collect(params, step, jax.random.key(step))
      assert rollout.num_rows == b * g
      total += stats["alloc/rounds"]
  assert total > 4 and sampler.rounds == total  # several rounds of different request mixes
  assert sample_fn._cache_size() == 1  # pylint: disable=protected-access


# --- empty groups in the train step ----------------------------------------------------------

@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_an_empty_group_changes_nothing_in_the_update(split, aggregation):
  from grpo_jax import losses  # pylint: disable=g-import-not-at-top
  graphdef, params = split
  g = 4
  full = _rollout(split, MIXED, shift=SHIFT_N)
  empty = rounds.empty_rows(Rows(  # group 1 replaced by an empty group
      prompt_ids_RxP=np.asarray(full.prompt_ids_NxP[4:]),
      prompt_mask_RxP=np.asarray(full.prompt_mask_NxP[4:]),
      tokens_RxT=np.asarray(full.completion_ids_NxT[4:]),
      mask_RxT=np.asarray(full.completion_mask_NxT[4:]),
      logp_RxT=np.asarray(full.behaviour_logp_NxT[4:]), scores_R=np.asarray(full.scores_N[4:]),
      success_R=np.asarray(full.success_N[4:]), lengths_R=np.zeros(4, np.int32),
      truncated_R=np.zeros(4, bool), errors_R=np.zeros(4, bool), texts=[""] * 4), 4)
  with_empty = full.replace(
      completion_mask_NxT=full.completion_mask_NxT.at[4:].set(empty.mask_RxT),
      behaviour_logp_NxT=full.behaviour_logp_NxT.at[4:].set(empty.logp_RxT),
      scores_N=full.scores_N.at[4:].set(0.0), success_N=full.success_N.at[4:].set(False))
  alone = jax.tree.map(lambda x: x[:4], full)
  tx = optax.sgd(0.1)
  config = step_lib.StepConfig(group_size=g, num_minibatches=1,
                               loss=losses.LossConfig(aggregation=aggregation))
  fn = step_lib.make_train_step(graphdef, tx, config)
  out = {}
  for name, r in (("with_empty", with_empty), ("alone", alone)):
    state, _, metrics = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, g, 5, 6),
                           r, None, jax.random.key(0))
    out[name] = (float(metrics["loss"]), state.params)
  assert out["with_empty"][0] == pytest.approx(out["alone"][0], rel=1e-5, abs=1e-7)
  assert abs(out["alone"][0]) > 1e-4  # the shifted log mu make the loss non-zero
  for a, b in zip(jax.tree.leaves(out["with_empty"][1]), jax.tree.leaves(out["alone"][1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_the_run_summary_line_of_an_allocator():
  from grpo_jax import console  # pylint: disable=g-import-not-at-top
  steps = [{"loss": 0.0, "alloc/rollouts_generated": 100.0, "alloc/rollouts_in_update": 50.0,
            "alloc/rounds": 2.0, "alloc/effective_groups": 5.0, "alloc/committed": 5.0,
            "alloc/abandoned": 10.0, "alloc/surplus": 0.0, "alloc/audited": 10.0,
            "alloc/wrong_abandoned": 1.0, "alloc/empty_groups": 0.0},
           {"loss": 0.0, "alloc/rollouts_generated": 200.0, "alloc/rollouts_in_update": 50.0,
            "alloc/rounds": 4.0, "alloc/effective_groups": 5.0, "alloc/committed": 5.0,
            "alloc/abandoned": 20.0, "alloc/surplus": 0.0, "alloc/audited": 20.0,
            "alloc/wrong_abandoned": 2.0, "alloc/empty_groups": 2.0}]
  # In updates 100 / 300 = 33%; rounds (2 + 4) / 2 = 3.0; effective 10 / 300 * 1000 = 33;
  # abandoned 30 of 40 decided = 75%; wrong 3 of 30 audited = 10.0%; 2 empty slots.
  assert console._allocation_line(steps) == (  # pylint: disable=protected-access
      "allocation: rollouts in updates 33% of those generated; 3.0 rounds/step; 33 effective "
      "groups per 1,000 rollouts; abandoned 75% of prompts, 10.0% of 30 audited wrongly; "
      "2 empty group slots")
  uniform = [{"loss": 0.0, "alloc/rounds": 1.0, "alloc/rollouts_generated": 8.0}]
  assert console._allocation_line(uniform) == ""  # pylint: disable=protected-access
