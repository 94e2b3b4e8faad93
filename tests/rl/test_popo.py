"""POPO: exact GRPO equivalence, refill order (property test against a Python model), the three
objectives for replayed rows, GRPO-filter, insertion and the age limit."""

import functools

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import strategies as st

from configs import popo as popo_config
from grpo_jax import configuration
from grpo_jax.generate.logprobs import completion_logprobs
from grpo_jax.rl import losses, replay as replay_lib, replay_objectives, step as step_lib
from grpo_jax.rl.replay import method as method_lib, popo, prioritized
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout
from tests.rl.test_step import B, G, P, T, SHIFT_N, _copy, _rollout

ALL_EFFECTIVE = [1, 0, 0, 1, 0, 1, 0, 0]
ONE_INEFFECTIVE = [1, 0, 0, 1, 0, 0, 0, 0]  # group 1 all wrong
# Group 0 [1, 0, 0, 1] with the unbiased std: mean 0.5, std sqrt(1/3) = 0.5773503 ->
# +-0.5 / 0.5773513 = +-0.8660239.
A0 = [0.8660239, -0.8660239, -0.8660239, 0.8660239]
# Distinct frozen advantages per stored entry and rollout: entry e, rollout j -> (-1)^j (e + 1) / 4
# + j / 100, so a wrong gather index gives a different number.
STORED_ADV = np.asarray([[(-1) ** j * (e + 1) / 4 + j / 100 for j in range(G)] for e in range(B)],
                        np.float32)


@functools.lru_cache(maxsize=None)
def _step_fn(graphdef, replay_cfg, loss, lr, step_kw=()):
  tx = optax.adam(lr) if lr else optax.sgd(0.0)
  config = StepConfig(num_minibatches=1,
                      group_size=G, replay=replay_cfg, loss=loss, **dict(step_kw))
  return tx, step_lib.make_train_step(graphdef, tx, config)


def _run(split, replay_cfg, rollout, replay, loss=losses.LossConfig(), lr=1e-2, **step_kw):
  graphdef, params = split
  tx, fn = _step_fn(graphdef, replay_cfg, loss, lr, tuple(sorted(step_kw.items())))
  state = step_lib.init_train_state(_copy(params), tx)
  return fn(state, replay, rollout, None, jax.random.key(0))


def _buffer_with(split, scores, version=0, shift=0.0):
  """A buffer of capacity 4 holding both groups of one earlier rollout (entries 0, 1), with
  STORED_ADV as their frozen advantages and log mu shifted by ``shift`` (pi_gen with it: in
  float32 the trainer's log-probs at generation are mu, as if an older policy had sampled)."""
  rollout = _rollout(split, scores, seed=9)
  fresh = jax.tree.map(lambda x: x.reshape((B, G) + x.shape[1:]), rollout)
  replay = replay_lib.init_replay(4, G, P, T)
  fresh = fresh.replace(version=jnp.full_like(fresh.version, version))
  replay = replay_lib.insert(replay, fresh, jnp.asarray(STORED_ADV), jnp.ones(B, bool))
  if shift:
    shifted = replay.rollouts.behaviour_logp + shift * replay.rollouts.completion_mask
    replay = replay.replace(rollouts=replay.rollouts.replace(behaviour_logp=shifted),
                            gen_logp=jnp.copy(shifted))
  return replay, rollout


POPO = popo.Popo(fill="replay", max_uses=1)


def test_popo_equals_grpo_when_no_slot_needs_filling(split):
  rollout = _rollout(split, ALL_EFFECTIVE)
  replay, _ = _buffer_with(split, ALL_EFFECTIVE)
  grpo_state, _, grpo_m = _run(split, method_lib.NoReplay(), rollout,
                               replay_lib.init_replay(0, G, P, T))
  popo_state, new_replay, popo_m = _run(split, POPO, rollout, replay)
  # The loss and every metric the two steps share are equal bit for bit. The parameters agree
  # to float32 rounding: the steps are two XLA programs, each compiling the layers' scan body
  # in its own context, whose gradients differ in the last bits, and Adam's first step
  # (lr * g / |g|) turns a last-bit difference of a small gradient entry into up to ~5e-6
  # (measured) of its lr = 1e-2 step.
  for a, b in zip(jax.tree.leaves(grpo_state.params), jax.tree.leaves(popo_state.params)):
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)
  assert float(popo_m["replay_slots_filled"]) == 0.0
  for key in set(grpo_m) & set(popo_m):
    assert float(popo_m[key]) == float(grpo_m[key]), key
  # Both effective fresh groups were stored after the update: 2 old + 2 new entries.
  assert int(new_replay.num_inserted) == 4 and int(new_replay.valid.sum()) == 4


