"""The on-device replay ring buffer (state and creation).

A ``ReplayState`` holds C entries of E rollouts each (E = G for whole-group replay as in POPO,
arXiv 2606.01281; E = 1 for rollout-level replay as in Yoo et al., arXiv 2606.04560), in
fixed-shape arrays that live on the device and are donated through the jitted train step, so
eviction and gating compile into the step. Capacity 0 is plain GRPO: every array has a zero
leading dimension and the step compiles the buffer away.

Operations (pure, jittable, no shape depends on how many entries are kept or live):

* ``insert``: write the entries selected by a boolean mask over a fixed-size candidate batch
  into the ring, oldest overwritten first;
* ``evict``: invalidate by age (step - version > max_age), use count, or a gate mask;
* ``select``: k (static) entries by a named priority, with a validity mask when fewer exist;
* ``gather``: selected entries in the layout of fresh rollouts.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from grpo_jax.types import Rollout

PRIORITIES = ("recency", "staleness", "lowest_kl", "proportional")


@flax.struct.dataclass
class ReplayState:
  """C entries of E rollouts.

  Attributes:
    rollouts: a Rollout whose arrays have shape [C, E, ...] (tokens, masks, behaviour log-probs,
      scores, success, prompt ids, per-token versions of each rollout).
    advantages: float32 [C, E] advantages frozen at insertion.
    gen_logp: float32 [C, E, T] the trainer's log-probs of the entry's tokens at the start of the step that
      generated it (pi_gen as the train step computes it). Equal to the sampler's log mu
      (``rollouts.behaviour_logp``) when the two share numerics (float32, ``prox_pass`` =
      "replayed"); under bfloat16 (``prox_pass`` = "all") they differ by the sampler/trainer
      mismatch, and ratios and drift use this one while the behaviour weight keeps mu.
    version: int32 [C] the entry's version: its oldest token's (``Rollout.row_version``, the
      least over its real rows); ages and staleness are counted from it.
    inserted: int32 [C] value of ``num_inserted`` when the entry was written (insertion order).
    use_count: int32 [C] how many times the entry has been replayed.
    drift: float32 [C] last measured drift (mean squared log-ratio to the behaviour policy).
    headroom: float32 [C] last measured headroom (Headroom-Drift replay, arXiv 2609.03941).
    valid: bool [C], the slot holds a live entry.
    write_pos: int32 scalar, the next slot to write (oldest first).
    num_inserted: int32 scalar, entries inserted so far.
  """

  rollouts: Rollout
  advantages: jax.Array
  gen_logp: jax.Array
  version: jax.Array
  inserted: jax.Array
  use_count: jax.Array
  drift: jax.Array
  headroom: jax.Array
  valid: jax.Array
  write_pos: jax.Array
  num_inserted: jax.Array

  @property
  def capacity(self) -> int:
    return self.valid.shape[0]

  @property
  def nbytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def init_replay(capacity: int, entry_size: int, prompt_len: int,
                completion_len: int) -> ReplayState:
  """An empty buffer of ``capacity`` entries of ``entry_size`` rollouts (memory fixed here)."""
  c, e, p, t = capacity, entry_size, prompt_len, completion_len
  rollouts = Rollout(
      prompt_ids=jnp.zeros((c, e, p), jnp.int32),
      prompt_mask=jnp.zeros((c, e, p), bool),
      completion_ids=jnp.zeros((c, e, t), jnp.int32),
      completion_mask=jnp.zeros((c, e, t), bool),
      behaviour_logp=jnp.zeros((c, e, t), jnp.float32),
      scores=jnp.zeros((c, e), jnp.float32),
      truncated=jnp.zeros((c, e), bool),
      success=jnp.zeros((c, e), bool),
      prompt_id=jnp.zeros((c, e), jnp.int32),
      version=jnp.zeros((c, e, t), jnp.int32))
  return ReplayState(rollouts=rollouts, advantages=jnp.zeros((c, e), jnp.float32),
                     gen_logp=jnp.zeros((c, e, t), jnp.float32),
                     version=jnp.zeros((c,), jnp.int32), inserted=jnp.zeros((c,), jnp.int32),
                     use_count=jnp.zeros((c,), jnp.int32), drift=jnp.zeros((c,), jnp.float32),
                     headroom=jnp.zeros((c,), jnp.float32), valid=jnp.zeros((c,), bool),
                     write_pos=jnp.zeros((), jnp.int32), num_inserted=jnp.zeros((), jnp.int32))


def entry_version(entries: Rollout) -> jax.Array:
  """int32 [M] version of each of M entries ([M, E] rows): its oldest real row's
  (``Rollout.row_version``); an entry with no real row takes its first row's."""
  real_MxE = jnp.any(entries.completion_mask, axis=-1)
  big = jnp.iinfo(jnp.int32).max
  oldest = jnp.min(jnp.where(real_MxE, entries.row_version, big), axis=-1)
  return jnp.where(jnp.any(real_MxE, axis=-1), oldest, entries.row_version[:, 0])


