"""The train step's static settings: ``StepConfig`` and the names its switches take.

``StepConfig`` is hashable, so that ``make_train_step`` binds it as a static argument and the
step compiles once per configuration. ``configuration.step_config`` builds it from a run config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_jax.rl import losses
from grpo_jax.rl.estimators import grpo
from grpo_jax.rl.replay import method as replay_method


SIGNALS = ("score", "success")
PROX_PASSES = ("replayed", "all")
PROX_ESTIMATES = ("exact", "interpolate")
REMAT = ("none", "layer")
SHUFFLES = ("groups", "rows")


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static settings of the train step (hashable).

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
    prox_estimate: how replayed rows get pi_prox where the step would make a pass for it:
      "exact" (the no-grad pass at the start-of-step parameters) or "interpolate" (no pass: in
      each update, log pi_prox = log mu + alpha (log pi_theta - log mu) with alpha from the
      version stamps; ``prox.py``). A method that measures pi_prox itself keeps its values.
    prox_chunks: with "exact", the pass runs over only the rows the method may replay (its
      static bound, ``Composition.prox_rows``), gathered replayed-first into this many chunks,
      a chunk holding no replayed row skipped at run time; 0 runs one pass over the whole
      batch.
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
    shared_prompts: every log-prob pass runs each prompt once for its G group-major rows when
      they repeat one prompt (``logprobs.completion_logprobs_and_entropy``'s
      ``prompt_group``); False always runs [prompt; completion] per row. The no-grad passes
      check the prompts on the device; the gradient takes the shared pass when its
      minibatches are whole groups by construction (``update.minibatches_are_groups``), and a
      batch whose groups then do not repeat their prompt is skipped (NaN loss, metric
      ``prompts_repeat`` < 1), never trained on with the wrong prompts.
  """

  group_size: int
  estimator: Any = grpo.Grpo()
  reward_signal: str = "success"
  effective_signal: str = "success"
  prox_pass: str = "replayed"
  prox_estimate: str = "exact"
  prox_chunks: int = 0
  loss: losses.LossConfig = losses.LossConfig()
  num_minibatches: int = 1
  num_epochs: int = 1
  temperature: float = 1.0
  compute_entropy: bool = False
  replay: Any = replay_method.NoReplay()
  logprob_chunk: int = 0
  remat: str = "none"
  query_block: int = 0
  shuffle: str = "groups"
  shared_prompts: bool = True

  def __post_init__(self):
    if self.shuffle not in SHUFFLES:
      raise ValueError(f"shuffle must be one of {SHUFFLES}, got {self.shuffle!r}")
    for name in ("reward_signal", "effective_signal"):
      if getattr(self, name) not in SIGNALS:
        raise ValueError(f"{name} must be one of {SIGNALS}, got {getattr(self, name)!r}")
    if self.prox_pass not in PROX_PASSES:
      raise ValueError(f"prox_pass must be one of {PROX_PASSES}, got {self.prox_pass!r}")
    if self.prox_estimate not in PROX_ESTIMATES:
      raise ValueError(f"prox_estimate must be one of {PROX_ESTIMATES}, "
                       f"got {self.prox_estimate!r}")
    if self.prox_chunks < 0:
      raise ValueError(f"prox_chunks must be >= 0, got {self.prox_chunks}")
    if self.remat not in REMAT:
      raise ValueError(f"remat must be one of {REMAT}, got {self.remat!r}")
    if self.query_block < 0:
      raise ValueError(f"query_block must be >= 0, got {self.query_block}")
