"""The train step's static settings: ``StepConfig`` and the names its switches take.

``StepConfig`` is hashable, so that ``make_train_step`` binds it as a static argument and the
step compiles once per configuration. ``configuration.step_config`` builds it from a run config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from grpo_jax import registry
from grpo_jax.rl import losses
from grpo_jax.rl.estimators import ESTIMATORS, grpo
from grpo_jax.rl.replay import method as replay_method


SIGNALS = ("score", "success")
PROX_PASSES = ("replayed", "all")
PROX_ESTIMATES = ("exact", "interpolate")
PACKINGS = ("none", "tokens")
REMAT = ("none", "layer")
SHUFFLES = ("groups", "rows")


@dataclasses.dataclass(frozen=True)
class StepConfig(registry.Configurable):
  """Static settings of the train step (hashable); its config group is ``config.rl``.

  The group's own keys are the fields not marked derived; the derived ones come from the other
  groups (``configuration.step_config``); ``OTHERS`` are the keys of ``config.rl`` that the
  host side reads.

  Attributes:
    group_size: G rollouts per prompt.
    estimator: the advantage estimator, a registered ``Estimator``
      (``grpo_jax.rl.estimators``: grpo, drgrpo, rloo).
    reward_signal: "score" (the task reward with shaping) or "success" (the 0/1 accuracy
      signal) as the reward the advantages are computed from.
    effective_signal: the signal a group must vary on to be *effective* (POPO's refill and
      insertion, GRPO-filter's drop): "success" (the accuracy signal) or "score". When it
      differs from ``reward_signal`` the groups where the two disagree are counted in the
      metric ``effective_advantage_disagree``.
    prox_pass: "replayed" (pi_prox from a no-grad pass for replayed rows only; fresh rows use
      mu) or "all" (every row; for bfloat16, where cached decoding and the full forward differ).
      The four pi_prox settings come from the config's ``prox`` group (``rows``, ``estimate``,
      ``chunks``, ``continued``) and are planned once (``prox_plan.plan``).
    prox_estimate: how replayed rows get pi_prox where the step would make a pass for it:
      "exact" (the no-grad pass at the start-of-step parameters) or "interpolate" (no pass: in
      each update, log pi_prox = log mu + alpha (log pi_theta - log mu) with alpha from the
      version stamps; ``off_policy_prox.py``). A method that measures pi_prox itself keeps its values.
    prox_chunks: with "exact", the pass runs over only the rows the method may replay (its
      static bound, ``Composition.prox_rows``), gathered replayed-first into this many chunks,
      a chunk holding no replayed row skipped at run time; 0 runs one pass over the whole
      batch.
    continued: rows may hold tokens drawn by earlier parameters (partial rollouts,
      ``rollout.partial`` with ``prox.continued=decoupled``): each such row is off-policy
      and the replay objective corrects it as it does a replayed row (pi_prox from the pass, or
      interpolated per token with ``prox_estimate``); False leaves them to the clipped
      pi_theta / mu of a fresh row (``prox.continued=naive``).
    loss: LossConfig of the policy loss.
    num_minibatches: minibatches per epoch (rows split evenly).
    num_epochs: passes over the batch (mu of GRPO).
    temperature: the rollout temperature; policy log-probs are computed at it, so that
      pi_theta and the recorded mu describe the same distribution.
    compute_entropy: compute per-token entropy (needed for an entropy bonus; else a metric).
    replay: the replay method (replay/method.py: NoReplay, popo.Popo,
      prioritized.PrioritizedReplay, headroom.HeadroomDrift); static.
    logprob_chunk: completion positions per chunk of the LM head in every log-prob pass
      (0 = all at once); bounds the [chunk, V] logits held at a time.
    remat: activation checkpointing of the differentiated pass: "none", or "layer" (each
      decoder block's insides are recomputed in the backward pass instead of stored).
    query_block: queries per attention block in every log-prob pass (0 = all at once): bounds
      the [rows, heads, block, P + T] attention scores held at a time
      (``qwen3.blocked_attention``).
    shuffle: how an epoch's rows are dealt into minibatches: "groups" (whole groups of G rows
      at a time, so each minibatch holds complete groups, as verl counts its PPO minibatches
      in prompts; falls back to "rows" when the rows are not a multiple of G times the
      minibatches) or "rows" (every row on its own).
    packing: how every log-prob pass lays its rows out: "none" (each row at [P + T], or each
      prompt once and its completions at T) or "tokens" (the real tokens packed into rows of
      G (P + T) slots, each group's prompt once, passes over packed rows that hold nothing
      skipped: ``generate.packed_logprobs``). The same values up to float rounding.
    packing_rows: with "tokens", packed rows per model pass (the pass's batch), of each
      device's rows under a mesh (each device packs its own rows).
    shared_prompts: every log-prob pass runs each prompt once for its G group-major rows when
      they repeat one prompt (``logprobs.completion_logprobs_and_entropy``'s
      ``prompt_group``); False always runs [prompt; completion] per row. The no-grad passes
      check the prompts on the device; the gradient takes the shared pass when its
      minibatches are whole groups by construction (``update.minibatches_are_groups``), and a
      batch whose groups then do not repeat their prompt is skipped (NaN loss, metric
      ``prompts_repeat`` < 1), never trained on with the wrong prompts.
  """

  group_size: int = dataclasses.field(metadata=registry.DERIVED)
  estimator: Any = registry.component(ESTIMATORS, grpo.Grpo())
  reward_signal: str = "success"
  effective_signal: str = "success"
  # config.prox.rows; its "auto" is resolved from the model's dtype (configuration.prox_pass).
  prox_pass: str = dataclasses.field(default="replayed", metadata=registry.DERIVED)
  prox_estimate: str = dataclasses.field(default="exact", metadata=registry.DERIVED)
  prox_chunks: int = dataclasses.field(default=0, metadata=registry.DERIVED)
  continued: bool = dataclasses.field(default=False, metadata=registry.DERIVED)
  loss: losses.LossConfig = registry.nested(losses.LossConfig)
  # More than one update per batch, so that the clip acts after the first.
  num_minibatches: int = 4
  num_epochs: int = 1
  temperature: float = dataclasses.field(default=1.0, metadata=registry.DERIVED)
  compute_entropy: bool = dataclasses.field(default=False, metadata=registry.DERIVED)
  replay: Any = dataclasses.field(default=replay_method.NoReplay(), metadata=registry.DERIVED)
  # Bounds the [chunk, V] logits held at a time (a batch of fewer positions is one chunk).
  logprob_chunk: int = 1024
  remat: str = dataclasses.field(default="none", metadata=registry.DERIVED)
  query_block: int = dataclasses.field(default=0, metadata=registry.DERIVED)
  shuffle: str = "groups"
  shared_prompts: bool = True
  packing: str = "none"
  packing_rows: int = 1

  # Keys of config.rl that the host side reads, not the step: what the advantages' "score"
  # starts from and DAPO's overlong penalty (rewards/scoring, allocation/rounds), and the
  # loop's stop after non-finite steps (run/loop).
  OTHERS: ClassVar[tuple[str, ...]] = ("score_base", "overlong_buffer", "overlong_penalty",
                                       "max_consecutive_skips")

  def __post_init__(self):
    error = registry.GroupError
    for name, known in (("shuffle", SHUFFLES), ("reward_signal", SIGNALS),
                        ("effective_signal", SIGNALS), ("prox_pass", PROX_PASSES),
                        ("prox_estimate", PROX_ESTIMATES), ("remat", REMAT),
                        ("packing", PACKINGS)):
      if getattr(self, name) not in known:
        raise error((name,), f"{getattr(self, name)!r}; known: {', '.join(known)}")
    if not isinstance(self.shared_prompts, bool):
      raise error(("shared_prompts",), f"{self.shared_prompts!r} must be true or false")
    for name, low in (("group_size", 1), ("num_minibatches", 1), ("num_epochs", 1),
                      ("logprob_chunk", 0), ("prox_chunks", 0), ("query_block", 0),
                      ("packing_rows", 1)):
      value = getattr(self, name)
      if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise error((name,), f"{value!r} must be an integer >= {low}")
