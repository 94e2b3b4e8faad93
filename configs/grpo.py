"""GRPO (DeepSeekMath, arXiv 2402.03300) on the embedded Countdown model.

    python -m grpo_jax.train --config=configs/grpo.py --workdir=runs/grpo
    python -m grpo_jax.train --config=configs/grpo.py:smoke --workdir=/tmp/smoke
    python -m grpo_jax.train --config=configs/grpo.py:qwen3_1p7b,gsm8k \
        --config.model.path=/models/Qwen3-1.7B --workdir=runs/qwen3
"""

from grpo_jax import schema


def get_config(arg: str | None = None):
  c = schema.base_config()
  c.rl.estimator = "grpo"  # (r - mean) / (std + 1e-6)
  c.rl.loss.aggregation = "seq-mean-token-mean"  # GRPO's per-sequence average
  return schema.apply_presets(c, arg)
