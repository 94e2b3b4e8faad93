"""Dr. GRPO (arXiv 2503.20783): no std normalisation, constant-normaliser token sum.

    python -m grpo_jax.train --config=configs/drgrpo.py --workdir=runs/drgrpo
"""

from grpo_jax import schema


def get_config(arg: str | None = None):
  c = schema.base_config()
  c.rl.estimator = "drgrpo"  # r - mean
  c.rl.loss.aggregation = "seq-mean-token-sum-norm"  # sum over tokens / (rows * completion_len)
  return schema.apply_presets(c, arg)
