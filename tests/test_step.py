"""The jitted train step: one compilation, exact no-ops, loss parity, learning direction."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax import losses, sampler as sampler_lib, step as step_lib
from grpo_jax.logprobs import completion_logprobs
from grpo_jax.replay import init_replay
from grpo_jax.types import Rollout

B, G, P, T = 2, 4, 5, 6


def _rollout(split, scores, seed=0):
  graphdef, params = split
  rng = np.random.RandomState(seed)
  ids = jnp.asarray(np.repeat(rng.randint(6, 128, (B, P)), G, axis=0), jnp.int32)
  mask = jnp.ones((B * G, P), bool)
  cfg = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(5,), pad_id=0)
  out = sampler_lib.make_sampler(graphdef, cfg)(params, ids, mask, jax.random.key(seed))
  scores = jnp.asarray(scores, jnp.float32)
  return Rollout(prompt_ids_NxP=ids, prompt_mask_NxP=mask, completion_ids_NxT=out.tokens_NxT,
                 completion_mask_NxT=out.mask_NxT, behaviour_logp_NxT=out.logp_NxT,
                 scores_N=scores, success_N=scores >= 1.0,
                 prompt_id_N=jnp.repeat(jnp.arange(B), G), version_N=jnp.zeros(B * G, jnp.int32))


@pytest.fixture(scope="module")
def split(tiny_qwen3):
  return nnx.split(tiny_qwen3)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


MIXED = [1, 0, 0, 1, 0, 1, 0, 0]  # both groups effective


def test_no_recompilation_across_steps(split):
  graphdef, params = split
  tx = optax.adam(1e-3)
  config = step_lib.StepConfig(group_size=G, num_minibatches=2)

  @chex.assert_max_traces(n=1)
  def traced(*args):
    return step_lib.train_step(graphdef, tx, config, *args)

  fn = jax.jit(traced, donate_argnums=(0, 1))
  state = step_lib.init_train_state(_copy(params), tx)
  replay = init_replay(0, G, P, T)
  for seed in range(3):
    rollout = _rollout(split, MIXED if seed % 2 else [1, 1, 1, 1, 0, 0, 0, 0], seed)
    state, replay, metrics = fn(state, replay, rollout, None, jax.random.key(0))
  assert int(state.step) == 3
  assert set(metrics) >= {"loss", "grad_norm", "effective_fraction", "drift", "clip_frac_high"}


def test_zero_advantages_leave_parameters_unchanged(split):
  graphdef, params = split
  tx = optax.adam(1e-2)
  fn = step_lib.make_train_step(graphdef, tx, step_lib.StepConfig(group_size=G))
  state = step_lib.init_train_state(_copy(params), tx)
  # Every group constant: advantages are exactly 0, so the gradient is 0 and Adam's update is 0.
  rollout = _rollout(split, [1, 1, 1, 1, 0.1, 0.1, 0.1, 0.1])
  state, _, metrics = fn(state, init_replay(0, G, P, T), rollout, None, jax.random.key(0))
  assert float(metrics["effective_fraction"]) == 0.0 and float(metrics["grad_norm"]) == 0.0
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_step_loss_equals_direct_policy_loss(split, tiny_qwen3):
  graphdef, params = split
  tx = optax.sgd(0.0)
  loss_cfg = losses.LossConfig(kl_coef=0.04)
  config = step_lib.StepConfig(group_size=G, loss=loss_cfg)
  rollout = _rollout(split, MIXED)
  fn = step_lib.make_train_step(graphdef, tx, config)
  _, _, metrics = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, G, P, T),
                     rollout, params, jax.random.key(0))
  # Reference: GRPO advantages of MIXED by hand. Group 0 [1, 0, 0, 1]: mean 0.5, std 0.5 ->
  # +-0.999998. Group 1 [0, 1, 0, 0]: mean 0.25, std sqrt(0.1875) = 0.4330 -> 1.7320 / -0.5773.
  adv = jnp.asarray([1, -1, -1, 1, -1 / 3, 1, -1 / 3, -1 / 3], jnp.float32)
  adv = adv * jnp.asarray([0.999998] * 4 + [0.75 / (0.4330127 + 1e-6)] * 4)
  logp = completion_logprobs(tiny_qwen3, rollout.prompt_ids_NxP, rollout.prompt_mask_NxP,
                             rollout.completion_ids_NxT)
  # The reference policy is the policy itself, so KL = 0 and the ratio vs mu is ~1.
  expected, _ = losses.policy_loss(logp, rollout.behaviour_logp_NxT, rollout.behaviour_logp_NxT,
                                   adv, rollout.completion_mask_NxT, loss_cfg, ref_logp_NxT=logp)
  assert float(metrics["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
  assert float(metrics["kl_ref"]) == pytest.approx(0.0, abs=1e-6)


def test_update_raises_logprob_of_positive_advantage_rows(split, tiny_qwen3):
  graphdef, params = split
  tx = optax.sgd(0.5)
  rollout = _rollout(split, MIXED)
  fn = step_lib.make_train_step(graphdef, tx, step_lib.StepConfig(group_size=G))
  state, _, _ = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, G, P, T),
                   rollout, None, jax.random.key(0))
  seq_logp = lambda p: jnp.sum(completion_logprobs(
      nnx.merge(graphdef, p), rollout.prompt_ids_NxP, rollout.prompt_mask_NxP,
      rollout.completion_ids_NxT) * rollout.completion_mask_NxT, axis=-1)
  delta = np.asarray(seq_logp(state.params) - seq_logp(params))
  pos = np.asarray(MIXED, bool)
  assert delta[pos].mean() > 0 > delta[~pos].mean()
