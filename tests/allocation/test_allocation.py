"""Rollout allocation: SARA's predictor and rule, dynamic sampling, MoPPS and DPS by hand, budget
accounting, fixed-shape rounds (one sampler compilation), empty groups in the train step."""

import hypothesis
import jax
import numpy as np
import optax
import pytest
import transformers
from flax import nnx
from hypothesis import strategies as st

from grpo_jax import assets
from grpo_jax import configuration
from grpo_jax.allocation import (DpsSelector, DynamicSamplingRule, MoppsSelector, PoolVerdicts,
                                 Prompt, RoundGroups, Rows, SaraRule, StreamSelector, UniformRule,
                                 p_effective, rounds)
from grpo_jax.allocation.sara import decide
from grpo_jax.generate.producer import DROP
from grpo_jax.schema import files
from grpo_jax.generate import prompts as prompts_lib
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.models import from_pretrained
from grpo_jax.rl import step as step_lib
from grpo_jax.rl.replay import init_replay
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.tasks import countdown
from grpo_jax.types import Rollout
from tests.rl.test_step import MIXED, SHIFT_N, _copy, _rollout

P, T = 3, 2


def uniform(selector, rounds_, *, num_groups, group_size):
  return RoundGroups(selector, rounds_, rule=UniformRule(group_size), num_groups=num_groups,
                     group_size=group_size)


def dynamic_sampling(selector, rounds_, *, num_groups, group_size, max_rounds=10, oversample=1):
  return RoundGroups(selector, rounds_, rule=DynamicSamplingRule(group_size,
                                                                 oversample=oversample),
                     num_groups=num_groups, group_size=group_size, max_rounds=max_rounds)


def sara(selector, rounds_, *, num_groups, group_size, probes=4, tau_lo=0.45, tau_hi=0.9,
         max_rounds=10, seed=0):
  rule = SaraRule(group_size, probes=probes, tau_lo=tau_lo, tau_hi=tau_hi)
  return RoundGroups(selector, rounds_, rule=rule, num_groups=num_groups, group_size=group_size,
                     max_rounds=max_rounds, seed=seed)


# --- SARA's closed-form predictor ------------------------------------------------------------

@pytest.mark.parametrize("n, expected", [(2, 6 / 9), (3, 5 / 9), (4, 4 / 9)])
def test_p_effective_after_agreeing_probes_beta11_g8(n, expected):
  # Beta(1,1), G = 8, n agreeing probes: P_inef = prod_{j<m} (n+1+j)/(n+2+j) with m = 8 - n
  # telescopes to (n+1)/9, so P_eff = 1 - (n+1)/9: 0.667, 0.556, 0.444 for n = 2, 3, 4.
  assert p_effective(n, n, 8) == pytest.approx(expected, abs=1e-12)  # all successes
  assert p_effective(n, 0, 8) == pytest.approx(expected, abs=1e-12)  # all failures
  assert round(p_effective(n, n, 8), 2) == {2: 0.67, 3: 0.56, 4: 0.44}[n]


