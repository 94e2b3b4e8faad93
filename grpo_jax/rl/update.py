"""The update of one train step: ``num_epochs`` passes of ``num_minibatches`` shuffled
minibatches, each a loss, a gradient and an optax update, all inside one ``lax.scan``.

References: PPO epochs and minibatches (arXiv 1707.06347).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from grpo_jax import random_keys
from grpo_jax.models import lora
from grpo_jax.models.causal_lm import prompts_repeat
from grpo_jax.rl import losses
from grpo_jax.rl import replay_objectives
from grpo_jax.rl import policy
from grpo_jax.rl import off_policy_prox as prox_lib
from grpo_jax.rl import step_metrics
from grpo_jax.rl.batch import UpdateBatch
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.sharding import constrain
from grpo_jax.types import TrainState


def update_scan(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, config: StepConfig,
                state: TrainState, batch: UpdateBatch, rng: jax.Array,
                replaying: bool) -> tuple[tuple, dict]:
  """Every update of the step, from the state's parameters and optimiser state.

  Args:
    graphdef: the model's structure.
    tx: the optimiser.
    config: StepConfig (epochs E, minibatches M, shuffle, loss).
    state: the TrainState the step started from.
    batch: the UpdateBatch, N + R rows (a multiple of M).
    rng: the step's update key; each epoch's shuffle is ``random_keys.shuffle`` of it.
    replaying: the replay method can replay (static): the loss pass also sums the replay
      drift (``step_metrics.replay_drift_sums``).

  Returns:
    ((params, opt_state) after the last update, name -> [E, M] per-update metrics).

  With adapters (``lora``) only they are differentiated, updated and carried through the
  scan; the base weights are read from ``state.params`` unchanged.
  """
  trainable, frozen = lora.trainable(state.params)
  step = functools.partial(_minibatch_update, graphdef, tx, config, replaying, frozen)
  epoch = functools.partial(_epoch, step, config, batch)
  (trainable, opt_state), per_update = jax.lax.scan(
      epoch, (trainable, state.opt_state),
      (random_keys.shuffle(rng, state.step, config.num_epochs),
       jnp.arange(config.num_epochs, dtype=jnp.int32)))
  return (lora.join(trainable, frozen), opt_state), per_update


def minibatches_are_groups(rows: int, config: StepConfig) -> bool:
  """Whether every minibatch of a batch of ``rows`` rows is whole groups of G rows of one prompt
  each (static), so that its gradient runs the shared-prompt pass: shared prompts on, the
  "groups" shuffle dealing whole groups (``epoch_order``), and a replay method whose rows come
  in whole groups (``whole_groups``: POPO's refills and Headroom-Drift's extra groups do,
  rollout-level replay's single rollouts do not). The loop's fresh batches are group-major:
  the sampler draws G completions of each prompt."""
  g, m = config.group_size, config.num_minibatches
  return (policy.grouped_pass_possible(rows // m, config) and config.shuffle == "groups"
          and rows % (g * m) == 0 and config.replay.whole_groups)


def epoch_order(key: jax.Array, rows: int, config: StepConfig) -> jax.Array:
  """A permutation of the batch's rows for one epoch (``StepConfig.shuffle``): [rows] int32."""
  g, m = config.group_size, config.num_minibatches
  if config.shuffle == "groups" and rows % (g * m) == 0:
    groups = jax.random.permutation(key, rows // g)
    return (groups[:, None] * g + jnp.arange(g)[None]).reshape(rows)
  return jax.random.permutation(key, rows)


def _epoch(minibatch_update, config: StepConfig, batch: UpdateBatch, carry, xs):
  """One pass over the batch in M minibatches of U = (N + R) / M shuffled rows.

  ``xs``: (the epoch's shuffle key, its int32 index e); minibatch j is the step's update
  e * M + j (``prox.interpolated`` reads the fraction of the step's updates made before it).
  """
  key, e = xs
  rows, m = batch.num_rows, config.num_minibatches
  perm = epoch_order(key, rows, config)
  # Under a mesh each minibatch's rows are split like the batch (the scan runs over the
  # unsplit minibatch axis).
  shaped = jax.tree.map(
      lambda x: constrain(x[perm].reshape((m, rows // m) + x.shape[1:]), (None, "batch")), batch)
  fraction_M = (e * m + jnp.arange(m)).astype(jnp.float32) / (m * config.num_epochs)
  return jax.lax.scan(minibatch_update, carry, (shaped, fraction_M))


def _loss(graphdef: nnx.GraphDef, config: StepConfig, replaying: bool, params,
          mb: UpdateBatch, fraction: jax.Array, grouped: bool) -> tuple[jax.Array, dict]:
  """The policy loss of one minibatch of U rows (differentiated in ``params``) and its aux.

  ``fraction``: the step's updates made before this one over all of them (u / U); read only
  when the batch carries ages (pi_prox interpolated, ``with_interpolated_prox``).
  """
  c = config
  logp_UxT, entropy_UxT = policy.logprobs(graphdef, params, mb.tokens, c, c.compute_entropy,
                                          remat=c.remat == "layer", grouped=grouped)
  if mb.age is not None:
    mb = with_interpolated_prox(mb, logp_UxT, fraction, c.replay.objective)
  loss, aux = losses.policy_loss(logp_UxT, mb.prox_logp, mb.behaviour_logp, mb.advantages,
                                 mb.loss_mask, c.loss, ref_logp_NxT=mb.ref_logp,
                                 entropy_NxT=entropy_UxT)
  if replaying:
    aux.update(step_metrics.replay_drift_sums(logp_UxT, mb, c.loss.is_cap))
  return loss, aux


def with_interpolated_prox(mb: UpdateBatch, logp_UxT: jax.Array, fraction: jax.Array,
                           objective: str) -> UpdateBatch:
  """The minibatch with its off-policy tokens' denominators from the interpolated pi_prox.

  Args:
    mb: UpdateBatch of U rows carrying per-token ages ([U, T]: > 0 on the tokens of replayed
      and continued rows drawn before this step); those tokens hold log mu in
      ``behaviour_logp``.
    logp_UxT: [U, T] float32 log pi_theta of the loss pass.
    fraction: float32 u / U of this update.
    objective: the replay objective (``replay_objectives.OBJECTIVES``; one that uses pi_prox).

  Returns:
    UpdateBatch with ``behaviour_logp`` and ``prox_logp`` of the tokens of age > 0 set by the
    objective's denominators of (mu, the interpolated pi_prox, pi_gen).
  """
  mu_UxT = mb.behaviour_logp
  prox_UxT = prox_lib.interpolated(mu_UxT, logp_UxT, mb.age, fraction)
  mu2_UxT, prox2_UxT = replay_objectives.OBJECTIVES[objective].denominators(mu_UxT, prox_UxT,
                                                                     mb.gen_logp)
  old = mb.age > 0
  return mb.replace(behaviour_logp=jnp.where(old, mu2_UxT, mu_UxT),
                    prox_logp=jnp.where(old, prox2_UxT, mb.prox_logp))


def _minibatch_update(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                      config: StepConfig, replaying: bool, frozen, carry, xs):
  """One gradient and optax update on a minibatch of U rows: (carry, its metrics).

  ``carry``: (the trained parameters, the optimiser state); ``frozen``: the parameters that
  are not trained (the base under adapters; None: every parameter is trained).
  ``xs``: (the UpdateBatch of U rows, float32 u / U of this update).
  """
  mb, fraction = xs
  params, opt_state = carry
  loss_fn = lambda trained, mb, grouped: _loss(
      graphdef, config, replaying, lora.join(trained, frozen), mb, fraction, grouped)
  grad_fn = lambda grouped: functools.partial(
      jax.value_and_grad(loss_fn, has_aux=True), grouped=grouped)
  grouped = minibatches_are_groups(mb.num_rows * config.num_minibatches, config)
  (loss, aux), grads = grad_fn(grouped)(params, mb)
  if grouped:
    # One gradient, compiled once: the shared-prompt pass is chosen statically (a lax.cond over
    # a per-row fallback compiled the forward and backward twice). Rows that break the
    # group-major layout it relies on make the loss NaN, so the step's finite guard leaves the
    # state as it was, and the loop names the cause.
    repeat = prompts_repeat(mb.tokens.prompt_ids, mb.tokens.prompt_mask, config.group_size)
    loss = jnp.where(repeat, loss, jnp.nan)
    aux["prompts_repeat"] = repeat.astype(jnp.float32)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  out = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
  if config.packing == "tokens":
    # The packed loss pass's real tokens and positions computed (``step_metrics``: the
    # update's useful fraction), from the tokens alone, outside the differentiated function.
    out["_tokens/real"], out["_tokens/computed"] = policy.pass_tokens(mb.tokens, config,
                                                                      grouped)
  # The rate this update used, when the optimiser exposes it (optax.inject_hyperparams).
  lr = optax.tree_utils.tree_get(opt_state, "learning_rate",
                                 filtering=lambda _, v: isinstance(v, jax.Array))
  if lr is not None:
    out["learning_rate"] = jnp.asarray(lr, jnp.float32)
  return (params, opt_state), out
