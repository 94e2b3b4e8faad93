"""Replay-buffer invariants at scale: 1,024 random operation sequences for the raw buffer and
for every replay method (POPO, rollout-level replay, Headroom-Drift), each config in one jitted
function (``vmap`` over sequences of a ``lax.scan`` over steps), checked against a shadow record
of what was inserted, used and evicted.

Every entry carries an identity (its prompt id: a number never used twice in a sequence), so
the shadow, indexed by identity, knows each entry's insertion number, version, use count, frozen
advantage and whether eviction has dropped it. After every operation the checks are:

* selection: every entry returned or replayed is live (inserted, not overwritten by the ring,
  not evicted), within its age and use limits, from an earlier step, at most once per batch;
  as many are returned as the method's rule says (e.g. min(k, live entries));
* counters: ``num_inserted`` and ``write_pos`` match the shadow; each valid slot holds the
  entry the ring put there, with that entry's insertion number, version, use count, advantages
  (and drift); the valid slots are exactly the live, non-evicted entries.

The small hypothesis tests of each method (tests/rl/test_replay.py, test_popo.py,
test_prioritized_replay.py, test_headroom.py) compare against Python models in the default run;
this file is marked slow (``-m "not slow"`` leaves it out; the README's command runs it).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.rl import replay as replay_lib
from grpo_jax.rl.replay import headroom, popo, prioritized
from grpo_jax.rl.replay import method as method_lib
from grpo_jax.types import Rollout

SEQUENCES = 1024  # random operation sequences per config
STEPS = 12  # operations (train steps) per sequence
B, G, P, T = 4, 2, 2, 2  # groups, rollouts per group, prompt and completion tokens
C = 5  # capacity (entries) of the group buffers; ring overwrites happen within 2-3 steps

VIOLATIONS = ("ring_counters", "valid_not_live", "valid_count", "over_capacity", "slot",
              "inserted_counter", "version", "use_count", "advantage", "drift", "rows_mixed",
              "selected_not_live", "selected_over_age", "selected_over_uses",
              "selected_same_step", "selected_twice", "selected_count", "selected_order",
              "replaced_effective_slot", "fresh_slot_changed", "replayed_advantage",
              "admitted_over_drift")
COVERAGE = ("selected", "ring_overwritten", "evicted_live")


def _zeros(names):
  return {name: jnp.zeros((), jnp.int32) for name in names}


def _count(x):
  return jnp.sum(jnp.asarray(x).astype(jnp.int32))


# ---------------------------------------------------------------------------
# The shadow record, indexed by identity.


def _shadow(num_ids):
  return dict(index=jnp.full((num_ids,), -1, jnp.int32),  # insertion number, -1: never
              version=jnp.zeros((num_ids,), jnp.int32), uses=jnp.zeros((num_ids,), jnp.int32),
              drift=jnp.zeros((num_ids,), jnp.float32),
              evicted=jnp.zeros((num_ids,), bool), total=jnp.zeros((), jnp.int32))


def _alive(sh, capacity):
  """Inserted and not yet overwritten: the ring keeps the last ``capacity`` insertions."""
  return (sh["index"] >= 0) & (sh["index"] >= sh["total"] - capacity)


def _live(sh, capacity):
  return _alive(sh, capacity) & ~sh["evicted"]


def _shadow_evict(sh, step, capacity, max_age, max_uses):
  over = jnp.zeros_like(sh["evicted"])
  if max_age:
    over |= step - sh["version"] > max_age
  if max_uses:
    over |= sh["uses"] >= max_uses
  return {**sh, "evicted": sh["evicted"] | (_alive(sh, capacity) & over)}


def _shadow_insert(sh, ids_M, keep_M, step):
  num_ids = sh["index"].shape[0]
  rank = jnp.cumsum(keep_M.astype(jnp.int32)) - 1
  at = jnp.where(keep_M, ids_M, num_ids)  # num_ids: out of range, dropped
  return {**sh, "index": sh["index"].at[at].set(sh["total"] + rank, mode="drop"),
          "version": sh["version"].at[at].set(step, mode="drop"),
          "total": sh["total"] + _count(keep_M)}


def _shadow_use(sh, ids_K, used_K, drift_K=None):
  num_ids = sh["index"].shape[0]
  at = jnp.where(used_K, ids_K, num_ids)
  out = {**sh, "uses": sh["uses"].at[at].add(1, mode="drop")}
  if drift_K is not None:
    out["drift"] = out["drift"].at[at].set(drift_K, mode="drop")
  return out


# ---------------------------------------------------------------------------
# The checks.


def _buffer_violations(replay, sh, adv_by_id, check_drift=False):
  """Every counter of the buffer against the shadow (see the module docstring)."""
  c = replay.capacity
  num_ids = sh["index"].shape[0]
  ids_CxE = replay.rollouts.prompt_id
  ids = jnp.clip(ids_CxE[:, 0], 0, num_ids - 1)
  valid = replay.valid
  live = _live(sh, c)
  v = _zeros(VIOLATIONS)
  v["ring_counters"] = _count((replay.num_inserted != sh["total"]) |
                              (replay.write_pos != sh["total"] % c))
  v["valid_not_live"] = _count(valid & ~live[ids])
  v["valid_count"] = _count(_count(valid) != _count(live))
  v["over_capacity"] = _count(_count(valid) > jnp.minimum(c, sh["total"]))
  v["slot"] = _count(valid & (jnp.arange(c) != sh["index"][ids] % c))
  v["inserted_counter"] = _count(valid & (replay.inserted != sh["index"][ids]))
  v["version"] = _count(valid & (replay.version != sh["version"][ids]))
  v["use_count"] = _count(valid & (replay.use_count != sh["uses"][ids]))
  v["advantage"] = _count(valid & jnp.any(replay.advantages != adv_by_id[ids], axis=1))
  v["rows_mixed"] = _count(valid & jnp.any(ids_CxE != ids_CxE[:, :1], axis=1))
  if check_drift:
    v["drift"] = _count(valid & (jnp.abs(replay.drift - sh["drift"][ids]) > 1e-6))
  return v


def _selection_violations(ids_K, used_K, sh, step, capacity, max_age, max_uses, first_new_id):
  """Entries returned by a selection (``used_K``), judged on the shadow after this step's
  eviction and before their use is counted."""
  num_ids = sh["index"].shape[0]
  ids = jnp.clip(ids_K, 0, num_ids - 1)
  v = _zeros(VIOLATIONS)
  v["selected_not_live"] = _count(used_K & ~_live(sh, capacity)[ids])
  if max_age:
    v["selected_over_age"] = _count(used_K & (step - sh["version"][ids] > max_age))
  if max_uses:
    v["selected_over_uses"] = _count(used_K & (sh["uses"][ids] >= max_uses))
  v["selected_same_step"] = _count(used_K & (ids_K >= first_new_id))
  same = (ids_K[:, None] == ids_K[None, :]) & used_K[:, None] & used_K[None, :]
  v["selected_twice"] = _count(jnp.triu(same, k=1))
  return v


def _coverage(sh, capacity, selected):
  return {"selected": _count(selected), "ring_overwritten": _count(sh["total"] > capacity),
          "evicted_live": _count(_alive(sh, capacity) & sh["evicted"])}


def _add(total, part):
  return {k: total[k] + part.get(k, 0) for k in total}


def _run(body, init, num_ids, sequences=SEQUENCES):
  """``sequences`` sequences of ``STEPS`` steps of ``body``; summed violations and coverage."""

  def sequence(key):
    k_init, k_steps = jax.random.split(key)
    carry = (init(k_init), _shadow(num_ids), _zeros(VIOLATIONS), _zeros(COVERAGE))
    xs = (jnp.arange(STEPS, dtype=jnp.int32), jax.random.split(k_steps, STEPS))
    (_, _, viol, cov), _ = jax.lax.scan(body, carry, xs)
    return viol, cov

  keys = jax.random.split(jax.random.key(20260611), sequences)
  viol, cov = jax.jit(jax.vmap(sequence))(keys)
  return ({k: int(np.sum(x)) for k, x in viol.items()},
          {k: int(np.sum(x)) for k, x in cov.items()})


def _group_rows(ids_K, step, lead):
  """A Rollout [K, lead, ...] whose prompt id is ``ids_K`` in every row (their identity)."""
  k = ids_K.shape[0]
  shape = lambda *s: (k, lead) + s
  ids = jnp.broadcast_to(ids_K[:, None], shape())
  return Rollout(
      prompt_ids=jnp.zeros(shape(P), jnp.int32), prompt_mask=jnp.ones(shape(P), bool),
      completion_ids=jnp.zeros(shape(T), jnp.int32),
      completion_mask=jnp.ones(shape(T), bool),
      behaviour_logp=jnp.full(shape(T), -1.0), scores=jnp.zeros(shape()),
      truncated=jnp.zeros(shape(), bool),
      success=jnp.zeros(shape(), bool), prompt_id=ids.astype(jnp.int32),
      version=jnp.full(shape(T), step, jnp.int32))


# ---------------------------------------------------------------------------
# The raw buffer: random operations (insert, advance and evict, select and use).

RAW_M, RAW_K, RAW_AGE, RAW_USES = 4, 3, 3, 2  # candidates, selected, limits


def _raw_config():
  num_ids = STEPS * RAW_M

  def init(key):
    return dict(replay=replay_lib.init_replay(C, G, P, T), step=jnp.zeros((), jnp.int32),
                adv=jax.random.normal(key, (num_ids, G)))

  def body(carry, xs):
    state, sh, viol, cov = carry
    i, key = xs
    replay, step, adv_by_id = state["replay"], state["step"], state["adv"]
    k_op, k_keep, k_adv, k_prio, k_score, k_drift = jax.random.split(key, 6)

    def insert(_):
      ids = i * RAW_M + jnp.arange(RAW_M, dtype=jnp.int32)
      keep = jax.random.bernoulli(k_keep, 0.6, (RAW_M,))
      out = replay_lib.insert(replay, _group_rows(ids, step, G), adv_by_id[ids], keep)
      return out, step + 1, _shadow_insert(sh, ids, keep, step), _zeros(VIOLATIONS), jnp.zeros((), jnp.int32)

    def evict(_):
      now = step + jax.random.randint(k_adv, (), 0, 3)
      out = replay_lib.evict(replay, now, max_age=RAW_AGE, max_uses=RAW_USES)
      return out, now, _shadow_evict(sh, now, C, RAW_AGE, RAW_USES), _zeros(VIOLATIONS), jnp.zeros((), jnp.int32)

    def select(_):
      # As the train step: evict at the current step, then select, then count the use.
      out = replay_lib.evict(replay, step, max_age=RAW_AGE, max_uses=RAW_USES)
      after = _shadow_evict(sh, step, C, RAW_AGE, RAW_USES)
      score_C = jax.random.uniform(k_score, (C,), minval=0.1, maxval=1.0)
      pick = lambda name: (lambda r: replay_lib.select(r, RAW_K, name, step=step, staleness=1,
                                                        score_C=score_C, rng=k_score))
      prio = jax.random.randint(k_prio, (), 0, len(replay_lib.PRIORITIES))
      idx, ok = jax.lax.switch(prio, [pick(name) for name in replay_lib.PRIORITIES], out)
      ids = jnp.where(ok, out.rollouts.prompt_id[idx, 0], -1)
      v = _selection_violations(ids, ok, after, step, C, RAW_AGE, RAW_USES, i * RAW_M)
      live = _live(after, C)
      # Every priority returns min(k, live entries): proportional scores are all positive.
      v["selected_count"] = _count(_count(ok) != jnp.minimum(RAW_K, _count(live)))
      # Recency: nothing live and left out is newer than what was returned; lowest KL:
      # no live slot left out has a lower score than a chosen one.
      index = after["index"]
      chosen = jnp.zeros_like(live).at[jnp.where(ok, ids, live.shape[0])].set(True, mode="drop")
      left = live & ~chosen
      min_of = lambda x, m: jnp.min(jnp.where(m, x, jnp.iinfo(jnp.int32).max))
      newest_left = jnp.max(jnp.where(left, index, -1))
      chosen_C = jnp.zeros((C,), bool).at[jnp.where(ok, idx, C)].set(True, mode="drop")
      left_C = out.valid & ~chosen_C
      highest_chosen = jnp.max(jnp.where(chosen_C, score_C, -jnp.inf))
      lowest_left = jnp.min(jnp.where(left_C, score_C, jnp.inf))
      name = jnp.asarray([replay_lib.PRIORITIES.index(p) for p in ("recency", "lowest_kl")])
      v["selected_order"] = _count(
          ((prio == name[0]) & (newest_left > min_of(index, chosen)) & jnp.any(chosen)) |
          ((prio == name[1]) & (lowest_left < highest_chosen)))
      drift_K = jax.random.uniform(k_drift, (RAW_K,))
      out = replay_lib.mark_used(out, idx, ok, drift_K)
      return out, step, _shadow_use(after, jnp.maximum(ids, 0), ok, drift_K), v, _count(ok)

    op = jax.random.randint(k_op, (), 0, 3)
    replay, step, sh, v, selected = jax.lax.switch(op, [insert, evict, select], None)
    v = _add(v, _buffer_violations(replay, sh, adv_by_id, check_drift=True))
    cov = _add(cov, {**_coverage(sh, C, 0), "selected": selected})
    return ({**state, "replay": replay, "step": step}, sh, _add(viol, v), cov), None

  return body, init, num_ids


# ---------------------------------------------------------------------------
# The replay methods: random train steps (which groups are effective, advantages, drift).


def _method_config(cfg, capacity, entry):
  """One train step's replay part per scan step, as step.py runs it: evict, compose, update."""
  per_step = B if entry == "group" else B * G
  num_ids = STEPS * per_step
  max_age = getattr(cfg, "max_age", 0) or getattr(cfg, "tau_max", 0)
  max_uses = getattr(cfg, "max_uses", 0)
  e = G if entry == "group" else 1

  def init(key):
    k_adv, k_shift = jax.random.split(key)
    # Advantages by identity (some zero, for rollout replay's "nonzero" insertion) and each
    # group's drift under the later policy: D = shift^2 against tau = 1e-3 passes for 0 and
    # 0.02 (4e-4) and fails for 0.05 (2.5e-3).
    adv = jax.random.choice(k_adv, jnp.asarray([0.0, 0.5, -1.0, 2.0]), (num_ids, e))
    shift = jax.random.choice(k_shift, jnp.asarray([0.0, 0.02, 0.05]), (num_ids,))
    return dict(replay=replay_lib.init_replay(capacity, e, P, T), adv=adv, shift=shift)

  def body(carry, xs):
    state, sh, viol, cov = carry
    step, key = xs
    replay, adv_by_id, shift = state["replay"], state["adv"], state["shift"]
    k_eff, k_rng = jax.random.split(key)
    first = step * per_step
    ids = first + jnp.arange(per_step, dtype=jnp.int32)
    effective_B = jax.random.bernoulli(k_eff, 0.5, (B,))
    if entry == "group":
      fresh, adv_BxG = _group_rows(ids, step, G), adv_by_id[ids]
    else:
      fresh = jax.tree.map(lambda x: x.reshape((B, G) + x.shape[2:]), _group_rows(ids, step, 1))
      adv_BxG = adv_by_id[ids, 0].reshape(B, G)
    ctx = method_lib.StepContext(fresh=fresh, advantages=adv_BxG, effective=effective_B,
                                 step=step, rng=k_rng)
    logp_fn = lambda rows: rows.behaviour_logp + shift[rows.prompt_id][:, None]
    evicted = cfg.evict(replay, step)
    sh = _shadow_evict(sh, step, capacity, max_age, max_uses)
    comp = cfg.compose(ctx, evicted, logp_fn)
    replay, _ = cfg.after_update(ctx, evicted, comp)
    live = _live(sh, capacity)
    n = B * G
    v = _zeros(VIOLATIONS)
    if isinstance(cfg, popo.Popo):
      replayed_B = comp.replayed.reshape(B, G)[:, 0]
      rep_ids = comp.rollout.prompt_id.reshape(B, G)[:, 0]
      v = _selection_violations(rep_ids, replayed_B, sh, step, capacity, max_age, max_uses,
                                first)
      slots = cfg.slots or B
      v["selected_count"] = _count(_count(replayed_B) != jnp.minimum(
          jnp.minimum(_count(~effective_B), _count(live)), slots))
      v["replaced_effective_slot"] = _count(replayed_B & effective_B)
      v["fresh_slot_changed"] = _count(~replayed_B & (rep_ids != ids))
      stored = adv_by_id[jnp.clip(rep_ids, 0, num_ids - 1)]
      v["replayed_advantage"] = _count(
          replayed_B[:, None] & (comp.advantages.reshape(B, G) != stored))
      if cfg.priority == "recency":
        chosen = jnp.zeros_like(live).at[jnp.where(replayed_B, rep_ids, num_ids)].set(
            True, mode="drop")
        newest_left = jnp.max(jnp.where(live & ~chosen, sh["index"], -1))
        oldest_chosen = jnp.min(jnp.where(chosen, sh["index"], jnp.iinfo(jnp.int32).max))
        v["selected_order"] = _count(jnp.any(chosen) & (newest_left > oldest_chosen))
      used_ids, used = rep_ids, replayed_B
      keep = effective_B if cfg.insert == "effective" else jnp.ones((B,), bool)
    elif isinstance(cfg, prioritized.PrioritizedReplay):
      used = comp.replayed[n:]
      used_ids = comp.rollout.prompt_id[n:]
      v = _selection_violations(used_ids, used, sh, step, capacity, max_age, max_uses, first)
      r = used.shape[0]
      expected = jnp.where(step >= cfg.warmup_steps, jnp.minimum(r, _count(live)), 0)
      v["selected_count"] = _count(_count(used) != expected)
      v["replayed_advantage"] = _count(
          used & (comp.advantages[n:] != adv_by_id[jnp.clip(used_ids, 0, num_ids - 1), 0]))
      adv_N = adv_by_id[ids, 0]
      keep = jnp.abs(adv_N) > 0 if cfg.insert == "nonzero" else jnp.ones((n,), bool)
    else:  # Headroom-Drift
      k = cfg.slots
      used = comp.replayed[n:].reshape(k, G)[:, 0]
      used_ids = comp.rollout.prompt_id[n:].reshape(k, G)[:, 0]
      v = _selection_violations(used_ids, used, sh, step, capacity, max_age, max_uses, first)
      passing = live & (jnp.square(shift) <= cfg.tau) if cfg.gate else live
      # Candidates are every live group (candidates == capacity): min(K, passing) admitted.
      v["selected_count"] = _count(_count(used) != jnp.minimum(k, _count(passing)))
      drift = jnp.square(shift[jnp.clip(used_ids, 0, num_ids - 1)])
      if cfg.gate:
        v["admitted_over_drift"] = _count(used & (drift > cfg.tau))
      # The pass refreshed every candidate's cached drift: D = shift^2.
      sh = {**sh, "drift": jnp.where(live, jnp.square(shift), sh["drift"])}
      keep = effective_B
    sh = _shadow_use(sh, jnp.maximum(used_ids, 0), used)
    sh = _shadow_insert(sh, ids, keep, step)
    v = _add(v, _buffer_violations(replay, sh, adv_by_id,
                                   check_drift=isinstance(cfg, headroom.HeadroomDrift)))
    cov = _add(cov, _coverage(sh, capacity, used))
    return ({**state, "replay": replay}, sh, _add(viol, v), cov), None

  return body, init, num_ids