def test_p_effective_and_tau_lo_for_other_group_sizes():
  # Beta(1,1), n agreeing of G: P_eff = 1 - (n+1)/(G+1). G = 16: after 8, 1 - 9/17 = 0.471 >
  # 0.45 (continue); after 9, 1 - 10/17 = 0.412 <= 0.45 (abandon): 0.55 * 17 - 1 = 8.35 -> 9.
  assert p_effective(8, 0, 16) == pytest.approx(1 - 9 / 17, abs=1e-12)
  assert p_effective(9, 9, 16) == pytest.approx(1 - 10 / 17, abs=1e-12)
  assert p_effective(4, 4, 16) == pytest.approx(1 - 5 / 17, abs=1e-12)  # 0.706 after K = 4
  assert [decide(n, 0, 16, 0.45, 0.9) for n in (4, 8, 9)] == ["continue", "continue", "abandon"]
  # G = 4: after 1, 1 - 2/5 = 0.6 (continue); after 2, 1 - 3/5 = 0.4 (abandon).
  assert p_effective(2, 2, 4) == pytest.approx(0.4, abs=1e-12)
  assert [decide(n, n, 4, 0.45, 0.9) for n in (1, 2)] == ["continue", "abandon"]


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
  succeeds when ``script[i][k]``; it checks that no round exceeds its slots and that no prompt
  draws past its script, and records each round's requests."""

  def __init__(self, slots, script):
    self.slots, self.script = slots, script
    self.used = {}  # prompt index -> rollouts drawn so far
    self.rounds = []  # per round: the request counts
    self.requested = []  # per round: (prompt index, count) of each request
    self.request_rows = 0  # rows generated for requests (what an allocator must count)
    self.spare_rows = 0  # rows generated in spare slots (never counted)

  def _rows(self, prompt, count):
    start = self.used.get(prompt.index, 0)
    assert start + count <= len(self.script[prompt.index]), (prompt.index, start, count)
    self.used[prompt.index] = start + count
    success = np.array(self.script[prompt.index][start:start + count], bool)
    rollout = Rollout(prompt_ids=np.full((count, P), 7, np.int32),
                      prompt_mask=np.ones((count, P), bool),
                      completion_ids=np.ones((count, T), np.int32),
                      completion_mask=np.ones((count, T), bool),
                      behaviour_logp=np.full((count, T), -0.5, np.float32),
                      truncated=np.zeros((count,), bool), scores=success.astype(np.float32),
                      success=success, prompt_id=np.full((count,), -1, np.int32),
                      version=np.zeros((count, T), np.int32))
    return Rows(rollout=rollout, errors=np.zeros((count,), bool), texts=["x"] * count)

  def run(self, params, requests, rng, spare=None):
    del params, rng
    used = sum(c for _, c in requests)
    assert used <= self.slots, f"a round of {self.slots} slots asked for {used}"
    per_request = [self._rows(p, c) for p, c in requests]
    fitted, free = [], self.slots - used
    for i, (p, c) in enumerate(spare or ()):
      if 1 <= c <= free:
        fitted.append((i, self._rows(p, c)))
        free -= c
    self.rounds.append([c for _, c in requests])
    self.requested.append([(p.index, c) for p, c in requests])
    self.request_rows += used
    self.spare_rows += sum(len(rows) for _, rows in fitted)
    return per_request, fitted


class BernoulliScript(dict):
  """Scripts made on first use (ListSelector's indices grow without bound): prompt i's G
  outcomes are i.i.d. Bernoulli(rates[i % len(rates)]) from a generator seeded with (seed, i)."""

  def __init__(self, group_size, rates, seed=0):
    super().__init__()
    self.group_size, self.rates, self.seed = group_size, list(rates), seed

  def __missing__(self, i):
    rng = np.random.default_rng([self.seed, i])
    self[i] = (rng.random(self.group_size) < self.rates[i % len(self.rates)]).tolist()
    return self[i]


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
  return np.asarray(rollout.prompt_id).tolist()


def test_uniform_is_one_round_of_full_groups():
  b, g = 2, 4
  script = {0: [1, 0, 0, 0], 1: [0, 0, 0, 0]}
  selector = ListSelector()
  alloc = uniform(selector, ScriptedRounds(b * g, script), num_groups=b, group_size=g)
  rollout, stats = alloc.collect(None, 3, jax.random.key(0))
  assert _ids(rollout) == [0] * 4 + [1] * 4
  np.testing.assert_array_equal(rollout.version, np.full((8, T), 3))  # every token
  assert stats["rollouts"] == 8 and stats["alloc/rollouts_in_update"] == 8
  assert stats["alloc/rounds"] == 1 and stats["alloc/empty_groups"] == 0
  assert stats["alloc/effective_groups"] == 1  # prompt 0 is mixed, prompt 1 is not
  assert selector.seen == [[(0, 1, 4), (1, 0, 4)]]  # (index, successes, trials)


