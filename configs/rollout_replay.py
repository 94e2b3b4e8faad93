"""Rollout-level advantage-prioritised replay (Yoo et al., arXiv 2606.04560).

Single rollouts in the buffer, age eviction after tau_max = 10 train steps, every batch all
fresh rollouts plus round(0.5 N) replayed ones drawn without replacement with probability
proportional to (|A| + 1e-6)^0.5, no replay in the first 20 steps; replayed rows keep their
frozen advantage and their ratio is pi_theta / mu_birth (objective "align_mu").

    python -m grpo_jax.train --config=configs/rollout_replay.py --workdir=runs/rollout_replay

Presets: ``decoupled`` (POPO's objective for replayed rows), plus the common ones.
"""

from configs import common

PRESETS = ("decoupled",)


def get_config(arg: str | None = None):
  c = common.base_config()
  c.replay.method = "rollout"
  c.replay.max_age = 10  # tau_max: an entry older than 10 train steps is never replayed
  c.replay.rho = 0.5  # 128 replay rows next to the 256 fresh ones
  c.replay.alpha = 0.5
  c.replay.warmup_steps = 20
  c.replay.insert = "nonzero"  # zero-advantage rollouts carry no gradient: not stored
  c.replay.objective = "align_mu"  # the paper's ratio pi_theta / mu_birth
  # Every rollout of the last tau_max + 1 steps fits: N * (tau_max + 1) entries (the paper's
  # 30k FIFO "rarely binds"); a reference, so batch presets and overrides carry through.
  n_ref = c.rollout.get_ref("batch_prompts") * c.rollout.get_ref("group_size")
  c.replay.capacity = n_ref * 11
  # 256 + 128 = 384 rows: 4 minibatches of 96.
  rest = []
  for name in filter(None, (arg or "").split(",")):
    if name == "decoupled":
      c.replay.objective = "decoupled"
    else:
      rest.append(name)
  return common.apply_presets(c, ",".join(rest), own=PRESETS)
