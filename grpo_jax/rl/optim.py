"""The optimiser and its learning-rate schedule, from a config's ``opt`` group
(``OptimizerSettings``, built by validation: ``settings.Settings.optimizer``).

Shared by the train loop and the benchmarks that build a train step without running one
(``bench/memory.py``), so neither imports the other.
"""

from __future__ import annotations

import dataclasses
import functools

import optax


def _schedule(kind: str, learning_rate: float, warmup_steps: int,
              total_steps: int) -> optax.Schedule:
  """Learning rate as a function of the *train step*: linear warm-up over ``warmup_steps``
  steps, then constant (``kind`` "constant") or cosine decay reaching 0 at ``total_steps``."""
  if kind == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps,
                                              max(total_steps, warmup_steps + 1))
  return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps),
                               optax.constant_schedule(learning_rate)], [warmup_steps])


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """The optimiser's settings: the ``opt`` group, the run's length (for the cosine schedule)
  and the optimiser updates a train step makes (``rl.num_minibatches * rl.num_epochs``); the
  defaults are the config's (``schema.defaults``)."""

  schedule: str
  learning_rate: float
  warmup_steps: int
  total_steps: int  # read by the cosine schedule only (0 otherwise)
  grad_clip: float
  b1: float
  b2: float
  weight_decay: float
  updates_per_step: int

  @classmethod
  def from_config(cls, config) -> OptimizerSettings:
    o = config.opt
    return cls(o.schedule, float(o.learning_rate), int(o.warmup_steps),
               int(config.total_steps) if o.schedule == "cosine" else 0, float(o.grad_clip),
               float(o.b1), float(o.b2), float(o.weight_decay),
               int(config.rl.num_minibatches * config.rl.num_epochs))


def make_optimizer(settings: OptimizerSettings) -> optax.GradientTransformation:
  """AdamW on ``settings``' schedule (``_schedule``) after global-norm clipping.

  optax counts ``update`` calls, and one train step makes ``updates_per_step`` of them, so the
  schedule is read at ``count // updates_per_step``: every update of train step k uses the
  rate of step k. The rate sits in the optimiser state (``inject_hyperparams``), where the
  train step reads it back as the metric ``learning_rate``.

  Equal settings return the same object, so that a train step built twice in one process (a
  resumed run, the next seed) is the same jitted function (``step.cached_train_step``).
  """
  return _optimizer(*dataclasses.astuple(settings))


@functools.lru_cache(maxsize=16)
def _optimizer(kind: str, learning_rate: float, warmup_steps: int, total_steps: int,
               grad_clip: float, b1: float, b2: float, weight_decay: float,
               per_step: int) -> optax.GradientTransformation:
  schedule = _schedule(kind, learning_rate, warmup_steps, total_steps)
  parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
  parts.append(optax.inject_hyperparams(optax.adamw)(
      learning_rate=lambda count: schedule(count // per_step), b1=b1, b2=b2,
      weight_decay=weight_decay))
  return optax.chain(*parts)
