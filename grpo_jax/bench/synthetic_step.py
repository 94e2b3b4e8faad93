"""A train step timed on synthetic rollouts: the accelerator check's train points and
``bench.rollouts``' train-step comparison share it.

The project's modules are imported inside the functions (as in ``accelerator_points``, whose
environment point imports JAX alone).
"""

# pylint: disable=g-import-not-at-top

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def prompts(n: int, g: int, p: int, vocab: int):
  """Random prompts of P real tokens, each repeated for its G group-major rows."""
  rng = np.random.RandomState(0)
  ids = jnp.asarray(np.repeat(rng.randint(1, vocab, (n // g, p)), g, 0), jnp.int32)
  return ids, jnp.ones((n, p), bool)


def timed(call) -> tuple[float, object]:
  """(wall seconds of ``call()`` until its arrays are ready, its result)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(call())
  return time.perf_counter() - t0, out


def rollout(n: int, g: int, p: int, t: int, vocab: int, lengths: str = "full",
                      ineffective: float = 0.0, completion_mask=None):
  """A Rollout of N = B x G rows of random tokens (prompts of P real tokens, ``prompts``):
  random 0/1 scores; with ``ineffective`` > 0 that fraction of the groups all 0 (a replay
  method's slots to fill), rounded up, and the others effective; every completion T tokens,
  or with ``lengths="lognormal"`` the lengths of ``bench.rollouts``' workload (median T / 4,
  4% at T), or ``completion_mask``'s [N, T]."""
  from grpo_jax.types import Rollout
  given = completion_mask
  rng = np.random.RandomState(1)
  ids, mask = prompts(n, g, p, vocab)
  scores = rng.randint(0, 2, n).astype(np.float32)
  if ineffective > 0:
    # The first ceil(ineffective x B) groups all 0, every other group effective (its first
    # row 1, its second 0, the rest as drawn).
    scores = scores.reshape(n // g, g)
    scores[:, :2] = [1.0, 0.0]
    scores[:int(np.ceil(ineffective * (n // g)))] = 0.0
    scores = scores.reshape(n)
  scores = jnp.asarray(scores)
  completion_mask = np.ones((n, t), bool)
  if lengths == "lognormal":
    from grpo_jax.bench import lengths as lengths_lib
    drawn = lengths_lib.lognormal(np.random.default_rng(0), (n,), t, 0.25, 0.04)
    completion_mask = np.arange(t)[None] < np.asarray(drawn)[:, None]
  if given is not None:
    completion_mask = np.asarray(given, bool)
  return Rollout(
      prompt_ids=ids, prompt_mask=mask,
      completion_ids=jnp.asarray(rng.randint(1, vocab, (n, t)), jnp.int32),
      completion_mask=jnp.asarray(completion_mask),
      behaviour_logp=jnp.asarray(-rng.uniform(0.1, 8.0, (n, t)) * completion_mask, jnp.float32),
      scores=scores, truncated=jnp.ones((n,), bool), success=scores > 0,
      prompt_id=jnp.arange(n, dtype=jnp.int32) // g, version=jnp.zeros((n, t), jnp.int32))


def timed_step(graphdef, params, config, rollout) -> dict:
  """The run's train step (``config``: an ml_collections config) over ``rollout``, compiled,
  called once (a replay method stores the effective groups), then called again on the same
  rows, timed. Returns compile_s, first_s, train_s, the timed call's metrics and the compiled
  step."""
  from grpo_jax import configuration
  from grpo_jax.rl import optim, replay as replay_lib
  from grpo_jax.rl import step as step_lib
  step_config = configuration.step_config(config)
  g, p, t = (config.rollout.group_size, config.rollout.prompt_len,
             config.rollout.completion_len)
  method_config = configuration.replay_method(config)
  replay = replay_lib.init_replay(config.replay.capacity, method_config.entry_size(g), p, t)
  tx = optim.make_optimizer(optim.OptimizerSettings.from_config(config))
  # The step donates its state: a copy, so the caller's parameters outlive it.
  state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
  fn = step_lib.make_train_step(graphdef, tx, step_config)
  t0 = time.perf_counter()
  step = fn.lower(state, replay, rollout, None, jax.random.key(0)).compile()
  compile_s = time.perf_counter() - t0
  first_s, (state, replay, _) = timed(lambda: step(state, replay, rollout, None,
                                                    jax.random.key(0)))
  train_s, (_, _, metrics) = timed(lambda: step(state, replay, rollout, None,
                                                  jax.random.key(1)))
  return {"compile_s": compile_s, "first_s": first_s, "train_s": train_s,
          "metrics": {k: float(v) for k, v in jax.device_get(metrics).items()}, "step": step}