def test_ineffective_slot_takes_the_most_recent_stored_group(split):
  rollout = _rollout(split, ONE_INEFFECTIVE)
  # The stored groups as if an older policy had sampled them: log mu 0.3 below this policy's.
  replay, _ = _buffer_with(split, ALL_EFFECTIVE, shift=-0.3)
  stored_tokens = float(np.asarray(replay.rollouts.completion_mask[1]).sum())
  _, new_replay, m = _run(split, POPO, rollout, replay, lr=0.0)  # (replay is donated)
  assert float(m["replay_slots_filled"]) == 1.0
  assert float(m["ineffective_fraction"]) == 0.5
  # The most recent stored entry is slot 1 (old group 1); it was used once, so with
  # max_uses=1 it will be evicted next step. Slot 0 was not used.
  np.testing.assert_array_equal(new_replay.use_count[:2], [0, 1])
  # Only the effective fresh group 0 was inserted (at slot 2); the ineffective one was not.
  assert int(new_replay.num_inserted) == 3
  np.testing.assert_array_equal(new_replay.rollouts.completion_ids[2],
                                rollout.completion_ids[:G])
  # Replayed tokens: pi_theta / mu = e^0.3 = 1.3499 and (log pi_theta - log mu)^2 = 0.09 (lr 0:
  # pi_theta = pi_prox). The decoupled loss applies w = pi_prox / mu = e^0.3 to them and 1 to
  # the fresh group's tokens, so its mean weight is the token-weighted average of the two (a
  # weight wired to the wrong rows, or to mu / mu, gives another number).
  assert float(m["replay_is_weight_mean"]) == pytest.approx(np.exp(0.3), rel=1e-4)
  assert float(m["replay_drift"]) == pytest.approx(0.09, rel=1e-3)
  fresh_tokens = float(np.asarray(rollout.completion_mask)[:G].sum())
  expected_w = (fresh_tokens + np.exp(0.3) * stored_tokens) / (fresh_tokens + stored_tokens)
  assert float(m["is_weight_mean"]) == pytest.approx(expected_w, rel=1e-4)
  evicted = replay_lib.evict(new_replay, jnp.int32(1), max_uses=1)
  np.testing.assert_array_equal(evicted.valid, [True, False, True, False])