CONFIGS = {
    "buffer": lambda: _raw_config(),
    "popo": lambda: _method_config(
        popo.Popo(fill="replay", max_age=2, max_uses=1), C, "group"),
    "popo_stale_all_slots2": lambda: _method_config(
        popo.Popo(fill="replay", insert="all", priority="staleness", staleness=1,
                        max_age=3, slots=2), 20, "group"),
    "rollout": lambda: _method_config(
        prioritized.PrioritizedReplay(tau_max=2, rho=0.5, warmup_steps=2), 20, "rollout"),
    "rollout_all_once": lambda: _method_config(
        prioritized.PrioritizedReplay(tau_max=3, rho=0.25, warmup_steps=0, insert="all",
                                    max_uses=1), 20, "rollout"),
    "headroom": lambda: _method_config(
        headroom.HeadroomDrift(slots=2, candidates=C, tau=1e-3, max_age=2), C, "group"),
    "headroom_fifo_ungated": lambda: _method_config(
        headroom.HeadroomDrift(slots=2, candidates=C, tau=1e-3, gate=False, order="fifo",
                                max_age=3), C, "group"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_invariants_hold_over_random_sequences(name):
  violations, coverage = _run(*CONFIGS[name]())
  assert violations == dict.fromkeys(VIOLATIONS, 0)
  # The sequences did exercise what is checked: replays, ring overwrites and evictions.
  assert all(coverage[k] > 0 for k in COVERAGE), coverage


@functools.lru_cache(maxsize=None)
def _checked_popo_step():
  body, init, num_ids = _method_config(popo.Popo(fill="replay", max_uses=1), C, "group")
  return jax.jit(body), init, num_ids


def test_the_checks_catch_a_broken_buffer():
  """The checks can fail: one honest step, then the same step on a buffer whose use count, or
  valid flag, or write position was tampered with, is reported."""
  body, init, num_ids = _checked_popo_step()
  state = init(jax.random.key(0))
  carry = (state, _shadow(num_ids), _zeros(VIOLATIONS), _zeros(COVERAGE))
  for step in range(3):  # three honest steps: something is stored
    carry, _ = body(carry, (jnp.int32(step), jax.random.key(step)))
  assert all(int(x) == 0 for x in carry[2].values())
  replay = carry[0]["replay"]
  assert int(replay.valid.sum()) > 0
  slot = int(jnp.argmax(replay.valid))
  tampered = {
      "use_count": replay.replace(use_count=replay.use_count.at[slot].add(1)),
      "valid_count": replay.replace(valid=replay.valid.at[slot].set(False)),
      "ring_counters": replay.replace(write_pos=(replay.write_pos + 1) % C),
  }
  for name, broken in tampered.items():
    v = _buffer_violations(broken, carry[1], carry[0]["adv"])
    assert int(v[name]) > 0, name