def test_dynamic_sampling_fills_the_batch_with_effective_groups():
  b, g = 2, 4
  # Prompt i is effective (mixed) iff i % 3 == 0: round 0 draws 0, 1 (keeps 0), round 1 draws
  # 2, 3 (keeps 3): B = 2 kept after 2 rounds; every one of the 16 rollouts is counted.
  script = {i: ([1, 0, 1, 1] if i % 3 == 0 else [0, 0, 0, 0]) for i in range(12)}
  alloc = dynamic_sampling(ListSelector(), ScriptedRounds(b * g, script), num_groups=b,
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
  alloc = dynamic_sampling(ListSelector(), ScriptedRounds(b * g, script), num_groups=b,
                          group_size=g, max_rounds=3)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # 3 rounds x 2 prompts x 4 rollouts = 24 generated, none usable: 2 empty groups.
  assert stats["alloc/rounds"] == 3 and stats["rollouts"] == 24
  assert stats["alloc/capped"] == 1 and stats["alloc/empty_groups"] == 2
  assert stats["alloc/rollouts_in_update"] == 0
  assert not np.asarray(rollout.completion_mask).any()
  assert not np.asarray(rollout.success).any() and not np.asarray(rollout.scores).any()


@pytest.mark.parametrize("oversample, rounds, ids, dropped", [
    # Generation batches of 3 rounds x 2 prompts: batch 1 draws 0..5 and keeps 1; batch 2
    # draws 6..11 and keeps 7, and runs to its end: 9 and 10 are effective extras, dropped.
    # 6 rounds x 2 prompts x 4 rollouts = 48 counted.
    (3, 6, [1] * 4 + [7] * 4, 2),
    # One round per batch (as before oversample): stops after round 3 (prompts 6, 7): 32.
    (1, 4, [1] * 4 + [7] * 4, 0)])
def test_dynamic_sampling_checks_after_each_generation_batch(oversample, rounds, ids, dropped):
  b, g = 2, 4
  script = {i: ([1, 0, 1, 1] if i in (1, 7, 9, 10) else [0, 0, 0, 0]) for i in range(20)}
  rounds_ = ScriptedRounds(b * g, script)
  alloc = dynamic_sampling(ListSelector(), rounds_, num_groups=b, group_size=g, max_rounds=30,
                          oversample=oversample)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  assert rounds_.rounds == [[4, 4]] * rounds  # B fresh prompts x G a round
  assert [i for rnd in rounds_.requested for i, _ in rnd] == list(range(2 * rounds))
  assert _ids(rollout) == ids
  assert stats["alloc/rounds"] == rounds and stats["rollouts"] == rounds * 2 * 4
  assert stats["alloc/generation_batches"] == rounds // oversample  # 2 batches; 4 of 1 round
  assert stats["alloc/effective_dropped"] == dropped
  assert stats["alloc/prompts_touched"] == 2 * rounds and stats["alloc/capped"] == 0
  assert stats["alloc/rollouts_in_update"] == 8 and stats["alloc/effective_groups"] == 2


def test_dynamic_sampling_round_cap_cuts_a_generation_batch():
  b, g = 2, 4
  script = {i: ([1, 0, 0, 0] if i == 4 else [1, 1, 1, 1]) for i in range(20)}
  rounds_ = ScriptedRounds(b * g, script)
  alloc = dynamic_sampling(ListSelector(), rounds_, num_groups=b, group_size=g, max_rounds=4,
                          oversample=3)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # Batch 1 (rounds 0-2, prompts 0..5) keeps 4; batch 2 gets round 3 (6, 7) before the cap of
  # 4 rounds: 4 x 2 x 4 = 32 rollouts, one group kept, one empty group.
  assert rounds_.rounds == [[4, 4]] * 4 and stats["rollouts"] == 32
  assert stats["alloc/generation_batches"] == 2 and stats["alloc/capped"] == 1
  assert stats["alloc/empty_groups"] == 1 and stats["alloc/rollouts_in_update"] == 4
  assert _ids(rollout)[:4] == [4] * 4
  assert not np.asarray(rollout.completion_mask)[4:].any()


@pytest.mark.parametrize("pool, rounds", [(5, 3), (4, 2)])
def test_dynamic_sampling_stops_when_the_pool_runs_dry(pool, rounds):
  b, g = 2, 4
  script = {i: [0, 0, 0, 0] for i in range(pool)}  # nothing is effective
  rounds_ = ScriptedRounds(b * g, script)
  alloc = dynamic_sampling(MoppsSelector(PoolStream(), pool, seed=0), rounds_, num_groups=b,
                          group_size=g, max_rounds=30, oversample=3)
  _, stats = alloc.collect(None, 0, jax.random.key(0))
  # Pool of 5: rounds of 2, 2, then the last 1 (fewer than B: dry). Pool of 4: 2, 2, then the
  # selector has none left (it raises; the step stops). One generation batch either way.
  assert [sum(r) for r in rounds_.rounds] == ([8, 8, 4] if pool == 5 else [8, 8])
  assert stats["alloc/rounds"] == rounds and stats["rollouts"] == 4 * pool
  assert stats["alloc/prompts_touched"] == pool and stats["alloc/generation_batches"] == 1
  assert stats["alloc/capped"] == 1 and stats["alloc/empty_groups"] == 2


def test_dynamic_sampling_oversample_must_fit_the_round_cap():
  c = files.load("dapo")
  c.allocation.max_rounds, c.allocation.dynamic_sampling.oversample = 2, 3
  with pytest.raises(configuration.ConfigError,
                     match="dynamic_sampling.oversample: 3 must be <= allocation.max_rounds=2"):
    configuration.validate(c)
  with pytest.raises(ValueError, match="max_rounds must be >= 2"):  # probes need a completion
    sara(ListSelector(), ScriptedRounds(8, {}), num_groups=2, group_size=4, probes=2,
         max_rounds=1)


def test_sara_commits_abandons_and_counts_every_rollout():
  b, g, k = 2, 8, 4
  script = {0: [1, 0, 1, 1, 0, 0, 1, 0],  # mixed probes: commit, then complete
            1: [0, 0, 0, 0, 0, 1, 0, 0],  # agreeing probes: abandon (completing it: effective)
            2: [1, 1, 1, 1, 1, 1, 1, 1],  # abandon (completing it: still all successes)
            3: [0, 1, 0, 0, 0, 0, 0, 0]}  # commit
  rounds_ = ScriptedRounds(b * g, script)
  alloc = sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, seed=0)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # Round 0: commit rate 0.5, 2 groups needed -> ceil(2 / 0.5) = 4 new prompts x 4 probes = the
  # 16 slots. Prompts 0 and 3 commit, 1 and 2 are abandoned (P_eff = 0.44 <= 0.45).
  # Round 1: completions 4 + 4 = 8 rows; the 8 free slots audit both abandoned prompts (4
  # each, not counted). Then both groups are complete.
  assert rounds_.rounds == [[4, 4, 4, 4], [4, 4]]
  assert _ids(rollout) == [0] * 8 + [3] * 8
  np.testing.assert_array_equal(np.asarray(rollout.success),
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
  assert alloc.rule.commit_rate == 0.5


def test_sara_continues_one_rollout_at_a_time_between_thresholds():
  b, g, k = 1, 8, 2
  script = {0: [0] * 8, 1: [0, 0, 1, 0, 0, 0, 0, 0]}
  rounds_ = ScriptedRounds(b * g, script)
  alloc = sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, seed=0)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # Round 0: ceil(1 / 0.5) = 2 new prompts x 2 probes. Both agree: P_eff = 0.667 -> continue.
  # Round 1: one more each: prompt 0 (3 agreeing, 0.556) continues, prompt 1 mixes -> commit.
  # That is B commits: prompt 0 could only become surplus, so it is dropped, undecided.
  # Round 2: prompt 1 completes (8 - 3 = 5 rows).
  assert rounds_.rounds == [[2, 2], [1, 1], [5]]
  assert _ids(rollout) == [1] * 8
  assert stats["rollouts"] == 4 + 2 + 5 and stats["alloc/abandoned"] == 0
  assert stats["alloc/committed"] == 1 and stats["alloc/undecided"] == 1


