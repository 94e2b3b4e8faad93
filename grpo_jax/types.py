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
class Rollout:
  """Sampled rows and what they earned: the one container from the sampler to the loss.

  numpy arrays on the host (allocation rounds, ``allocation.rounds.Rows``), jax arrays on the
  device (the train step, the replay buffer); the same fields throughout. Shapes below are of a
  flat batch of N rows; the leading [N] becomes [B, G] when the step groups the rows and
  [C, E] in the buffer, the trailing dimensions stay. In a step's batch rows g * G ..
  g * G + G - 1 belong to group g (the same prompt).

  The sampler fills the generation fields (prompt_*, completion_*, behaviour_logp, truncated)
  and leaves the others unset (score 0, no success, prompt_id -1, version 0); the host's
  reward sets scores and success, and ``rounds.assemble`` the prompt's data position and, for
  rows drawn within one step, the policy version (a slot pool's rows, ``generate.producer``,
  come with the version of each token).

  Attributes:
    prompt_ids: int32 [N, P] prompts, left padded.
    prompt_mask: bool [N, P], True for real prompt tokens.
    completion_ids: int32 [N, T] sampled tokens; ``pad_id`` after the end of each completion.
    completion_mask: bool [N, T], True up to and including the first EOS.
    behaviour_logp: float32 [N, T] log mu of each sampled token under the distribution it was
      sampled from (0 where masked).
    truncated: bool [N], the row reached T tokens without EOS.
    scores: float32 [N] reward (the reward function's score plus any shaping such as the
      overlong penalty).
    success: bool [N], the task's accuracy signal.
    prompt_id: int32 [N] data position of the prompt (identifies the group's prompt).
    version: int32 [N, T] the version of each token: the number of optimiser updates of the
      parameters that drew it (a synchronous step's rows: the step, every token). A row's
      version is its oldest token's, token 0's (``row_version``); the staleness of a token
      trained at version v is v - its version. Positions past a row's end carry its last
      token's version or 0; nothing reads them.
  """

  prompt_ids: Any
  prompt_mask: Any
  completion_ids: Any
  completion_mask: Any
  behaviour_logp: Any
  truncated: Any
  scores: Any
  success: Any
  prompt_id: Any
  version: Any

  @property
  def num_rows(self) -> int:
    return self.completion_ids.shape[0]

  @property
  def row_version(self):
    """int32 [N] each row's version: its oldest (first) token's."""
    return self.version[..., 0]

  @property
  def lengths(self):
    """int32 [N] generated tokens of each row (EOS included)."""
    return self.completion_mask.sum(-1).astype("int32")


@flax.struct.dataclass
class TrainState:
  """Everything the optimiser changes: step counter, parameters, optimiser state.

  The frozen reference policy is not part of it (it never changes and is reloaded from the
  model path), and neither is the replay buffer (``ReplayState``, donated separately).
  """

  step: jax.Array
  params: Any
  opt_state: Any
