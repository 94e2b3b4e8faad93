"""The on-device replay ring buffer (state and creation).

A ``ReplayState`` holds C entries of E rollouts each (E = G for whole-group replay as in POPO,
arXiv 2606.01281; E = 1 for rollout-level replay as in Yoo et al., arXiv 2606.04560), in
fixed-shape arrays that live on the device and are donated through the jitted train step, so
eviction and gating compile into the step. Capacity 0 is plain GRPO: every array has a zero
leading dimension and the step compiles the buffer away.

Insert / evict / select / gather arrive with the replay methods; this module fixes the layout.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from grpo_jax.types import Rollout


@flax.struct.dataclass
class ReplayState:
  """C entries of E rollouts.

  Attributes:
    rollouts: a Rollout whose arrays have shape [C, E, ...] (tokens, masks, behaviour log-probs,
      scores, success, prompt ids, version stamps of each rollout).
    advantages_CxE: advantages frozen at insertion.
    version_C: policy step that generated the entry.
    inserted_C: value of ``num_inserted`` when the entry was written (insertion order).
    use_count_C: how many times the entry has been replayed.
    drift_C: last measured drift (mean squared log-ratio to the behaviour policy).
    valid_C: the slot holds a live entry.
    write_pos: int32 scalar, the next slot to write (oldest first).
    num_inserted: int32 scalar, entries inserted so far.
  """

  rollouts: Rollout
  advantages_CxE: jax.Array
  version_C: jax.Array
  inserted_C: jax.Array
  use_count_C: jax.Array
  drift_C: jax.Array
  valid_C: jax.Array
  write_pos: jax.Array
  num_inserted: jax.Array

  @property
  def capacity(self) -> int:
    return self.valid_C.shape[0]

  @property
  def nbytes(self) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def init_replay(capacity: int, entry_size: int, prompt_len: int,
                completion_len: int) -> ReplayState:
  """An empty buffer of ``capacity`` entries of ``entry_size`` rollouts (memory fixed here)."""
  c, e, p, t = capacity, entry_size, prompt_len, completion_len
  rollouts = Rollout(
      prompt_ids_NxP=jnp.zeros((c, e, p), jnp.int32),
      prompt_mask_NxP=jnp.zeros((c, e, p), bool),
      completion_ids_NxT=jnp.zeros((c, e, t), jnp.int32),
      completion_mask_NxT=jnp.zeros((c, e, t), bool),
      behaviour_logp_NxT=jnp.zeros((c, e, t), jnp.float32),
      scores_N=jnp.zeros((c, e), jnp.float32),
      success_N=jnp.zeros((c, e), bool),
      prompt_id_N=jnp.zeros((c, e), jnp.int32),
      version_N=jnp.zeros((c, e), jnp.int32))
  return ReplayState(rollouts=rollouts, advantages_CxE=jnp.zeros((c, e), jnp.float32),
                     version_C=jnp.zeros((c,), jnp.int32), inserted_C=jnp.zeros((c,), jnp.int32),
                     use_count_C=jnp.zeros((c,), jnp.int32), drift_C=jnp.zeros((c,), jnp.float32),
                     valid_C=jnp.zeros((c,), bool), write_pos=jnp.zeros((), jnp.int32),
                     num_inserted=jnp.zeros((), jnp.int32))
