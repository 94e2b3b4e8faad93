"""Rollout-level advantage-prioritised replay (Yoo et al., arXiv 2606.04560).

Single rollouts in the buffer; every batch is all fresh rollouts plus round(0.5 F) replayed ones
(F = the fresh rollouts in the loss) drawn without replacement with probability proportional
to (|A| + 1e-6)^0.5, age eviction after tau_max = 10 before each draw, no replay in the first
20 steps; replayed rows keep their frozen advantage and their ratio is pi_theta / mu_birth
(objective "align_mu").

    python -m grpo_jax.train --config=configs/rollout_replay.py --workdir=runs/rollout_replay
    python -m grpo_jax.train --config=configs/rollout_replay.py:paper --workdir=runs/rr_paper

Two variants:

* **default (this project's controlled variant)**: the shared GRPO settings of every config
  (clip 0.2 / 0.2, no dual clip, seq-mean-token-mean, 4 minibatches), every fresh group in the
  loss, rollouts with |A| > 0 stored, tau_max counted in *train steps* (with 4 minibatches,
  10 train steps are 40 updates). It differs from ``configs/grpo.py`` by the replay alone.
* **``:paper`` (faithful to the paper's reference implementation)**: fresh groups
  whose rewards do not vary are dropped from the loss (masked: the batch keeps its fixed
  shape), only the rollouts of the surviving groups enter the buffer, round(rho x survivors)
  of the R fixed replay slots are filled, token-mean, clip 0.2 / 0.28, dual clip 10, one
  minibatch per update (one epoch), and tau_max = 10 counted in *gradient steps*. Not taken
  over: the paper's learning rate 1e-6 and weight decay 0.01 (for Qwen3 at 1.7B-8B; every
  config here shares lr 3e-5, no weight decay, for the 1M embedded model) and its 30k-entry
  capacity (here every rollout of the last tau_max + 1 steps fits, so it never binds either).

Presets: ``paper``, ``decoupled`` (POPO's objective for replayed rows), plus the common ones.
"""

from grpo_jax import schema


def get_config(arg: str | None = None):
  c = schema.base_config()
  c.replay.method = "prioritized"
  c.replay.prioritized.tau_max = 10  # tau_max: an entry older than 10 (age_unit) is never replayed
  c.replay.prioritized.age_unit = "steps"
  c.replay.prioritized.rho = 0.5  # 128 replay rows next to the 256 fresh ones
  c.replay.prioritized.alpha = 0.5
  c.replay.prioritized.warmup_steps = 20
  c.replay.prioritized.insert = "nonzero"  # zero-advantage rollouts carry no gradient: not stored
  c.replay.objective = "align_mu"  # the paper's ratio pi_theta / mu_birth
  # Every rollout of the last tau_max + 1 steps fits: N * (tau_max + 1) entries (the paper's
  # 30k FIFO "rarely binds"); a reference, so batch presets and overrides carry through.
  n_ref = c.rollout.get_ref("batch_prompts") * c.rollout.get_ref("group_size")
  c.replay.capacity = n_ref * 11
  # 256 + 128 = 384 rows: 4 minibatches of 96.
  return schema.apply_presets(c, arg, own=PRESETS)


def _paper(c):
  """The paper's reference implementation (module docstring)."""
  c.replay.prioritized.drop_ineffective = True  # zero-variance fresh groups leave the loss
  c.replay.prioritized.insert = "effective"  # only the surviving groups' rollouts are stored
  c.replay.prioritized.age_unit = "updates"  # tau_max = 10 gradient steps
  c.rl.num_minibatches = 1  # one update per step (one epoch), as the reference
  c.rl.num_epochs = 1
  c.rl.loss.aggregation = "token-mean"
  c.rl.loss.ppo.clip_low, c.rl.loss.ppo.clip_high = 0.2, 0.28
  c.rl.loss.ppo.dual_clip = 10.0


PRESETS = {
    "paper": schema.Preset(_paper),
    # POPO's objective for replayed rows.
    "decoupled": schema.Preset(lambda c: c.replay.update(objective="decoupled")),
}
