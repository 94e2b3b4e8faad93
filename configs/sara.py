"""SARA (arXiv 2607.26253): probe K = 4 rollouts per prompt, commit or abandon, spend the freed
budget on new prompts; GRPO's loss on the committed groups.

    python -m grpo_jax.train --config=configs/sara.py --workdir=runs/sara
    python -m grpo_jax.train --config=configs/sara.py:dps --workdir=runs/sara_dps   # SARA + DPS

Presets: every common one (``:dps`` and ``:mopps`` choose the prompts, SARA decides when to
stop each group).
"""

from grpo_jax import schema


def get_config(arg: str | None = None):
  c = schema.base_config()
  c.rl.estimator = "grpo"
  c.allocation.method = "sara"
  c.allocation.sara.probes = 4  # K
  # Abandon after 4 agreeing probes at G = 8 (P_eff = 1 - 5/9 = 0.44 with Beta(1,1)); at
  # G = 16 only after 9 agreeing rollouts (1 - 10/17 = 0.41; see grpo_jax/allocation/sara.py)
  c.allocation.sara.tau_lo = 0.45
  c.allocation.sara.tau_hi = 0.9  # commit: with a fresh Beta(1,1) prior, as soon as probes disagree
  c.allocation.max_rounds = 10
  return schema.apply_presets(c, arg)