def insert(replay: ReplayState, entries: Rollout, advantages_MxE: jax.Array, keep_M: jax.Array,
           headroom_M: jax.Array | None = None,
           gen_logp_MxExT: jax.Array | None = None) -> ReplayState:
  """Writes the kept candidates into the ring in candidate order.

  The entries keep the per-token versions they come with (a continued row's tokens span
  several); the entry's ``version``, from which ages and age eviction count, is its oldest
  token's (``entry_version``): for a synchronous step's rows, the step that drew them.

  Args:
    replay: the buffer (C entries of E rollouts).
    entries: M candidate entries, a Rollout of arrays [M, E, ...].
    advantages_MxE: their advantages, frozen from now on.
    keep_M: which candidates to insert (any number, including none or more than C).
    headroom_M: optional initial cached headroom of each candidate (default 0).
    gen_logp_MxExT: optional trainer log-probs at generation (default: the entries' log mu).

  Returns:
    The buffer with the k kept candidates written at write_pos, write_pos + 1, ... (mod C).
    When k > C only the last C survive, exactly as if they were written one by one.
  """
  c = replay.capacity
  if c == 0:
    return replay
  keep = keep_M.astype(bool)
  rank_M = jnp.cumsum(keep.astype(jnp.int32)) - 1
  k = jnp.sum(keep.astype(jnp.int32))
  # Entries that a later candidate of the same batch would overwrite are dropped up front, so
  # the scatter below never writes one slot twice.
  write = keep & (rank_M >= k - c)
  slot_M = jnp.where(write, (replay.write_pos + rank_M) % c, c)  # c = out of range: dropped

  def put(buffer, values):
    return buffer.at[slot_M].set(values.astype(buffer.dtype), mode="drop")

  m = keep.shape[0]
  return ReplayState(
      rollouts=jax.tree.map(put, replay.rollouts, entries),
      advantages=put(replay.advantages, advantages_MxE),
      gen_logp=put(replay.gen_logp, entries.behaviour_logp
                         if gen_logp_MxExT is None else gen_logp_MxExT),
      version=put(replay.version, entry_version(entries)),
      inserted=put(replay.inserted, replay.num_inserted + rank_M),
      use_count=put(replay.use_count, jnp.zeros((m,), jnp.int32)),
      drift=put(replay.drift, jnp.zeros((m,), jnp.float32)),
      headroom=put(replay.headroom, jnp.zeros((m,), jnp.float32) if headroom_M is None
                     else headroom_M),
      valid=put(replay.valid, jnp.ones((m,), bool)),
      write_pos=(replay.write_pos + k) % c,
      num_inserted=replay.num_inserted + k)


def evict(replay: ReplayState, step: jax.Array, *, max_age: int | None = None,
          max_uses: int | None = None, gate_C: jax.Array | None = None) -> ReplayState:
  """Invalidates entries older than ``max_age`` steps, used ``max_uses`` times, or gated.

  Age is ``step - version`` (gradient steps since the entry's behaviour policy, as in the age
  eviction of Yoo et al., arXiv 2606.04560); an entry with age == max_age stays.
  """
  valid = replay.valid
  if max_age is not None:
    valid = valid & (step - replay.version <= max_age)
  if max_uses is not None:
    valid = valid & (replay.use_count < max_uses)
  if gate_C is not None:
    valid = valid & ~gate_C.astype(bool)
  return replay.replace(valid=valid)