def test_sara_does_not_complete_commits_beyond_b():
  b, g, k = 1, 8, 4
  script = {0: [1, 0, 0, 0, 1, 1, 1, 1], 1: [0, 1, 0, 0, 0, 0, 0, 0]}
  rounds_ = ScriptedRounds(b * g, script)
  alloc = sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, seed=0)
  _, stats = alloc.collect(None, 0, jax.random.key(0))
  # Two prompts probed (ceil(1 / 0.5) = 2), both mixed: the first is committed and completed,
  # the second is surplus (4 probes spent, not completed).
  assert rounds_.rounds == [[4, 4], [4]]
  assert stats["alloc/surplus"] == 1 and stats["rollouts"] == 12


def test_sara_round_cap_leaves_empty_groups():
  b, g, k = 2, 4, 2
  script = {i: [1] * 4 for i in range(40)}  # always agreeing: always abandoned
  alloc = sara(ListSelector(), ScriptedRounds(b * g, script), num_groups=b, group_size=g,
               probes=k, max_rounds=3, seed=0)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # G = 4, K = 2: 2 agreeing -> P_eff = 1 - 3/5 = 0.4 <= 0.45: abandon at once. The last of
  # the 3 rounds starts no prompt and has nothing to sample.
  assert stats["alloc/committed"] == 0 and stats["alloc/empty_groups"] == 2
  assert not np.asarray(rollout.completion_mask).any()


