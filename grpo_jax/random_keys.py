"""Where every random key of a run comes from: one ``fold_in`` tag per consumer.

A key is either a *parent* (only ever folded or split to derive others) or a *leaf* (handed to
one random function), never both, and no two consumers share a key:

    run          = key(seed)
    lora_init    = fold_in(run, LORA_INIT)         the LoRA adapters' A draws (models/lora.py)
    partial      = fold_in(run, PARTIAL_ROWS)      parent of partial rollouts' groups:
      group(i)   = fold_in(partial, i)             split into its rows' keys; a row draws
                                                   token t with fold_in(row key, t)
    evaluation   = fold_in(run, EVALUATION)        parent of the evaluation batches:
      batch(i)   = fold_in(evaluation, i)          parent of the sampler's token keys
    train(s)     = fold_in(fold_in(run, TRAIN), s) parent of step s's consumers:
      generation = fold_in(train(s), GENERATION)   parent of the allocator's rounds:
        round(r) = fold_in(generation, r)          parent of the sampler's token keys
      update     = fold_in(train(s), UPDATE)       the train step's ``rng`` (a parent):
        replay   = fold_in(fold_in(update, s), REPLAY)    a replay method's own draws
        shuffle  = fold_in(fold_in(update, s), SHUFFLE)   split into one key per epoch

The sampler draws token t of a call with ``fold_in(call_key, t)`` (sampler.py), so a call's key
must be a parent: before this module, round r >= 1 of a step used ``fold_in(round 0, r)``,
which is round 0's token-r key, and evaluation used ``fold_in(key(seed), 0)``, which is step
0's loop key. Evaluation uses the same keys at every evaluation of a run (common random numbers:
two evaluations differ by the parameters, not by the sampling noise).
"""

from __future__ import annotations

import jax

# Tags: distinct small integers, one per consumer (values are arbitrary but fixed: changing one
# changes every run's random stream).
EVALUATION = 1
TRAIN = 2
GENERATION = 3
UPDATE = 4
REPLAY = 5
SHUFFLE = 6
LORA_INIT = 7
PARTIAL_ROWS = 8


def run_key(seed: int) -> jax.Array:
  """The run's root key."""
  return jax.random.key(seed)


def lora_init(seed: int) -> jax.Array:
  """The key of the LoRA adapters' initial draws (``nnx.Rngs(params=...)``)."""
  return jax.random.fold_in(run_key(seed), LORA_INIT)


def partial_rows(seed: int) -> jax.Array:
  """Parent of the keys of partial rollouts' groups (``allocation.partial``): group i's rows
  split ``fold_in(partial_rows, i)`` (rows outlive their step, so their keys cannot hang off a
  step's key)."""
  return jax.random.fold_in(run_key(seed), PARTIAL_ROWS)


def evaluation_batch(seed: int, batch: int) -> jax.Array:
  """The sampler key of evaluation batch ``batch`` (any integer naming it, e.g. its first row)."""
  return jax.random.fold_in(jax.random.fold_in(run_key(seed), EVALUATION), batch)


def train_step_key(seed: int, step: int) -> jax.Array:
  """Parent of every key train step ``step`` uses."""
  return jax.random.fold_in(jax.random.fold_in(run_key(seed), TRAIN), step)


def generation(step_key: jax.Array) -> jax.Array:
  """The allocator's key for the step (parent of its rounds)."""
  return jax.random.fold_in(step_key, GENERATION)


def update(step_key: jax.Array) -> jax.Array:
  """The train step's ``rng`` argument."""
  return jax.random.fold_in(step_key, UPDATE)


def round_key(generation_key: jax.Array, r: int) -> jax.Array:
  """The sampler key of generation round ``r`` (every round, round 0 included, is folded)."""
  return jax.random.fold_in(generation_key, r)


def replay(update_key: jax.Array, step) -> jax.Array:
  """A replay method's key inside the train step (``step``: the state's step counter)."""
  return jax.random.fold_in(jax.random.fold_in(update_key, step), REPLAY)


def shuffle(update_key: jax.Array, step, epochs: int) -> jax.Array:
  """[epochs] keys of the minibatch permutations inside the train step."""
  return jax.random.split(jax.random.fold_in(jax.random.fold_in(update_key, step), SHUFFLE),
                          epochs)