def select(replay: ReplayState, k: int, priority: str, *, step: jax.Array | None = None,
           staleness: int = 0, score_C: jax.Array | None = None,
           rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Chooses up to k live entries by a named priority.

  Priorities:
    recency: most recently inserted first (POPO, arXiv 2606.01281).
    staleness: the entries whose version is closest to ``step - staleness``, most recent first
      among ties (the POPO-stale(s) ablation).
    lowest_kl: smallest ``score_C`` first, a per-entry divergence measured this step (POPO-KL:
      the KL(mu || pi_theta) estimate of ``popo.stored_kl``).
    proportional: sampled without replacement with probability proportional to ``score_C``
      (Gumbel top-k; e.g. |A|^alpha of rollout-level prioritised replay).

  Args:
    replay: the buffer.
    k: static number of entries wanted.
    priority: one of PRIORITIES.
    step, staleness: for "staleness".
    score_C: non-negative scores for "proportional"; the divergences for "lowest_kl".
    rng: key for "proportional".

  Returns:
    (indices int32 [k], valid bool [k]); valid is False past the number of live entries (and
    for zero-score entries under "proportional"), where the index is arbitrary.
  """
  if priority not in PRIORITIES:
    raise ValueError(f"unknown replay priority {priority!r}; known: {', '.join(PRIORITIES)}")
  c = replay.capacity
  if c == 0 or k == 0:
    return jnp.zeros((k,), jnp.int32), jnp.zeros((k,), bool)
  if priority in ("recency", "staleness"):
    # Integer keys: ties in distance are broken by insertion order exactly. The insertion rank
    # within the buffer (0..C-1) keeps the combined key far from int32 overflow.
    rank_C = jnp.argsort(jnp.argsort(replay.inserted)).astype(jnp.int32)
    key = rank_C
    if priority == "staleness":
      distance = jnp.abs(replay.version - (step - staleness)).astype(jnp.int32)
      key = rank_C - distance * c
    live = replay.valid
    key = jnp.where(live, key, jnp.iinfo(jnp.int32).min)
    valid_key = lambda top: top > jnp.iinfo(jnp.int32).min
  else:
    if priority == "lowest_kl":
      key = -score_C.astype(jnp.float32)
    else:
      logits = jnp.log(jnp.maximum(score_C.astype(jnp.float32), 0.0))
      key = jnp.where(jnp.isfinite(logits), logits + jax.random.gumbel(rng, (c,)), -jnp.inf)
    live = replay.valid & jnp.isfinite(key)
    key = jnp.where(live, key, -jnp.inf)
    valid_key = jnp.isfinite
  width = min(k, c)
  top_key, idx = jax.lax.top_k(key, width)
  ok = valid_key(top_key) & live[idx]
  if width < k:
    idx = jnp.concatenate([idx, jnp.zeros((k - width,), idx.dtype)])
    ok = jnp.concatenate([ok, jnp.zeros((k - width,), bool)])
  return idx.astype(jnp.int32), ok


def gather(replay: ReplayState, indices_K: jax.Array) -> tuple[Rollout, jax.Array, jax.Array]:
  """The selected entries as (Rollout [K * E rows], advantages [K * E], trainer log-probs at
  generation [K * E, T]), fresh-batch layout."""
  flat = lambda x: x[indices_K].reshape((-1,) + x.shape[2:])
  return (jax.tree.map(flat, replay.rollouts), flat(replay.advantages),
          flat(replay.gen_logp))


def mark_used(replay: ReplayState, indices_K: jax.Array, valid_K: jax.Array,
              drift_K: jax.Array | None = None) -> ReplayState:
  """Increments the use count of the valid selected entries (and records their drift)."""
  if replay.capacity == 0:
    return replay
  slot = jnp.where(valid_K, indices_K, replay.capacity)
  out = replay.replace(use_count=replay.use_count.at[slot].add(1, mode="drop"))
  if drift_K is not None:
    out = out.replace(drift=out.drift.at[slot].set(drift_K, mode="drop"))
  return out
