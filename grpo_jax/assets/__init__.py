"""Embedded assets: the tiny Countdown policy in Hugging Face format.

``EMBEDDED_MODEL`` is made by ``python -m grpo_jax.sft --config=configs/sft.py`` and is the RL
starting policy for CPU runs; it loads through ``grpo_jax.models.from_pretrained`` and
``transformers.AutoTokenizer`` like any real checkpoint.
"""

import os

EMBEDDED_MODEL = os.path.join(os.path.dirname(__file__), "countdown-qwen3-1m")