def test_sara_caps_a_round_at_its_slots_and_drops_the_undecided_after_b_commits():
  b, g, k = 8, 8, 2
  script = {i: [1, 0, 0, 0, 0, 0, 0, 0] for i in range(7)}  # mixed probes: commit
  script[7] = [0, 0, 1, 0, 0, 0, 0, 0]  # agrees at 2 (continue), mixes at 3: commit
  script.update({i: [0] * 8 for i in range(8, 32)})  # agreeing: continue at 2 and 3
  rounds_ = ScriptedRounds(b * g, script)
  alloc = sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, seed=0)
  alloc.rule.commit_rate = 0.05  # the floor, as a run of hard steps leaves it
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # Round 0: ceil(8 / 0.05) = 160 wanted, 64 // 2 = 32 fit: prompts 0..31 x 2 = 64 slots.
  # Prompts 0..6 commit, 7..31 continue (P_eff = 0.667). Round 1 would ask 7 x 6 = 42
  # completions + 25 undecided = 67 > 64: the completions go first, then 64 - 42 = 22 of the
  # undecided (7..28) get one rollout, no new prompt. Prompt 7 mixes and is the 8th commit:
  # the 24 still undecided (21 at 3 rollouts, 3 at 2) are dropped. Round 2: 8 - 3 = 5 rows.
  assert rounds_.rounds == [[2] * 32, [6] * 7 + [1] * 22, [5]]
  assert _ids(rollout) == [i for i in range(8) for _ in range(8)]
  assert stats["rollouts"] == 64 + 64 + 5 == rounds_.request_rows
  assert stats["alloc/committed"] == 8 and stats["alloc/undecided"] == 24
  assert stats["alloc/abandoned"] == 0 and stats["alloc/surplus"] == 0
  assert stats["alloc/incomplete"] == 0 and stats["alloc/prompts_touched"] == 32
  # Only the 8 decided prompts move the commit rate: 0.5 * 0.05 + 0.5 * 8/8 = 0.525.
  assert alloc.rule.commit_rate == pytest.approx(0.525)


def test_sara_last_round_only_completes_committed_groups():
  b, g, k = 2, 8, 2
  script = {0: [1, 0, 0, 0, 0, 0, 0, 0], 1: [0, 0, 1, 0, 0, 0, 0, 0], 2: [0] * 8, 3: [0] * 8}
  rounds_ = ScriptedRounds(b * g, script)
  alloc = sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, max_rounds=2,
               seed=0)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # Round 0: ceil(2 / 0.5) = 4 prompts x 2. Prompt 0 commits, 1..3 continue (0.667). Round 1 is
  # the last: it completes prompt 0 (8 - 2 = 6 rows) and nothing else, since one more rollout
  # for 1..3 could at best commit a group no round is left to complete (before: 3 more rows,
  # prompt 1 committed with 3 of its 8 rows and never trained on). 8 + 6 rollouts.
  assert rounds_.rounds == [[2, 2, 2, 2], [6]]
  assert stats["rollouts"] == 8 + 6 and stats["alloc/rollouts_in_update"] == 8
  assert stats["alloc/committed"] == 1 and stats["alloc/incomplete"] == 0
  assert stats["alloc/undecided"] == 3 and stats["alloc/empty_groups"] == 1
  assert _ids(rollout)[:8] == [0] * 8
  mask = np.asarray(rollout.completion_mask)
  assert mask[:8].all() and not mask[8:].any()


def test_sara_continues_many_prompts_with_g16():
  b, g, k = 2, 16, 4
  script = {0: [0] * 16, 1: [1] * 16,
            2: [0] * 6 + [1] + [0] * 9,  # agrees for 6 rollouts, mixes at the 7th: commit
            3: [0] * 15 + [1],  # abandoned after 9 agreeing; its completion is effective
            4: [1] + [0] * 15, 5: [0, 1] + [0] * 14}  # mixed probes: commit, then surplus
  rounds_ = ScriptedRounds(b * g, script)
  alloc = sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, seed=0)
  rollout, stats = alloc.collect(None, 0, jax.random.key(0))
  # Defaults tau_lo = 0.45, tau_hi = 0.9, G = 16: n agreeing give 1 - (n+1)/17, which is in
  # (0.45, 0.9) for n = 4..8, so agreeing prompts continue one rollout a round.
  # Round 0: ceil(2 / 0.5) = 4 prompts (0..3) x 4; all agree (0.706).
  # Rounds 1-3: one each (no new: 2 - 4 * 0.5 = 0 needed); prompt 2 mixes at its 7th: commit.
  # Round 4: prompt 2 completes (16 - 7 = 9) and 0, 1, 3 reach 8 (0.471: continue).
  # Round 5: 0, 1, 3 reach 9 (0.412): abandon. One group missing, no prompt undecided.
  # Round 6: ceil(1 / 0.5) = 2 new prompts (4, 5) x 4, both mixed: 4 commits, 5 is surplus;
  # the free 24 slots audit 0, 1, 3 (16 - 9 = 7 each, not counted). Round 7: 12 complete 4.
  assert rounds_.rounds == [[4] * 4, [1] * 4, [1] * 4, [1] * 4, [9, 1, 1, 1], [1] * 3, [4, 4],
                            [12]]
  assert _ids(rollout) == [2] * 16 + [4] * 16
  assert stats["rollouts"] == 16 + 4 + 4 + 4 + 12 + 3 + 8 + 12 == 63
  assert rounds_.spare_rows == 21
  assert stats["alloc/committed"] == 2 and stats["alloc/abandoned"] == 3
  assert stats["alloc/surplus"] == 1 and stats["alloc/undecided"] == 0
  assert stats["alloc/abandon_rate"] == 0.5  # 3 of the 6 decided
  assert stats["alloc/audited"] == 3 and stats["alloc/wrong_abandoned"] == 1  # prompt 3
  assert alloc.selector.seen == [[(0, 0, 9), (1, 9, 9), (2, 1, 16), (3, 0, 9), (4, 1, 16),
                                  (5, 1, 4)]]


