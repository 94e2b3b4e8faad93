"""The optimiser and its learning-rate schedule, from a config's ``opt`` group.

Shared by the train loop and the benchmarks that build a train step without running one
(``bench/memory.py``), so neither imports the other.
"""

from __future__ import annotations

import optax


def make_schedule(config) -> optax.Schedule:
  """Learning rate as a function of the *train step*: linear warm-up over
  ``opt.warmup_steps`` steps, then constant or cosine decay reaching 0 at ``total_steps``."""
  o = config.opt
  if o.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, o.learning_rate, o.warmup_steps,
                                              max(config.total_steps, o.warmup_steps + 1))
  return optax.join_schedules([optax.linear_schedule(0.0, o.learning_rate, o.warmup_steps),
                               optax.constant_schedule(o.learning_rate)], [o.warmup_steps])


def make_optimizer(config) -> optax.GradientTransformation:
  """AdamW on ``make_schedule`` after global-norm clipping.

  optax counts ``update`` calls, and one train step makes ``num_minibatches * num_epochs`` of
  them, so the schedule is read at ``count // updates_per_step``: every update of train step k
  uses the rate of step k. The rate sits in the optimiser state (``inject_hyperparams``), where
  the train step reads it back as the metric ``learning_rate``.
  """
  o = config.opt
  per_step = config.rl.num_minibatches * config.rl.num_epochs
  schedule = make_schedule(config)
  parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  parts.append(optax.inject_hyperparams(optax.adamw)(
      learning_rate=lambda count: schedule(count // per_step), b1=o.b1, b2=o.b2,
      weight_decay=o.weight_decay))
  return optax.chain(*parts)
