"""Pytrees that cross module boundaries, and the shape-letter glossary.

Shape letters, used as suffixes of local array names (``logp_NxT``) and in docstrings; each
letter means one thing everywhere in the package:

  RL batch                                    model
  B  groups (prompts) per step                L  decoder layers
  G  rollouts per group                       D  model width
  N  rows of a flat batch (B * G fresh)       F  MLP hidden width
  R  replay rows added beyond the N fresh     H  query heads
  P  prompt tokens (left padded)              K  key/value heads
  T  completion tokens                        Q  query heads per key/value head (H = K * Q)
  S  sequence positions (P + T, or a cache)   W  head width (per-head dimension)
  V  vocabulary                               X  a block of positions (query / LM-head chunks)
  C  replay-buffer capacity (entries)         M  candidate entries scored in one pass
  E  rollouts per buffer entry (G or 1)       U  rows of one minibatch update

Masks are bool; log-probs and everything a loss touches are float32.
"""

from __future__ import annotations

from typing import Any

import flax
import jax


@flax.struct.dataclass
class Completions:
  """What the sampler returns for N left-padded prompts.

  Attributes:
    tokens_NxT: int32 completion tokens; ``pad_id`` after the end of each completion.
    mask_NxT: bool, True for generated tokens up to and including the first EOS.
    logp_NxT: float32 log-probability of each token under the distribution it was sampled
      from (temperature and top-k / top-p applied); 0 where ``mask_NxT`` is False.
    lengths_N: int32 number of True entries of ``mask_NxT``.
    truncated_N: bool, True when a row reached T tokens without emitting EOS.
  """

  tokens_NxT: jax.Array
  mask_NxT: jax.Array
  logp_NxT: jax.Array
  lengths_N: jax.Array
  truncated_N: jax.Array


@flax.struct.dataclass
class Rollout:
  """One step's fresh rollouts: B groups of G, flattened group-major to N = B * G rows.

  Rows g * G .. g * G + G - 1 belong to group g (the same prompt).

  Attributes:
    prompt_ids_NxP: int32 prompts, left padded.
    prompt_mask_NxP: bool, True for real prompt tokens.
    completion_ids_NxT: int32 sampled completions.
    completion_mask_NxT: bool, True up to and including EOS.
    behaviour_logp_NxT: float32 log mu of each sampled token (0 where masked).
    scores_N: float32 reward (task score plus any shaping such as the overlong penalty).
    success_N: bool, the task's accuracy signal (score >= success threshold).
    prompt_id_N: int32 data position of the prompt (identifies the group's prompt).
    version_N: int32 policy step that generated the row.
  """

  prompt_ids_NxP: jax.Array
  prompt_mask_NxP: jax.Array
  completion_ids_NxT: jax.Array
  completion_mask_NxT: jax.Array
  behaviour_logp_NxT: jax.Array
  scores_N: jax.Array
  success_N: jax.Array
  prompt_id_N: jax.Array
  version_N: jax.Array

  @property
  def num_rows(self) -> int:
    return self.completion_ids_NxT.shape[0]


@flax.struct.dataclass
class TrainState:
  """Everything the optimiser changes: step counter, parameters, optimiser state.

  The frozen reference policy is not part of it (it never changes and is reloaded from the
  model path), and neither is the replay buffer (``ReplayState``, donated separately).
  """

  step: jax.Array
  params: Any
  opt_state: Any
