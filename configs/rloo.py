"""RLOO (arXiv 2402.14740): leave-one-out baseline.

    python -m grpo_jax.train --config=configs/rloo.py --workdir=runs/rloo
"""

from grpo_jax import schema


def get_config(arg: str | None = None):
  c = schema.base_config()
  c.rl.estimator = "rloo"  # r_i - mean of the other G - 1 rewards
  return schema.apply_presets(c, arg)
