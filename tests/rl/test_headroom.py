"""Headroom-Drift replay: headroom and drift by hand, the admission walk against a Python model
(hypothesis: no group with D > tau is ever used), the ablations, and the train step."""

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
from grpo_jax.rl.replay import headroom as headroom_lib
from grpo_jax.rl.replay import method as method_lib
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout
from tests.rl.test_step import (B, G, MIXED_ADV, P, SHIFT_N, T, _copy, _rollout,
                             traced_step)


def test_group_headroom_by_hand():
  # Row 0 (A > 0): 1 - 0.5 = 0.5 and 1 - 0.8 = 0.2; row 1 (A < 0): 0.1, its second token
  # masked; row 2 (A = 0): two tokens of headroom 0 that still count. Mean (0.5+0.2+0.1) / 5.
  logp = jnp.log(jnp.asarray([[0.5, 0.8], [0.1, 0.6], [0.3, 0.3]]))
  mask = jnp.asarray([[1, 1], [1, 0], [1, 1]], bool)
  h = headroom_lib.group_headroom(logp, jnp.asarray([1.5, -0.2, 0.0]), mask)
  assert float(h) == pytest.approx(0.8 / 5, rel=1e-6)
  # Sign only: scaling the advantages changes nothing.
  h2 = headroom_lib.group_headroom(logp, jnp.asarray([10.0, -3.0, 0.0]), mask)
  assert float(h2) == float(h)


def test_group_drift_by_hand():
  # Differences +0.1, -0.1 (masked: 5.0), -0.2 -> squares 0.01, 0.01, 0.04 over 3 tokens = 0.02;
  # the +-0.1 do not cancel.
  pol = jnp.asarray([[0.0, -1.0], [-2.0, 0.0]])
  gen = jnp.asarray([[-0.1, -0.9], [-1.8, -5.0]])
  mask = jnp.asarray([[1, 1], [1, 0]], bool)
  assert float(headroom_lib.group_drift(pol, gen, mask)) == pytest.approx(0.02, rel=1e-5)


BH, GH, PH, TH = 2, 2, 2, 2
CAP = 6


def _group_rows(ids, adv_sign):
  """A [len(ids), G, ...] Rollout whose prompt_id is the group id; log mu = -1 everywhere."""
  k = len(ids)
  shape = lambda *s: (k, GH) + s
  ids = jnp.asarray(ids, jnp.int32)
  return Rollout(
      prompt_ids=jnp.broadcast_to(ids[:, None, None], shape(PH)),
      prompt_mask=jnp.ones(shape(PH), bool),
      completion_ids=jnp.broadcast_to(ids[:, None, None], shape(TH)),
      completion_mask=jnp.ones(shape(TH), bool),
      behaviour_logp=jnp.full(shape(TH), -1.0), scores=jnp.zeros(shape()),
      truncated=jnp.zeros(shape(), bool),
      success=jnp.zeros(shape(), bool), prompt_id=jnp.broadcast_to(ids[:, None], shape()),
      version=jnp.zeros(shape(TH), jnp.int32)), jnp.broadcast_to(
          jnp.asarray(adv_sign, jnp.float32)[:, None] * jnp.asarray([1.0, -1.0]), (k, GH))


def _fake_policy(shift_by_id):
  """log pi = log mu + shift[id] on every token: group id's drift is shift[id]^2."""
  shift = jnp.asarray(shift_by_id, jnp.float32)
  def logp_fn(rows):
    return rows.behaviour_logp + shift[rows.prompt_id][:, None]
  return logp_fn


@functools.lru_cache(maxsize=None)
def _compose(cfg):
  def run(replay, shifts, step):
    fresh, adv = _group_rows([100, 101], [1.0, 1.0])
    ctx = method_lib.StepContext(fresh=fresh, advantages=adv, effective=jnp.zeros(BH, bool),
                                 step=step, rng=jax.random.key(0))
    comp = cfg.compose(ctx, cfg.evict(replay, step), _fake_policy(shifts))
    replay, _ = cfg.after_update(ctx, replay, comp)
    return comp, replay
  return jax.jit(run)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    heads=st.lists(st.sampled_from([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]), min_size=CAP, max_size=CAP,
                   unique=True),
    shifts=st.lists(st.sampled_from([0.0, 0.01, 0.02, 0.05, 0.1]), min_size=CAP, max_size=CAP),
    valid=st.lists(st.booleans(), min_size=CAP, max_size=CAP),
    gate=st.booleans(), order=st.sampled_from(headroom_lib.ORDERS),
    chunks=st.sampled_from([1, 2, 4]))
