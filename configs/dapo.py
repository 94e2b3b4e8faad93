"""DAPO (arXiv 2503.14476): clip-higher, token-mean loss, overlong penalty, dynamic sampling.

Clip-higher (0.2 / 0.28), token-mean loss, no KL, DAPO's reward (+1 correct, -1 otherwise,
no format reward) plus the soft overlong penalty measured in tokens (R_len = 0 up to
T - buffer, then falls linearly to -1 at T, and -1 when truncated),
and dynamic sampling: generation batches of 3 x B fresh prompts (3 rounds of B prompts x G),
keeping only the effective groups, until a batch brings the kept ones to B (extras are dropped)
or 10 batches (30 rounds) have run; every generated rollout is counted.

    python -m grpo_jax.train --config=configs/dapo.py --workdir=runs/dapo
"""

from grpo_jax import schema


def get_config(arg: str | None = None):
  c = schema.base_config()
  c.rl.loss.ppo.clip_low = 0.2  # eps_low
  c.rl.loss.ppo.clip_high = 0.28  # eps_high: clip-higher
  c.rl.loss.aggregation = "token-mean"  # every token of the batch weighs the same
  # Advantages from DAPO's reward: +1 correct / -1 otherwise (score_base "accuracy", no task
  # format reward) plus the overlong penalty, so the one difference from the other methods'
  # 0/1 success reward is DAPO's own overlong shaping. "Effective" stays on the accuracy
  # signal (DAPO's filter metric is acc); disagreements are logged per step.
  c.rl.reward_signal = "score"
  c.rl.score_base = "accuracy"
  c.rl.effective_signal = "success"
  c.rl.loss.kl_coef = 0.0  # no KL
  c.rl.overlong_buffer = 4  # L_cache in tokens: the last 4 of the 16-token budget are penalised
  c.rl.overlong_penalty = 1.0  # penalty factor
  c.allocation.method = "dynamic_sampling"  # DS: keep effective groups only
  # DAPO's generation batch: 3 x B prompts (3 rounds of B x G)
  c.allocation.dynamic_sampling.oversample = 3
  c.allocation.max_rounds = 30  # DAPO's cap of 10 generation batches per step, in rounds
  return schema.apply_presets(c, arg)