def _check_sara_steps(alloc, rounds_, script, steps):
  """Runs ``steps`` collects on one Sara and checks each step against a replay of its rounds:
  no round over S, every request row counted once, full groups of one prompt's script, and no
  prompt sampled after its verdict but the commits' completions (none but those once B
  prompts have committed)."""
  b, g = alloc.num_groups, alloc.group_size
  for step in range(steps):
    first, rows_before = len(rounds_.requested), rounds_.request_rows
    rollout, stats = alloc.collect(None, step, jax.random.key(step))
    requested = rounds_.requested[first:]
    assert 1 <= len(requested) == stats["alloc/rounds"] <= alloc.max_rounds
    assert all(sum(c for _, c in rnd) <= rounds_.slots for rnd in requested)
    assert stats["rollouts"] == rounds_.request_rows - rows_before
    # Replay the decisions: a prompt is decided after the first round that leaves it outside
    # (tau_lo, tau_hi); commits and surplus together are the prompts decided "commit".
    n, s, verdict = {}, {}, {}
    for rnd in requested:
      commits = sum(v == "commit" for v in verdict.values())
      for i, c in rnd:
        assert verdict.get(i) != "abandon"
        assert commits < b or verdict.get(i) == "commit", (step, i, "sampled after B commits")
        s[i] = s.get(i, 0) + sum(script[i][n.get(i, 0):n.get(i, 0) + c])
        n[i] = n.get(i, 0) + c
      for i, _ in rnd:
        if i not in verdict:
          v = decide(n[i], s[i], g, alloc.rule.tau_lo, alloc.rule.tau_hi, alloc.rule.alpha0,
                     alloc.rule.beta0)
          if v != "continue":
            verdict[i] = v
    commits = sum(v == "commit" for v in verdict.values())
    assert stats["alloc/committed"] == min(commits, b) and stats["alloc/committed"] <= b
    assert stats["alloc/surplus"] == commits - min(commits, b)
    assert stats["alloc/abandoned"] == sum(v == "abandon" for v in verdict.values())
    assert stats["alloc/undecided"] == len(n) - len(verdict) == stats["alloc/prompts_touched"] - (
        stats["alloc/committed"] + stats["alloc/abandoned"] + stats["alloc/surplus"])
    # The batch: B * G rows, each group empty or G rows of one prompt, its script in order.
    assert rollout.num_rows == b * g
    ids = np.asarray(rollout.prompt_id).reshape(b, g)
    mask = np.asarray(rollout.completion_mask).any(-1).reshape(b, g)
    success = np.asarray(rollout.success).reshape(b, g)
    full = 0
    for j in range(b):
      if not mask[j].any():
        assert not success[j].any()
        continue
      assert mask[j].all() and (ids[j] == ids[j, 0]).all()
      assert verdict[int(ids[j, 0])] == "commit" and n[int(ids[j, 0])] == g
      np.testing.assert_array_equal(success[j], np.array(script[int(ids[j, 0])][:g], bool))
      full += 1
    assert full * g == stats["alloc/rollouts_in_update"]
    assert full == stats["alloc/committed"] - stats["alloc/incomplete"]
    assert full + stats["alloc/empty_groups"] == b