def test_admission_walk_against_a_python_model(heads, shifts, valid, gate, order, chunks):
  """tau = 1e-3, K_rep = 2, M = 4: candidates are the M live groups of highest cached headroom
  (or the M oldest); admitted in that order while D = shift^2 <= tau (0.0, 0.01, 0.02 pass;
  0.05^2 = 2.5e-3 and 0.1^2 = 1e-2 fail); never a group with D > tau when gated; the cache of
  every live candidate the walk reads is refreshed with its measured D. In ``chunks`` chunks
  of 4 / chunks the walk reads a chunk only while fewer than K_rep have passed before it: the
  same groups are admitted, and the candidates it did not read keep their cached D."""
  cfg = headroom_lib.HeadroomDrift(slots=2, candidates=4, tau=1e-3, gate=gate, order=order,
                                    candidate_chunks=chunks)
  rows, adv = _group_rows(list(range(CAP)), [1.0] * CAP)
  replay = replay_lib.init_replay(CAP, GH, PH, TH)
  replay = replay_lib.insert(replay, rows, adv, jnp.ones(CAP, bool),
                             headroom_M=jnp.asarray(heads))
  replay = replay.replace(valid=jnp.asarray(valid))
  shift_by_id = np.zeros(102)
  shift_by_id[:CAP] = shifts
  comp, new = _compose(cfg)(replay, jnp.asarray(shift_by_id), jnp.int32(1))

  live = [i for i in range(CAP) if valid[i]]
  key = (lambda i: -heads[i]) if order == "headroom" else (lambda i: i)
  candidates = sorted(live, key=key)[:4]
  passes = [i for i in candidates if not gate or shifts[i] ** 2 <= 1e-3]
  admitted = passes[:2]
  n = BH * GH
  got = [int(i) for i, r in zip(np.asarray(comp.rollout.prompt_id[n:]),
                                np.asarray(comp.replayed[n:])) if r]
  assert got == [i for i in admitted for _ in range(GH)]
  if gate:
    assert all(shifts[i] ** 2 <= 1e-3 for i in set(got))
  assert float(comp.metrics["headroom_admitted"]) == len(admitted)
  size = 4 // chunks
  slots_read = [j for j in range(4) if sum(
      1 for i in candidates[:j // size * size] if i in passes) < 2]
  read = [candidates[j] for j in slots_read if j < len(candidates)]
  assert float(comp.metrics["headroom_candidates"]) == len(read)
  for i in candidates:
    want = shifts[i] ** 2 if i in read else float(replay.drift[i])
    assert float(new.drift[i]) == pytest.approx(want, abs=1e-7)
  # Replayed rows' pi_prox is the candidate pass: log mu + shift.
  for row, r in enumerate(np.asarray(comp.replayed[n:])):
    if r:
      i = int(comp.rollout.prompt_id[n + row])
      np.testing.assert_allclose(comp.prox_logp[n + row], -1.0 + shifts[i], rtol=1e-6)


def test_headroom_cache_refresh_and_insertion():
  """The refreshed H of a candidate is its headroom under the pass: rows A = +1 / -1, pi =
  e^(-1 + s); H = mean(1 - pi, pi) = 0.5. New mixed-outcome groups are stored after the
  update with their headroom under pi_gen = e^-1: also 0.5; constant groups are not stored."""
  cfg = headroom_lib.HeadroomDrift(slots=1, candidates=2, tau=1e-3)
  rows, adv = _group_rows([0, 1], [1.0, 1.0])
  replay = replay_lib.init_replay(4, GH, PH, TH)
  replay = replay_lib.insert(replay, rows, adv, jnp.ones(2, bool),
                             headroom_M=jnp.asarray([0.9, 0.8]))
  fresh, fadv = _group_rows([100, 101], [1.0, 1.0])
  ctx = method_lib.StepContext(fresh=fresh, advantages=fadv,
                               effective=jnp.asarray([True, False]), step=jnp.int32(1),
                               rng=jax.random.key(0))
  shifts = np.zeros(102)
  shifts[:2] = [0.3, 0.0]
  comp = cfg.compose(ctx, replay, _fake_policy(shifts))
  new, _ = cfg.after_update(ctx, replay, comp)
  p = np.exp(-0.7)
  np.testing.assert_allclose(new.headroom[0], ((1 - p) + p) / 2, rtol=1e-6)
  # Entry 0 (H 0.9) failed the gate (0.09 > 1e-3); entry 1 passed and was used once.
  np.testing.assert_array_equal(new.use_count[:2], [0, 1])
  assert int(new.num_inserted) == 3 and int(new.rollouts.prompt_id[2, 0]) == 100
  np.testing.assert_allclose(new.headroom[2], 0.5, rtol=1e-6)


def test_the_candidate_pass_counts_the_chunks_the_walk_read():
  """Four candidates (ids 0-3, cached H 0.9 .. 0.6) in two chunks of two; K_rep = 1, every D = 0:
  the first chunk admits id 0, so the walk never reads the second. A fake count of the pass,
  real = sum of (id + 1) over its rows and 10 positions a row: rows of ids 0, 0, 1, 1 give
  2 x 1 + 2 x 2 = 6 over 40, 0.15 (0.25 had the skipped chunk counted: 20 over 80). A plain
  log-prob function (no ``count``) reports nothing."""
  cfg = headroom_lib.HeadroomDrift(slots=1, candidates=4, tau=1e-3, candidate_chunks=2)
  rows, adv = _group_rows([0, 1, 2, 3], [1.0] * 4)
  replay = replay_lib.init_replay(4, GH, PH, TH)
  replay = replay_lib.insert(replay, rows, adv, jnp.ones(4, bool),
                             headroom_M=jnp.asarray([0.9, 0.8, 0.7, 0.6]))
  fresh, fadv = _group_rows([100, 101], [1.0, 1.0])
  ctx = method_lib.StepContext(fresh=fresh, advantages=fadv, effective=jnp.zeros(BH, bool),
                               step=jnp.int32(1), rng=jax.random.key(0))
  logp_fn = _fake_policy(np.zeros(102))
  count = lambda r: (jnp.sum(r.prompt_id + 1).astype(jnp.float32),
                     jnp.float32(10 * r.prompt_id.shape[0]))
  comp = cfg.compose(ctx, replay, method_lib.PolicyPass(logp_fn, count))
  assert float(comp.metrics["headroom_candidates"]) == 2
  assert float(comp.metrics["headroom_candidate_pass_useful_fraction"]) == pytest.approx(0.15)
  plain = cfg.compose(ctx, replay, logp_fn)
  assert "headroom_candidate_pass_useful_fraction" not in plain.metrics


@pytest.mark.parametrize("objective", ["align_mu", "decoupled"])
def test_train_step_loss_with_admitted_groups(split, tiny_qwen3, objective):
  """Both stored groups as if an older policy had sampled them: their log mu (and pi_gen) is
  0.3 below the current policy's, so D = 0.3^2 = 0.09 <= tau = 0.1 and with K_rep = 2 both
  are admitted as 8 extra rows. align_mu: ratio over pi_gen, rho = e^0.3 = 1.35, clipped at
  1.2 where A > 0; decoupled: pi_prox from the candidate pass (rho = 1) with weight pi_prox /
  mu = e^0.3. Each loss equals policy_loss on the 16-row batch composed by hand for its
  objective, and the two differ (the clip), so an objective collapsed onto the other fails;
  one trace over steps."""
  graphdef, params = split
  old = _rollout(split, [1, 0, 0, 1, 0, 1, 0, 0], seed=9, shift=-0.3 * np.ones(B * G))
  rollout = _rollout(split, [1, 0, 0, 1, 0, 1, 0, 0], shift=SHIFT_N)
  replay = replay_lib.init_replay(4, G, P, T)
  old_bg = jax.tree.map(lambda x: x.reshape((B, G) + x.shape[1:]), old)
  stored_adv = jnp.asarray([[0.5, -0.5, 0.25, -0.25], [1.0, -1.0, 0.0, 0.0]])
  replay = replay_lib.insert(replay, old_bg, stored_adv, jnp.ones(B, bool),
                             headroom_M=jnp.asarray([0.3, 0.6]))
  cfg = headroom_lib.HeadroomDrift(slots=2, candidates=2, tau=0.1, objective=objective)
  tx = optax.sgd(0.0)
  fn = traced_step(graphdef, tx, StepConfig(num_minibatches=1, group_size=G, replay=cfg))
  state = step_lib.init_train_state(_copy(params), tx)
  _, new_replay, m = fn(state, replay, rollout, None, jax.random.key(0))
  assert float(m["headroom_admitted"]) == 2.0 and float(m["replay_rows"]) == 8.0
  # Headroom order: entry 1 (H 0.6) first, then entry 0.
  order = jnp.asarray([4, 5, 6, 7, 0, 1, 2, 3])
  cat = lambda a, b: jnp.concatenate([a, b[order]])
  ids = cat(rollout.completion_ids, old.completion_ids)
  prompts = cat(rollout.prompt_ids, old.prompt_ids)
  pmask = cat(rollout.prompt_mask, old.prompt_mask)
  cmask = cat(rollout.completion_mask, old.completion_mask)
  mu = cat(rollout.behaviour_logp, old.behaviour_logp)
  adv = jnp.concatenate([jnp.asarray(MIXED_ADV), stored_adv.reshape(-1)[order]])
  logp = completion_logprobs(tiny_qwen3, prompts, pmask, ids)
  teacher = jnp.concatenate([rollout.behaviour_logp, logp[B * G:]])
  prox = mu if objective == "align_mu" else teacher
  expected, _ = losses.policy_loss(logp, prox, mu, adv, cmask, losses.LossConfig())
  other, _ = losses.policy_loss(logp, teacher if objective == "align_mu" else mu, mu, adv, cmask,
                                losses.LossConfig())
  assert float(m["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
  assert abs(float(other) - float(expected)) > 1e-3  # the objectives differ on this batch
  assert float(m["headroom_admitted_drift"]) == pytest.approx(0.3 ** 2, rel=1e-3)
  # Both fresh groups are mixed-outcome: appended after the update (2 + 2 entries).
  assert int(new_replay.num_inserted) == 4
  fn(state, new_replay, _rollout(split, [1, 1, 0, 0, 1, 0, 0, 0], seed=1), None,
     jax.random.key(1))


def test_config_validation():
  with pytest.raises(ValueError, match="slots"):
    headroom_lib.HeadroomDrift(slots=4, candidates=2)
  with pytest.raises(ValueError, match="order"):
    headroom_lib.HeadroomDrift(order="lifo")
  assert headroom_lib.HeadroomDrift(slots=8).extra_rows(256, 8) == 64


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    steps=st.lists(st.tuples(st.lists(st.booleans(), min_size=BH, max_size=BH),
                             st.lists(st.sampled_from([0.0, 0.02, 0.05]), min_size=BH,
                                      max_size=BH)), min_size=1, max_size=7),
    max_age=st.sampled_from([0, 2]))
def test_no_drifted_or_over_age_group_is_ever_used(steps, max_age):
  """Over random sequences of steps (which fresh groups are mixed, how far each group's
  log-probs later drift): every admitted group has D <= tau, is younger than max_age, was
  stored in an earlier step and was mixed-outcome; the buffer holds exactly the mixed groups."""
  cfg = headroom_lib.HeadroomDrift(slots=2, candidates=3, tau=1e-3, max_age=max_age)
  replay = replay_lib.init_replay(4, GH, PH, TH)
  shift_by_id = np.zeros(100 * (len(steps) + 1))
  mixed_ids, version = set(), {}
  run = _sequence_step(cfg)
  for step, (effective, shifts) in enumerate(steps):
    ids = [100 * (step + 1) + j for j in range(BH)]
    shift_by_id[ids] = shifts
    comp, replay = run(replay, jnp.asarray(ids), jnp.asarray(effective),
                       jnp.asarray(shift_by_id), jnp.int32(step))
    n = BH * GH
    used = {int(i) for i, r in zip(np.asarray(comp.rollout.prompt_id[n:]),
                                   np.asarray(comp.replayed[n:])) if r}
    for i in used:
      assert shift_by_id[i] ** 2 <= 1e-3 and i in mixed_ids and version[i] < step
      assert not max_age or step - version[i] <= max_age
    for i, e in zip(ids, effective):
      if e:
        mixed_ids.add(i)
        version[i] = step
  # The buffer holds exactly what the ring and the age limit leave of the mixed groups: the
  # last 4 inserted, less those the last step's eviction found older than max_age (those of
  # the last step itself were inserted after it).
  inserted = [i for step, (effective, _) in enumerate(steps)
              for i, e in zip([100 * (step + 1) + j for j in range(BH)], effective) if e]
  last = len(steps) - 1
  expected = {i for i in inserted[-4:] if not max_age or last - version[i] <= max_age}
  stored = {int(i) for i, v in zip(replay.rollouts.prompt_id[:, 0], replay.valid) if v}
  assert stored == expected


@functools.lru_cache(maxsize=None)
def _sequence_step(cfg):
  def run(replay, ids, effective, shifts, step):
    fresh, adv = _group_rows(ids, jnp.ones(BH))
    fresh = fresh.replace(version=jnp.full_like(fresh.version, step))  # drawn at this step
    ctx = method_lib.StepContext(fresh=fresh, advantages=adv, effective=effective,
                                 step=step, rng=jax.random.key(0))
    replay = cfg.evict(replay, step)
    comp = cfg.compose(ctx, replay, _fake_policy(shifts))
    replay, _ = cfg.after_update(ctx, replay, comp)
    return comp, replay
  return jax.jit(run)
