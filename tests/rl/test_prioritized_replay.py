"""Rollout-level prioritised replay: priorities by hand, the fresh-anchored composition, age
eviction and warm-up against a Python model (hypothesis), and the loss in the train step."""

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

from grpo_jax.generate.logprobs import completion_logprobs
from grpo_jax.rl import losses, replay as replay_lib, step as step_lib
from grpo_jax.rl.replay import method as method_lib
from grpo_jax.rl.replay import prioritized
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout
from tests.rl.test_step import (G, MIXED_ADV, P, SHIFT_N, T, _copy, _rollout,
                             traced_step)


def test_priorities_by_hand():
  # |A| + 1e-6 to the power 0.5: 1.000001^.5 = 1.0000005, 0.250001^.5 = 0.5000010,
  # 0.000001^.5 = 0.001; the fourth entry is invalid. Sum 1.5010015 ->
  # 0.6662222, 0.3331118, 0.0006662, 0.
  p = prioritized.priorities(jnp.asarray([1.0, -0.25, 0.0, 2.0]),
                             jnp.asarray([True, True, True, False]), 0.5, 1e-6)
  np.testing.assert_allclose(p, [0.6662222, 0.3331118, 0.0006662, 0.0], rtol=2e-5, atol=1e-7)
  assert float(jnp.sum(p)) == pytest.approx(1.0, abs=1e-6)
  # alpha = 0: uniform over the valid entries; entropy log 3.
  u = prioritized.priorities(jnp.asarray([1.0, -0.25, 0.0, 2.0]),
                             jnp.asarray([True, True, True, False]), 0.0, 1e-6)
  np.testing.assert_allclose(u, [1 / 3, 1 / 3, 1 / 3, 0.0], rtol=1e-6)
  assert float(prioritized.priority_entropy(u)) == pytest.approx(np.log(3), rel=1e-6)
  # No valid entry: all zeros, not NaN.
  z = prioritized.priorities(jnp.ones(3), jnp.zeros(3, bool))
  np.testing.assert_array_equal(z, 0.0)


BR, GR, PR, TR = 2, 2, 2, 2  # tiny shapes for the pure tests: N = 4 fresh rows, R = 2


def _fresh(step, adv_N):
  """B groups of G rollouts; prompt_id 100 * step + row; completion mask True iff row even."""
  ids = 100 * step + np.arange(BR * GR)
  shape = lambda *s: (BR, GR) + s
  grid = lambda v: jnp.asarray(np.asarray(v).reshape(BR, GR))
  return Rollout(
      prompt_ids=jnp.broadcast_to(grid(ids)[..., None], shape(PR)).astype(jnp.int32),
      prompt_mask=jnp.ones(shape(PR), bool),
      completion_ids=jnp.broadcast_to(grid(ids)[..., None], shape(TR)).astype(jnp.int32),
      completion_mask=jnp.ones(shape(TR), bool),
      behaviour_logp=jnp.zeros(shape(TR)), scores=jnp.zeros(shape()),
      truncated=jnp.zeros(shape(), bool),
      success=jnp.zeros(shape(), bool), prompt_id=grid(ids).astype(jnp.int32),
      version=jnp.full(shape(TR), step, jnp.int32)), grid(adv_N).astype(jnp.float32)