@pytest.mark.parametrize("b, g, k", [(8, 8, 2), (32, 8, 1)])
def test_sara_hard_prompts_never_overflow_a_round(b, g, k):
  # Hard prompts (successes at rate 0.05) pull the commit rate toward its floor, so a round
  # starts many probes; before the cap, the next round's completions plus one rollout per
  # undecided prompt asked for more than S (67 of 64 at step 17; 275 of 256 at step 5).
  script = BernoulliScript(g, [0.05], seed=0)
  rounds_ = ScriptedRounds(b * g, script)
  alloc = sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, seed=0)
  _check_sara_steps(alloc, rounds_, script, steps=30)


_SHAPES = st.integers(1, 8).flatmap(lambda b: st.integers(2, 16).flatmap(
    lambda g: st.tuples(st.just(b), st.just(g), st.integers(1, g))))  # (B, G, K)


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(shape=_SHAPES, tau_lo=st.sampled_from([0.0, 0.2, 0.45, 0.6]),
                  tau_hi=st.sampled_from([0.7, 0.9, 1.0]), max_rounds=st.integers(2, 12),
                  rates=st.lists(st.sampled_from([0.0, 0.05, 0.2, 0.5, 0.9, 1.0]), min_size=1,
                                 max_size=6),
                  seed=st.integers(0, 2**16), commit_rate=st.sampled_from([0.05, 0.2, 0.5, 0.9]))
# Rare at random (about 1 example in 100): a round over S without the cap (49 of 48 and 42
# of 32 slots), kept as examples.
@hypothesis.example(shape=(6, 8, 2), tau_lo=0.45, tau_hi=0.9, max_rounds=10, rates=[0.2],
                    seed=1, commit_rate=0.05)
@hypothesis.example(shape=(4, 8, 1), tau_lo=0.45, tau_hi=0.9, max_rounds=10, rates=[0.05],
                    seed=0, commit_rate=0.05)
def test_sara_rounds_fit_and_count_every_rollout(shape, tau_lo, tau_hi, max_rounds, rates, seed,
                                                 commit_rate):
  b, g, k = shape  # every tau_lo drawn is below every tau_hi
  script = BernoulliScript(g, rates, seed=seed)
  rounds_ = ScriptedRounds(b * g, script)
  alloc = sara(ListSelector(), rounds_, num_groups=b, group_size=g, probes=k, tau_lo=tau_lo,
               tau_hi=tau_hi, max_rounds=max_rounds, seed=0)
  # The commit rate earlier steps left: at the 0.05 floor a round starts S / K probes, and the
  # next round's completions plus the undecided then overflow S unless capped.
  alloc.rule.commit_rate = commit_rate
  _check_sara_steps(alloc, rounds_, script, steps=4)


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
  stream = prompts_lib.PromptStream(task, tokenizer, 24)
  sara_ = sara(StreamSelector(stream), sampler, num_groups=b, group_size=g, probes=2, seed=0)
  ds = dynamic_sampling(StreamSelector(stream), sampler, num_groups=b, group_size=g,
                       max_rounds=3)
  total = 0
  for step in range(2):
    for alloc in (sara_, ds):
      rollout, stats = alloc.collect(params, step, jax.random.key(step))
      assert rollout.num_rows == b * g
      total += stats["alloc/rounds"]
  assert total > 4 and sampler.rounds == total  # several rounds of different request mixes
  assert sample_fn._cache_size() == 1  # pylint: disable=protected-access


# --- empty groups in the train step ----------------------------------------------------------

@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_an_empty_group_changes_nothing_in_the_update(split, aggregation):
  from grpo_jax.rl import losses  # pylint: disable=g-import-not-at-top
  graphdef, params = split
  g = 4
  full = _rollout(split, MIXED, shift=SHIFT_N)
  host = jax.tree.map(lambda x: np.asarray(x[4:]), full)
  empty = rounds.empty_rows(  # group 1 replaced by an empty group
      Rows(rollout=host, errors=np.zeros(4, bool), texts=[""] * 4), 4).rollout
  with_empty = full.replace(
      completion_mask=full.completion_mask.at[4:].set(empty.completion_mask),
      behaviour_logp=full.behaviour_logp.at[4:].set(empty.behaviour_logp),
      scores=full.scores.at[4:].set(0.0), success=full.success.at[4:].set(False))
  alone = jax.tree.map(lambda x: x[:4], full)
  tx = optax.sgd(0.1)
  config = StepConfig(group_size=g, num_minibatches=1,
                               loss=losses.LossConfig(aggregation=aggregation))
  fn = step_lib.make_train_step(graphdef, tx, config)
  out = {}
  for name, r in (("with_empty", with_empty), ("alone", alone)):
    state, _, metrics = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, g, 5, 6),
                           r, None, jax.random.key(0))
    out[name] = (float(metrics["loss"]), state.params, metrics)
  assert out["with_empty"][0] == pytest.approx(out["alone"][0], rel=1e-5, abs=1e-7)
  # The metrics average over the real rows and groups only: an empty group is padding. Before,
  # success, reward, length and the effective fraction were averaged over it too (halved here),
  # and the advantage statistics over its rows. group 0 = MIXED[:4] = [1, 0, 0, 1].
  for key in ("success_mean", "reward_mean", "effective_fraction", "ineffective_fraction",
              "advantage_abs_mean", "completion_length_mean", "nonzero_advantage_fraction",
              "loss_rows"):
    assert float(out["with_empty"][2][key]) == pytest.approx(float(out["alone"][2][key]),
                                                             rel=1e-6), key
  assert float(out["alone"][2]["success_mean"]) == 0.5
  assert float(out["alone"][2]["effective_fraction"]) == 1.0
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


