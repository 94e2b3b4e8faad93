"""Key hygiene: every consumer of randomness in a run has its own key (random_keys.py)."""

import jax
import numpy as np

from grpo_jax import random_keys
from grpo_jax.allocation import Allocator


def _data(k):
  return tuple(np.asarray(jax.random.key_data(k)).ravel().tolist())


def test_every_key_of_two_steps_and_an_evaluation_is_distinct():
  """All keys a run derives for steps 0 and 1 (generation rounds 0-3 with the sampler's token
  keys t < 8, the update key, the replay key, two epochs' shuffle keys) and for two evaluation
  batches (with their token keys) are pairwise distinct, parents and leaves alike.

  Mutations this catches (both were the code before random_keys.py): round r >= 1 keyed
  ``fold_in(round 0, r)`` = round 0's token-r key; evaluation keyed ``fold_in(key(seed), 0)`` =
  step 0's loop key ``fold_in(key(seed), step)``.
  """
  seed, tokens, rounds = 0, 8, 4
  named = {}

  def add(name, key):
    named[name] = _data(key)

  def sampler_call(name, key):  # the sampler folds its call key with each token position
    add(name, key)
    for t in range(tokens):
      add(f"{name}/token{t}", jax.random.fold_in(key, t))

  add("run", random_keys.run_key(seed))
  for start in (0, 512):
    sampler_call(f"eval{start}", random_keys.evaluation_batch(seed, start))
  for step in (0, 1):
    step_key = random_keys.train_step_key(seed, step)
    add(f"step{step}", step_key)
    gen = random_keys.generation(step_key)
    add(f"step{step}/generation", gen)
    for r in range(rounds):
      sampler_call(f"step{step}/round{r}", Allocator.round_key(gen, r))
    upd = random_keys.update(step_key)
    add(f"step{step}/update", upd)
    add(f"step{step}/replay", random_keys.replay(upd, step))
    for e, k in enumerate(random_keys.shuffle(upd, step, 2)):
      add(f"step{step}/shuffle{e}", k)
  by_value = {}
  for name, value in named.items():
    by_value.setdefault(value, []).append(name)
  shared = [names for names in by_value.values() if len(names) > 1]
  assert not shared, f"keys shared between consumers: {shared}"
  assert len(named) == 1 + 2 * 9 + 2 * (1 + 1 + 4 * 9 + 1 + 1 + 2)  # 101 keys, none repeated
