"""The update batch of one train step: typed pytrees of the rows the update trains on.

In a step's batch the rows are the N fresh rows, then the R rows the replay method adds (N + R
rows, the first axis below); a minibatch of the update scan holds U of them, with the same
fields. Optional fields are None when the step does not need them (no KL term, no replay), so
they are no leaves of the pytree and cost nothing.
"""

from __future__ import annotations

import flax
import jax

from grpo_jax.types import Rollout


@flax.struct.dataclass
class Tokens:
  """What a log-prob pass reads of its rows.

  Attributes:
    prompt_ids: [N + R, P] int32 prompts, left padded.
    prompt_mask: [N + R, P] bool, True for real prompt tokens.
    completion_ids: [N + R, T] int32 completions.
    completion_mask: [N + R, T] bool, each completion's tokens (a prefix of the row: up to
      and including its end); what a packed pass places (``rl.packing``). None: all T.
  """

  prompt_ids: jax.Array
  prompt_mask: jax.Array
  completion_ids: jax.Array
  completion_mask: jax.Array | None = None

  @classmethod
  def of(cls, rows: Rollout) -> Tokens:
    """The token arrays of ``rows``."""
    return cls(prompt_ids=rows.prompt_ids, prompt_mask=rows.prompt_mask,
               completion_ids=rows.completion_ids, completion_mask=rows.completion_mask)


@flax.struct.dataclass
class UpdateBatch:
  """The rows of one step's update and everything the loss reads of them.

  Attributes:
    tokens: the rows' Tokens.
    loss_mask: [N + R, T] bool, the tokens that count in the loss (False on dropped groups,
      empty replay slots and padding).
    advantages: [N + R] float32, one per row.
    behaviour_logp: [N + R, T] float32, the log denominator of the behaviour weight (log mu;
      on replayed rows the objective's choice, ``replay_objectives.py``).
    prox_logp: [N + R, T] float32, log pi_prox: the denominator of the trust-region ratio.
    ref_logp: [N + R, T] float32 log pi_ref of the frozen reference; None without a KL term.
    replayed: [N + R] bool, the row comes from the buffer; None when the method never replays.
    gen_logp: [N + R, T] float32 pi_gen of each row (the trainer's log-probs when it was
      generated), for the replay drift metrics; None when the method never replays.
    age: [N + R, T] float32 updates since each token was drawn (step - its version) on the
      tokens whose pi_prox the loss interpolates (replayed rows', and continued rows' drawn
      before the step), 0 elsewhere (``prox.interpolated``); else None, and
      ``prox_logp`` / ``behaviour_logp`` are final.
  """

  tokens: Tokens
  loss_mask: jax.Array
  advantages: jax.Array
  behaviour_logp: jax.Array
  prox_logp: jax.Array
  ref_logp: jax.Array | None = None
  replayed: jax.Array | None = None
  gen_logp: jax.Array | None = None
  age: jax.Array | None = None

  @property
  def num_rows(self) -> int:
    return self.loss_mask.shape[0]
