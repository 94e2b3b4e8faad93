"""Supervised warm start that builds the embedded Countdown checkpoint.

    python -m grpo_jax.sft --config=configs/sft.py
    python -m grpo_jax.sft --config=configs/sft.py:smoke --config.output_dir=/tmp/sft
    python -m grpo_jax.sft --config=configs/sft.py:x4     # the regime study's ~4x model
    python -m grpo_jax.sft --config=configs/sft.py:x16    # and its ~14x one

Trains a ~1M-parameter Qwen3-architecture model from scratch on generated Countdown solutions
and stops as soon as held-out mean@8 (temperature 1) reaches ``stop.target_accuracy``: the RL
starting policy must be neither hopeless nor solved.
"""

import ml_collections

X4_MODEL = "runs/models/countdown-qwen3-4m"  # where the ``x4`` preset writes its folder
X16_MODEL = "runs/models/countdown-qwen3-13m"  # and the ``x16`` preset


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the SFT config; ``arg`` may be "smoke" (seconds-long check), "x4" or "x16".

  "x4" is a model ~3.7x the embedded one (width 256, SwiGLU 768, 8 query and 4 key/value
  heads of 32: 3.4M parameters) and "x16" one ~14x (width 512, SwiGLU 1536, 16 and 8 heads:
  13.1M), each trained to the same accuracy target, for the regime study's model-size axis
  (``configs/sweeps/difficulty.py:x4`` and ``:x16``), written to ``X4_MODEL`` / ``X16_MODEL``.
  They are evaluated every 25 steps (not 50), as a larger model crosses the target band
  faster."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # parameter init and sampling seed
  c.output_dir = "grpo_jax/assets/countdown-qwen3-1m"  # Hugging Face folder written at the end

  c.model = ml_collections.ConfigDict()
  c.model.hidden_size = 128  # D
  c.model.intermediate_size = 384  # SwiGLU width F
  c.model.num_layers = 4  # decoder blocks
  c.model.num_heads = 4  # query heads H
  c.model.num_kv_heads = 2  # key/value heads K (grouped-query attention)
  c.model.head_dim = 32  # Dh
  c.model.rope_theta = 10_000.0  # short sequences: the classic base is plenty
  c.model.tie_word_embeddings = True  # saves V * D parameters
  c.model.vocab_multiple = 64  # embedding rows rounded up to a multiple of this

  c.task = ml_collections.ConfigDict()
  c.task.num_numbers = 3  # numbers per problem; 4 is far too hard for ~1M parameters
  c.task.min_number = 1  # smallest number (inclusive)
  c.task.max_number = 50  # largest number (inclusive)
  c.task.min_target = 1  # smallest target (inclusive)
  c.task.max_target = 100  # largest target (inclusive)
  c.task.seed = 0  # problem generator seed
  c.task.template = "short"  # countdown.TEMPLATES key

  c.train = ml_collections.ConfigDict()
  c.train.max_steps = 4000  # upper bound; training normally stops on stop.target_accuracy
  c.train.batch_size = 128  # sequences per step
  c.train.learning_rate = 2e-3  # peak AdamW learning rate
  c.train.warmup_steps = 100  # linear warm-up steps
  c.train.weight_decay = 0.01  # AdamW decoupled weight decay
  c.train.grad_clip = 1.0  # global-norm clip
  c.train.prompt_len = 24  # P (the short template is 18 tokens for 3 numbers)
  c.train.completion_len = 16  # T (a reference answer is ~8 tokens with EOS)

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 50  # steps between validation evaluations
  c.eval.num_prompts = 256  # validation prompts (test split, disjoint from the RL eval slice)
  c.eval.validation_offset = 10_000  # validation = test-split problems from this index on
  c.eval.final_prompts = 256  # held-out prompts of the final report (test indices 0..n-1)
  c.eval.samples = 8  # k samples per prompt
  c.eval.temperature = 1.0  # sampling temperature of the calibration

  c.stop = ml_collections.ConfigDict()
  c.stop.target_accuracy = 0.20  # stop once validation mean@8 reaches this (groups of 8 then stay
  # all-wrong or all-right often enough, >= 30%, for replay and allocation to matter)

  if arg == "smoke":
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=16)
    c.train.update(max_steps=6, batch_size=8, warmup_steps=2)
    c.eval.update(every=3, num_prompts=4, final_prompts=4, samples=2)
  elif arg == "x4":
    c.output_dir = X4_MODEL
    c.model.update(hidden_size=256, intermediate_size=768, num_heads=8, num_kv_heads=4)
    c.eval.every = 25
  elif arg == "x16":
    c.output_dir = X16_MODEL
    c.model.update(hidden_size=512, intermediate_size=1536, num_heads=16, num_kv_heads=8)
    c.eval.every = 25
  elif arg:
    raise ValueError(f"unknown configs/sft.py preset {arg!r}; known: smoke, x4, x16")
  return c