def _scored(successes):
  """Host Rows with the given successes (what a pool policy reads)."""
  n = len(successes)
  success = np.asarray(successes, bool)
  rollout = Rollout(prompt_ids=np.zeros((n, 1), np.int32), prompt_mask=np.ones((n, 1), bool),
                    completion_ids=np.ones((n, 2), np.int32),
                    completion_mask=np.ones((n, 2), bool),
                    behaviour_logp=np.zeros((n, 2), np.float32), truncated=np.zeros(n, bool),
                    scores=success.astype(np.float32), success=success,
                    prompt_id=np.zeros(n, np.int32), version=np.zeros((n, 2), np.int32))
  return Rows(rollout=rollout, errors=np.zeros(n, bool), texts=["x"] * n)


def test_sara_on_the_pool_by_hand():
  # G = 8, K = 4, Beta(1, 1), tau_lo 0.3, tau_hi 0.9. After n agreeing rollouts
  # P_eff = 1 - (n + 1) / 9: 4 -> 0.444, 5 -> 0.333 (continue: one more each), 6 -> 0.222
  # (abandon). Mixed probes: P_eff = 1, commit: the other 4 rows, then complete at 8.
  pool_sara = PoolVerdicts(SaraRule(8, probes=4, tau_lo=0.3, tau_hi=0.9))
  assert pool_sara.first_rows == 4
  assert [pool_sara.verdict("a", _scored([0] * n), 8) for n in (4, 5, 6)] == [1, 1, DROP]
  assert pool_sara.verdict("b", _scored([1, 0, 0, 0]), 8) == 4
  # A checkpoint between the commit and the group's end: the resumed rule still knows "b" is
  # committed, so its 8 rows complete it without a second commit; a fresh rule would decide
  # again and count "b" committed twice.
  state = pool_sara.state_dict()
  assert pool_sara.take_stats() == {"alloc/committed": 1.0, "alloc/abandoned": 1.0,
                               "alloc/abandon_rate": 0.5}
  resumed = PoolVerdicts(SaraRule(8, probes=4, tau_lo=0.3, tau_hi=0.9))
  resumed.load_state_dict(state)
  assert resumed.verdict("b", _scored([1, 0, 0, 0, 1, 1, 1, 1]), 8) == 0
  assert resumed.take_stats()["alloc/committed"] == 0.0
  # Agreeing probes with tau_hi = 0.4 commit (0.444 >= 0.4); the completed group agrees too,
  # and is still complete (committed), not abandoned.
  eager = PoolVerdicts(SaraRule(8, probes=4, tau_lo=0.3, tau_hi=0.4))
  assert eager.verdict("c", _scored([0] * 4), 8) == 4
  assert eager.verdict("c", _scored([0] * 8), 8) == 0
  # K = G: the probes are the group; it commits (mixed) or is abandoned (agreeing) at once.
  whole = PoolVerdicts(SaraRule(8, probes=8, tau_lo=0.45, tau_hi=0.9))
  assert whole.verdict("d", _scored([1] + [0] * 7), 8) == 0
  assert whole.verdict("e", _scored([0] * 8), 8) == DROP


def test_dynamic_sampling_on_the_pool_drops_agreeing_groups():
  dapo = PoolVerdicts(DynamicSamplingRule(4, "success"))
  assert dapo.first_rows == 4
  assert dapo.verdict("a", _scored([1, 1, 1, 1]), 4) == DROP
  assert dapo.verdict("b", _scored([1, 0, 1, 1]), 4) == 0
  assert dapo.take_stats() == {"alloc/ineffective_dropped": 1.0}