@functools.lru_cache(maxsize=None)
def _ops(cfg):
  def run(replay, fresh, adv, step, key):
    ctx = method_lib.StepContext(fresh=fresh, advantages=adv,
                                 effective=jnp.ones((BR,), bool), step=step, rng=key)
    replay = cfg.evict(replay, step)
    comp = cfg.compose(ctx, replay, None)
    replay, metrics = cfg.after_update(ctx, replay, comp)
    return comp, replay, metrics
  return jax.jit(run)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.example(  # found by CI: an unfilled slot's id (0) equals a stored rollout's
    advs=[[0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], tau_max=1, warmup=0, capacity=2,
    insert="nonzero")
@hypothesis.given(
    advs=st.lists(st.lists(st.sampled_from([0.0, 0.5, -1.0, 2.0]), min_size=4, max_size=4),
                  min_size=1, max_size=8),
    tau_max=st.sampled_from([1, 2, 3]), warmup=st.sampled_from([0, 2]),
    capacity=st.sampled_from([2, 5, 9]), insert=st.sampled_from(prioritized.INSERT_MODES))
def test_composition_ages_and_warmup_against_a_python_model(advs, tau_max, warmup, capacity,
                                                             insert):
  """Every replayed row is a live stored rollout (not evicted by the ring, not older than
  tau_max, inserted in an earlier step), with its frozen advantage; no replay before warm-up;
  no entry twice in one batch; as many rows as there are live entries, up to R = 2."""
  cfg = prioritized.PrioritizedReplay(tau_max=tau_max, rho=0.5, warmup_steps=warmup,
                                        insert=insert)
  run = _ops(cfg)
  replay = replay_lib.init_replay(capacity, 1, PR, TR)
  stored = []  # (id, version, adv) in insertion order
  for step, adv in enumerate(advs):
    fresh, adv_BxG = _fresh(step, adv)
    comp, replay, m = run(replay, fresh, adv_BxG, jnp.int32(step), jax.random.key(step))
    n = BR * GR
    assert comp.rollout.num_rows == n + 2
    ids = np.asarray(comp.rollout.prompt_id)
    assert ids[:n].tolist() == list(range(100 * step, 100 * step + n))  # fresh first
    live = {sid: (v, a) for sid, v, a in stored[-capacity:] if step - v <= tau_max}
    replayed = [int(i) for i, r in zip(ids[n:], np.asarray(comp.replayed[n:])) if r]
    if step < warmup:
      assert replayed == []
    else:
      assert len(replayed) == min(2, len(live)) and len(set(replayed)) == len(replayed)
      # By the row's replayed flag, not its id: an unfilled slot is a zero row whose id (0)
      # can equal a stored rollout's (step 0's ids are 0..3).
      for i, a, r in zip(ids[n:], np.asarray(comp.advantages[n:]),
                         np.asarray(comp.replayed[n:])):
        if r:
          assert a == live[int(i)][1]
    np.testing.assert_array_equal(np.asarray(comp.loss_mask[n:]).any(-1),
                                  np.asarray(comp.replayed[n:]))
    # Every group is effective here (_ops), so "effective" stores every rollout, as "all".
    kept = lambda a: insert in ("all", "effective") or a != 0
    assert float(m["replay_inserted"]) == sum(1 for a in adv if kept(a))
    stored += [(100 * step + j, step, a) for j, a in enumerate(adv) if kept(a)]


def test_draws_follow_the_priority_distribution():
  """Four live entries with |A| = 4, 1, 0.25, 0 and alpha = 0.5: P ~ (|A| + 1e-6)^0.5 =
  2, 1, 0.5, 0.001 (sum 3.501), i.e. P = 0.57127, 0.28563, 0.14282, 0.00029. Over 4,000 keys
  with R = 1 draw, the counts are binomial: expected 2285.1, 1142.5, 571.3, 1.1 with standard
  deviations sqrt(n p (1 - p)) = 31.3, 28.6, 22.1, 1.1; every count must lie within 5 of them
  (a chance failure ~1e-6). Mutations this catches: no Gumbel noise (greedy top-k draws entry 0
  4,000 times), alpha ignored (alpha = 1 gives 0.7617, 0.1904, 0.0476: 3,047 / 762 / 190),
  uniform draws (1,000 each), a sign error in the priority."""
  cfg = prioritized.PrioritizedReplay(tau_max=5, rho=0.25, alpha=0.5, warmup_steps=0)
  replay = replay_lib.init_replay(4, 1, PR, TR)
  fresh, adv = _fresh(0, [4.0, -1.0, 0.25, 0.0])
  rows = jax.tree.map(lambda x: x.reshape((-1, 1) + x.shape[2:]), fresh)
  replay = replay_lib.insert(replay, rows, adv.reshape(-1, 1), jnp.ones(4, bool))
  fresh1, adv1 = _fresh(1, [0.0] * 4)
  ctx = lambda k: method_lib.StepContext(fresh=fresh1, advantages=adv1,
                                         effective=jnp.ones((BR,), bool), step=jnp.int32(1),
                                         rng=k)
  n = 4000
  draw = jax.jit(jax.vmap(lambda k: cfg.compose(ctx(k), replay, None).rollout.prompt_id[-1]))
  ids = np.asarray(draw(jax.random.split(jax.random.key(7), n)))
  counts = np.bincount(ids, minlength=4)[:4]
  p = np.asarray([2.0, 1.0, 0.5, 0.001]) / 3.501
  sd = np.sqrt(n * p * (1 - p))
  assert counts.sum() == n
  np.testing.assert_array_less(np.abs(counts - n * p), 5 * sd + 1e-9)


def test_train_step_loss_on_the_fresh_anchored_batch(split, tiny_qwen3):
  """N = 8 fresh rows plus R = 4 replayed rollouts (frozen advantages 0.7, -0.4, 0.9, -1.1 after
  priority order) whose log mu is 0.2 below the policy's (align_mu: rho = e^0.2 = 1.2214, so
  the clip at 1.2 acts on positive advantages): the step's loss equals policy_loss on the
  12-row batch composed by hand, and the step compiles once over several steps."""
  graphdef, params = split
  old = _rollout(split, [1, 0, 0, 1, 0, 1, 0, 0], seed=9)
  rollout = _rollout(split, [1, 0, 0, 1, 0, 1, 0, 0], shift=SHIFT_N)
  stored_adv = jnp.asarray([0.7, -0.4, 0.9, -1.1, 0, 0, 0, 0])
  replay = replay_lib.init_replay(16, 1, P, T)
  rows = jax.tree.map(lambda x: x[:, None], old)
  rows = rows.replace(behaviour_logp=rows.behaviour_logp - 0.2 * rows.completion_mask)
  # Stored at version -10: at step 0 they are exactly tau_max = 10 steps old, which the
  # definition keeps (replayed now); at step 1 they are 11 old, which it evicts.
  rows = rows.replace(version=jnp.full_like(rows.version, -10))
  replay = replay_lib.insert(replay, rows, stored_adv[:, None], stored_adv != 0)
  cfg = prioritized.PrioritizedReplay(tau_max=10, rho=0.5, warmup_steps=0)
  tx = optax.sgd(0.0)
  fn = traced_step(graphdef, tx, StepConfig(num_minibatches=1, group_size=G, replay=cfg))
  state = step_lib.init_train_state(_copy(params), tx)
  state, new_replay, m = fn(state, replay, rollout, None, jax.random.key(0))
  assert float(m["replay_rows"]) == 4.0 and float(m["replay_age_max"]) == 10.0
  # All four stored rollouts are replayed (R = 4 = live entries), in some priority order; the
  # loss is a sum over rows, so the order does not matter for seq-mean-token-mean.
  cat = lambda a, b: jnp.concatenate([a, b[:4]])
  ids = cat(rollout.completion_ids, old.completion_ids)
  prompts = cat(rollout.prompt_ids, old.prompt_ids)
  pmask = cat(rollout.prompt_mask, old.prompt_mask)
  cmask = cat(rollout.completion_mask, old.completion_mask)
  mu = cat(rollout.behaviour_logp, old.behaviour_logp - 0.2 * old.completion_mask)
  adv = jnp.concatenate([jnp.asarray(MIXED_ADV), stored_adv[:4]])
  logp = completion_logprobs(tiny_qwen3, prompts, pmask, ids)
  expected, _ = losses.policy_loss(logp, mu, mu, adv, cmask, losses.LossConfig())
  assert float(m["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
  # The fresh rows with non-zero advantage were inserted after the update (all 8 here).
  assert int(new_replay.num_inserted) == 4 + 8
  # Step 1 (same trace): the 4 entries of version -10 are 11 steps old and evicted; the 8 of
  # step 0 are 1 step old, and R = 4 of them are replayed.
  _, _, m = fn(state, new_replay, _rollout(split, [1, 0, 0, 1, 1, 1, 0, 0], 1), None,
               jax.random.key(1))
  assert float(m["replay_evicted"]) == 4.0 and float(m["replay_rows"]) == 4.0
  assert float(m["replay_age_max"]) == 1.0 and float(m["replay_age_mean"]) == 1.0


def test_paper_composition_drops_ineffective_groups_and_sizes_replay_by_survivors():
  """The reference implementation in fixed shape (drop_ineffective, insert "effective"): with
  B = 2 groups of G = 2 and group 1 ineffective, group 1 leaves the loss; R = round(0.5 * 4) =
  2 replay slots, of which round(0.5 * 2 surviving rows) = 1 is filled although 3 entries are
  live; only group 0's 2 rollouts are stored after the update."""
  cfg = prioritized.PrioritizedReplay(tau_max=5, rho=0.5, warmup_steps=0,
                                        drop_ineffective=True, insert="effective")
  replay = replay_lib.init_replay(8, 1, PR, TR)
  old, old_adv = _fresh(0, [1.0, -1.0, 0.5, 0.0])
  rows = jax.tree.map(lambda x: x.reshape((-1, 1) + x.shape[2:]), old)
  replay = replay_lib.insert(replay, rows, old_adv.reshape(-1, 1), jnp.asarray([1, 1, 1, 0], bool))
  fresh, adv = _fresh(1, [0.7, -0.7, 0.0, 0.0])
  ctx = method_lib.StepContext(fresh=fresh, advantages=adv,
                               effective=jnp.asarray([True, False]), step=jnp.int32(1),
                               rng=jax.random.key(0))
  comp = cfg.compose(ctx, cfg.evict(replay, jnp.int32(1)), None)
  mask = np.asarray(comp.loss_mask).any(-1)
  np.testing.assert_array_equal(mask[:4], [True, True, False, False])  # group 1 dropped
  np.testing.assert_array_equal(np.asarray(comp.replayed[4:]), [True, False])
  assert float(comp.metrics["replay_rows_wanted"]) == 1.0
  new, m = cfg.after_update(ctx, replay, comp)
  assert float(m["replay_inserted"]) == 2.0 and int(new.num_inserted) == 3 + 2
  # Without the drop (the default variant): all 4 fresh rows count and both slots are filled.
  plain = prioritized.PrioritizedReplay(tau_max=5, rho=0.5, warmup_steps=0)
  comp = plain.compose(ctx, plain.evict(replay, jnp.int32(1)), None)
  assert np.asarray(comp.loss_mask).any(-1)[:4].all()
  np.testing.assert_array_equal(np.asarray(comp.replayed[4:]), [True, True])


def test_config_validation():
  with pytest.raises(ValueError, match="tau_max"):
    prioritized.PrioritizedReplay(tau_max=0)
  with pytest.raises(ValueError, match="objective"):
    prioritized.PrioritizedReplay(objective="coupled")
  with pytest.raises(ValueError, match="insert"):
    prioritized.PrioritizedReplay(insert="survivors")
  with pytest.raises(ValueError, match="age_unit"):
    prioritized.PrioritizedReplay(age_unit="epochs")
  # 10 updates with 4 per train step: replayable while at most 2 train steps old; 3 updates
  # with 4 per step would replay nothing, which is refused.
  assert prioritized.PrioritizedReplay(tau_max=10, age_unit="updates",
                                         updates_per_step=4).max_age_steps == 2
  with pytest.raises(ValueError, match="less than one train step"):
    prioritized.PrioritizedReplay(tau_max=3, age_unit="updates", updates_per_step=4)
  assert prioritized.PrioritizedReplay(rho=0.5).extra_rows(256, 8) == 128