@pytest.mark.parametrize("objective", list(replay_objectives.OBJECTIVES))
def test_each_objective_equals_a_hand_composed_loss(split, tiny_qwen3, objective):
  """Stored rows' log mu is the generating policy's minus 0.5 (as if an older policy had
  sampled them), so pi_prox / mu = e^0.5 = 1.6487 on replayed tokens. By objective:
    decoupled: prox = teacher-forced (rho = 1), w = min(e^0.5, 2) = 1.6487;
    pi_old:    prox = teacher-forced (rho = 1), w = 1 (mu := pi_prox);
    align_mu:  prox = mu, rho = e^0.5 (clipped at 1.2 for A > 0), w = 1.
  Three different losses on the same mixed batch; each must match its own composition."""
  graphdef, params = split
  rollout = _rollout(split, ONE_INEFFECTIVE)
  replay, old = _buffer_with(split, ALL_EFFECTIVE, shift=-0.5)
  loss_cfg = losses.LossConfig(is_cap=2.0)
  cfg = popo.Popo(fill="replay", max_uses=1, objective=objective)
  _, _, m = _run(split, cfg, rollout, replay, loss=loss_cfg, lr=0.0)
  # Composed batch: group 0 fresh, group 1 = stored entry 1 (the old rollout's group 1).
  rows = lambda x, y: jnp.concatenate([x[:G], y[G:]])
  ids = rows(rollout.completion_ids, old.completion_ids)
  prompts = rows(rollout.prompt_ids, old.prompt_ids)
  pmask = rows(rollout.prompt_mask, old.prompt_mask)
  cmask = rows(rollout.completion_mask, old.completion_mask)
  mu = rows(rollout.behaviour_logp, old.behaviour_logp - 0.5 * old.completion_mask)
  logp = completion_logprobs(tiny_qwen3, prompts, pmask, ids)
  teacher_prox = rows(rollout.behaviour_logp, logp)
  prox, beh = {"decoupled": (teacher_prox, mu), "pi_old": (teacher_prox, teacher_prox),
               "align_mu": (mu, mu)}[objective]
  adv = jnp.asarray(A0 + STORED_ADV[1].tolist())
  expected, _ = losses.policy_loss(logp, prox, beh, adv, cmask, loss_cfg)
  assert float(m["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
  # The diagnostics read the loss pass against pi_gen whatever the objective: pi_theta / mu =
  # e^0.5 = 1.6487 and (log pi_theta - log mu)^2 = 0.25 on every replayed token, under all three
  # (they read 1 and 0 under pi_old and align_mu when they compared pi_prox with mu).
  assert float(m["replay_is_weight_mean"]) == pytest.approx(np.exp(0.5), rel=1e-3)
  assert float(m["replay_drift"]) == pytest.approx(0.25, rel=1e-3)
  assert float(m["replay_is_weight_max"]) == pytest.approx(np.exp(0.5), rel=1e-3)
  others = [o for o in replay_objectives.OBJECTIVES if o != objective]
  for other in others:  # the three compositions really differ on this batch
    p2, b2 = {"decoupled": (teacher_prox, mu), "pi_old": (teacher_prox, teacher_prox),
              "align_mu": (mu, mu)}[other]
    alt, _ = losses.policy_loss(logp, p2, b2, adv, cmask, loss_cfg)
    assert abs(float(alt) - float(expected)) > 1e-3


def test_grpo_filter_loss_equals_grpo_on_the_kept_groups_alone(split, tiny_qwen3):
  """Group 1 scores [0, .1, 0, .1]: all failures (ineffective on success) but non-zero score
  advantages, so a no-op drop, or a drop that keeps the rows in the denominator, changes the
  loss. Advantages on the score: group 0 [1, 0, 0, 1] -> +-0.8660239 (as A0)."""
  scores = [1.0, 0.0, 0.0, 1.0, 0.0, 0.1, 0.0, 0.1]
  rollout = _rollout(split, scores, shift=SHIFT_N)
  _, _, m = _run(split, popo.Popo(fill="drop"), rollout,
                 replay_lib.init_replay(0, G, P, T), lr=0.0, reward_signal="score")
  kept = slice(0, G)
  logp = completion_logprobs(tiny_qwen3, rollout.prompt_ids[kept],
                             rollout.prompt_mask[kept], rollout.completion_ids[kept])
  mu = rollout.behaviour_logp[kept]
  expected, _ = losses.policy_loss(logp, mu, mu, jnp.asarray(A0),
                                   rollout.completion_mask[kept], losses.LossConfig())
  assert float(m["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
  assert abs(float(expected)) > 1e-3  # a loss the denominator can change


def test_popo_with_an_empty_buffer_is_exactly_grpo_filter(split):
  """One ineffective group and nothing stored: POPO leaves the unfilled slot out of the loss
  and its denominator, as GRPO-filter drops it, so loss and update (SGD, which a halved loss
  would halve) are identical. Mutation (unfilled="keep", the code before): the all-wrong group
  stays in the seq-mean denominator with advantage 0 and halves the loss and the update."""
  rollout = _rollout(split, ONE_INEFFECTIVE, shift=SHIFT_N)
  graphdef, params = split
  out = {}
  for name, cfg, capacity in (("popo", POPO, 4), ("filter", popo.Popo(fill="drop"), 0),
                              ("keep", popo.Popo(fill="replay", unfilled="keep"), 4)):
    tx = optax.sgd(0.5)
    fn = step_lib.make_train_step(graphdef, tx, StepConfig(num_minibatches=1,
                                                           group_size=G, replay=cfg))
    state, _, m = fn(step_lib.init_train_state(_copy(params), tx),
                     replay_lib.init_replay(capacity, G, P, T), rollout, None, jax.random.key(0))
    out[name] = (float(m["loss"]), state.params, m)
  assert out["popo"][0] == out["filter"][0] and abs(out["popo"][0]) > 1e-3
  for a, b in zip(jax.tree.leaves(out["popo"][1]), jax.tree.leaves(out["filter"][1])):
    np.testing.assert_array_equal(a, b)
  # seq-mean over 4 rows instead of 8: the kept loss is half the dropped one.
  assert out["keep"][0] == pytest.approx(out["filter"][0] / 2, rel=1e-5)
  assert float(out["popo"][2]["replay_slots_unfilled"]) == 1.0
  assert float(out["popo"][2]["loss_rows"]) == G and float(out["keep"][2]["loss_rows"]) == 2 * G


def test_popo_kl_ranks_by_the_kl_estimate_not_the_squared_log_ratio():
  """Two stored groups whose log mu is the current policy's plus delta on every token. POPO-KL's
  k3 estimate of KL(mu || pi) per token is e^-delta - 1 + delta:
    delta = +0.5:  e^-0.5 - 1 + 0.5 = 0.10653 (squared log-ratio 0.25)
    delta = -0.45: e^0.45 - 1 - 0.45 = 0.11831 (squared log-ratio 0.2025)
  so the KL picks the first group and the mean squared log-ratio (the code before) the second."""
  shifts = jnp.asarray([0.5, -0.45])
  rows = jax.tree.map(lambda x: x[:2], _fresh(0, [True, True, False, False]))
  rows = rows.replace(behaviour_logp=jnp.broadcast_to(shifts[:, None, None], (2, GC, TC)) - 1.,
                      completion_mask=jnp.ones((2, GC, TC), bool))
  replay = replay_lib.insert(replay_lib.init_replay(2, GC, PC, TC), rows, jnp.ones((2, GC)),
                             jnp.ones(2, bool))
  policy = lambda r: jnp.full(r.behaviour_logp.shape, -1.0)  # log pi = -1 everywhere
  np.testing.assert_allclose(popo.stored_kl(replay, policy)[0], [0.1065307, 0.1183122], rtol=1e-5)
  cfg = popo.Popo(fill="replay", priority="lowest_kl", slots=1)
  effective = jnp.asarray([True, False, True, True])
  comp = cfg.compose(_ctx(_fresh(1, effective), _adv(1), effective, jnp.int32(1)), replay, policy)
  replayed = np.asarray(comp.rollout.prompt_id).reshape(BC, GC)[1, 0]
  assert replayed == 0  # entry 0 (delta = +0.5): the lower KL
  assert float(comp.metrics["replay_kl_selected"]) == pytest.approx(0.1065307, rel=1e-5)


def test_max_age_keeps_an_entry_exactly_max_age_steps_old():
  """By the definition (POPO's max_age, Yoo et al.'s tau_max): at step 10 with max age 4, an
  entry generated at step 6 (age 4) may be replayed, one from step 5 (age 5) may not. Worked by
  hand, not by the models below that share the implementation's rule."""
  rows = jax.tree.map(lambda x: x[:2], _fresh(0, [True, True, False, False]))
  replay = replay_lib.init_replay(2, GC, PC, TC)
  at = lambda v, i: jax.tree.map(lambda x: x[i:i + 1], rows.replace(
      version=jnp.full_like(rows.version, v)))
  replay = replay_lib.insert(replay, at(5, 0), jnp.ones((1, GC)),
                             jnp.ones(1, bool))  # prompt id 0, version 5
  replay = replay_lib.insert(replay, at(6, 1), jnp.ones((1, GC)),
                             jnp.ones(1, bool))  # prompt id 1, version 6
  cfg = popo.Popo(fill="replay", max_age=4)
  evicted = cfg.evict(replay, jnp.int32(10))
  np.testing.assert_array_equal(evicted.valid, [False, True])
  effective = jnp.asarray([False, False, True, True])
  comp = cfg.compose(_ctx(_fresh(10, effective), _adv(10), effective, jnp.int32(10)), evicted,
                     _no_pass)
  ids = np.asarray(comp.rollout.prompt_id).reshape(BC, GC)[:, 0]
  assert ids[0] == 1 and not bool(np.asarray(comp.replayed).reshape(BC, GC)[1, 0])
  # The same rule in rollout-level replay: tau_max 4 train steps.
  rr = prioritized.PrioritizedReplay(tau_max=4)
  np.testing.assert_array_equal(rr.evict(replay, jnp.int32(10)).valid, [False, True])


# --- compose, insert and the age limit against a plain-Python model (no model needed) ---

BC, GC, PC, TC = 4, 2, 2, 2  # small shapes for the pure-function tests


def _fresh(step, effective):
  """B groups whose prompt_id is 1000 * step + b; success varies where ``effective``."""
  ids = 1000 * step + np.arange(BC)
  success = np.zeros((BC, GC), bool)
  success[np.asarray(effective, bool), 0] = True
  full = lambda v, *s, d=jnp.int32: jnp.broadcast_to(jnp.asarray(v, d).reshape(
      (BC, 1) + (1,) * len(s)), (BC, GC) + s)
  return Rollout(
      prompt_ids=full(ids, PC), prompt_mask=jnp.ones((BC, GC, PC), bool),
      completion_ids=full(ids, TC), completion_mask=full(np.arange(BC) % 2 == 0, TC,
                                                                   d=bool),
      behaviour_logp=jnp.zeros((BC, GC, TC)), scores=jnp.asarray(success, jnp.float32),
      truncated=jnp.zeros_like(jnp.asarray(success), bool),
      success=jnp.asarray(success), prompt_id=full(ids), version=full(np.full(BC, step), TC))


def _adv(step):
  """Distinct advantages per group and rollout: prompt_id + j / 10."""
  return jnp.asarray((1000 * step + np.arange(BC))[:, None] + np.arange(GC)[None] / 10,
                     jnp.float32)


def _ctx(fresh, adv, effective, step):
  return method_lib.StepContext(fresh=fresh, advantages=adv, effective=effective,
                                step=step, rng=jax.random.key(0))


def _no_pass(rows):
  raise AssertionError("POPO with recency priority needs no teacher-forced pass")


@functools.lru_cache(maxsize=None)
def _popo_ops(cfg):
  def run(replay, fresh, adv, effective, step):
    ctx = _ctx(fresh, adv, effective, step)
    replay = cfg.evict(replay, step)
    comp = cfg.compose(ctx, replay, _no_pass)
    replay, _ = cfg.after_update(ctx, replay, comp)
    return comp, replay
  return jax.jit(run)


class PopoModel:
  """POPO's buffer as a Python list: recency order, one-shot / age eviction, slot-by-slot refill."""

  def __init__(self, cfg, capacity):
    self.cfg, self.capacity, self.entries, self.count = cfg, capacity, [], 0

  def step(self, step, effective):
    cfg = self.cfg
    live = [e for e in self.entries
            if (not cfg.max_age or step - e["version"] <= cfg.max_age)
            and (not cfg.max_uses or e["uses"] < cfg.max_uses)]
    self.entries = live
    chosen = sorted(live, key=lambda e: -e["inserted"])[:cfg.slots or BC]
    replayed = {}
    r = 0
    for b in range(BC):
      if not effective[b] and r < len(chosen):
        replayed[b] = chosen[r]
        chosen[r]["uses"] += 1
        r += 1
    for b in range(BC):
      if effective[b] or cfg.insert == "all":
        self.entries.append(dict(id=1000 * step + b, version=step, inserted=self.count, uses=0))
        self.count += 1
    # The ring keeps the last ``capacity`` entries ever inserted (evicted or not).
    self.entries = [e for e in self.entries if e["inserted"] >= self.count - self.capacity]
    return replayed


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    steps=st.lists(st.lists(st.booleans(), min_size=BC, max_size=BC), min_size=1, max_size=8),
    max_age=st.sampled_from([0, 1, 2]), max_uses=st.sampled_from([0, 1]),
    slots=st.sampled_from([0, 1, 3]), insert=st.sampled_from(popo.INSERT_MODES),
    capacity=st.sampled_from([1, 3, 5]))
@hypothesis.example(steps=[[True, True, False, False], [False, False, False, True]], max_age=0,
                    max_uses=0, slots=0, insert="effective", capacity=5)  # 2 slots, 2 entries
@hypothesis.example(steps=[[True, False, False, False], [False, False, False, False]], max_age=0,
                    max_uses=1, slots=0, insert="effective", capacity=5)  # 4 slots, 1 entry
def test_compose_matches_the_python_model(steps, max_age, max_uses, slots, insert, capacity):
  """Which slots are refilled, from which entry (recency order), with that entry's frozen
  advantages, completion mask and version; fresh slots untouched; no entry older than
  max_age ever replayed; POPO-ineff stores every group; the first step (empty buffer) replays
  nothing."""
  cfg = popo.Popo(fill="replay", max_age=max_age, max_uses=max_uses, slots=slots,
                          insert=insert)
  run = _popo_ops(cfg)
  replay = replay_lib.init_replay(capacity, GC, PC, TC)
  model = PopoModel(cfg, capacity)
  for step, effective in enumerate(steps):
    fresh = _fresh(step, effective)
    comp, replay = run(replay, fresh, _adv(step), jnp.asarray(effective), jnp.int32(step))
    expected = model.step(step, effective)
    # The composition is flat rows, group-major: group b is rows b * G .. b * G + G - 1.
    assert comp.rollout.num_rows == BC * GC  # in place: no extra rows
    group = lambda x: np.asarray(x).reshape((BC, GC) + np.asarray(x).shape[1:])
    replayed_B = group(comp.replayed)[:, 0]
    assert replayed_B.nonzero()[0].tolist() == sorted(expected)
    ids = group(comp.rollout.prompt_id)[:, 0]
    adv, mask = group(comp.advantages), group(comp.loss_mask)
    for b in range(BC):
      if b in expected:
        source = expected[b]["id"]
        assert ids[b] == source
        np.testing.assert_allclose(adv[b], source + np.arange(GC) / 10)
        age = step - int(group(comp.rollout.row_version)[b, 0])
        assert age >= 1 and (not max_age or age <= max_age)
        np.testing.assert_array_equal(mask[b], (source % 1000) % 2 == 0)
      else:
        assert ids[b] == 1000 * step + b
        np.testing.assert_allclose(adv[b], _adv(step)[b])
    stored = sorted(int(i) for i, v in zip(replay.rollouts.prompt_id[:, 0], replay.valid)
                    if v)
    # Same live entries (eviction is lazy in both: an entry used now goes at the next step).
    assert stored == sorted(e["id"] for e in model.entries)


def test_drop_masks_only_ineffective_groups():
  cfg = popo.Popo(fill="drop")
  effective = jnp.asarray([True, False, True, False])
  comp = cfg.compose(_ctx(_fresh(0, effective), _adv(0), effective, jnp.int32(0)),
                     replay_lib.init_replay(0, GC, PC, TC), _no_pass)
  fresh_mask = np.asarray(_fresh(0, effective).completion_mask)
  mask = np.asarray(comp.loss_mask).reshape(BC, GC, TC)
  np.testing.assert_array_equal(mask[1], False)
  np.testing.assert_array_equal(mask[3], False)
  np.testing.assert_array_equal(mask[0], fresh_mask[0])
  assert not bool(comp.replayed.any())


def test_replay_config_validation():
  with pytest.raises(ValueError, match="fill"):
    popo.Popo(fill="none")
  with pytest.raises(ValueError, match="priority"):
    popo.Popo(priority="oldest")
  with pytest.raises(ValueError, match="proportional.*per-entry scores"):
    popo.Popo(fill="replay", priority="proportional")
  with pytest.raises(ValueError, match="objective"):
    popo.Popo(objective="on_policy")


def test_config_presets():
  c = popo_config.get_config("stale=10,qwen3_0p6b")
  assert c.replay.capacity == 64 * 12  # the preset's final batch of 64 groups, S + 2 steps
  c.rollout.batch_prompts = 16  # a --config override after the presets
  assert c.replay.capacity == 16 * 12
  assert popo_config.get_config("pi_old").replay.objective == "pi_old"
  assert popo_config.get_config("align_mu").replay.objective == "align_mu"
  assert popo_config.get_config("reuse=3").replay.popo.max_uses == 3
  assert popo_config.get_config("age=16").replay.popo.max_age == 16
  for bad in ("reuse=x", "age=-1", "stale=ten"):  # not a count: the unknown-preset line
    with pytest.raises(ValueError, match=f"unknown config preset '{bad}'; known: age=A,"):
      popo_config.get_config(bad)
  base = popo_config.get_config()
  assert base.replay.popo.max_age == 4 and base.rl.reward_signal == base.rl.effective_signal == \
      "success"
  bad = popo_config.get_config()
  bad.replay.popo.priority = "proportional"
  with pytest.raises(configuration.ConfigError, match="config.replay.popo: .*proportional"):
    configuration.validate(bad)
