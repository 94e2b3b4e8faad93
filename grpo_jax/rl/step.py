"""The pure, jitted GRPO-family train step.

    (TrainState, ReplayState, Rollout, ref_params, rng) -> (TrainState, ReplayState, metrics)

One call, in named stages: the context (group-relative advantages of the fresh rollouts and which
groups are effective); the composition of the [N + R]-row update batch by the replay method
(replay/method.py: it evicts and composes, R static, and inserts after the update, so this file has
no branch per method); the proximal pass, as the step's ``ProxPlan`` says (``prox_plan.py``: which
rows, exact or interpolated, decided once from static facts; for fresh rows pi_prox = mu at the
start of the step, so no pass is needed; unless ``prox_pass="all"``, used where the sampler's
numerics differ from the train step's, e.g. bfloat16: then one no-grad pass gives pi_prox for every
row, the trust region starts at rho = 1 exactly and the behaviour weight pi_prox / mu corrects the
sampler/trainer mismatch, logged as ``fresh_logp_mismatch``); the denominators of the replayed rows,
by the method's objective (``replay_objectives.py``); the frozen reference's log-probs (one no-grad pass,
only when the KL coefficient is > 0); the update scan (``update.py``: ``num_epochs`` passes of
``num_minibatches`` shuffled minibatches in one ``lax.scan``); the metrics (``step_metrics.py``);
the NaN guard. State and buffer are donated; with replay capacity 0 the buffer is passed through
untouched and XLA drops it. Everything the loop needs back is in ``metrics`` (scalars), fetched by
the host one step late.

References: GRPO (DeepSeekMath, arXiv 2402.03300); PPO epochs and minibatches (arXiv 1707.06347).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from grpo_jax import random_keys
from grpo_jax import sharding as sharding_lib
from grpo_jax.models import family, lora
from grpo_jax.rl import advantages as advantages_lib
from grpo_jax.rl import replay_objectives
from grpo_jax.rl import policy
from grpo_jax.rl import off_policy_prox as prox_lib
from grpo_jax.rl import prox_plan
from grpo_jax.rl import step_metrics
from grpo_jax.rl import update
from grpo_jax.rl.batch import Tokens, UpdateBatch
from grpo_jax.rl.replay import ReplayState
from grpo_jax.rl.replay import method as replay_method
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout, TrainState


def init_train_state(params, tx: optax.GradientTransformation, mesh=None) -> TrainState:
  """Step 0, ``params`` and the optimiser's initial state.

  With a ``mesh`` the state is created by one jitted call whose outputs are laid out by
  ``sharding.tree_shardings`` (the optimiser state split like the parameter it belongs to) and
  whose input parameters are donated (they become the state's, with no copy). With LoRA
  adapters in ``params`` the optimiser state is of the adapters only (``lora.trainable``).
  """
  init = lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p,
                              opt_state=tx.init(lora.trainable(p)[0]))
  if mesh is None:
    return init(params)
  shardings = sharding_lib.tree_shardings(mesh, jax.eval_shape(init, params),
                                           family.param_axes())
  return jax.jit(init, out_shardings=shardings, donate_argnums=0)(params)


def train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, config: StepConfig,
               state: TrainState, replay: ReplayState, rollout: Rollout, ref_params,
               rng: jax.Array):
  """One optimisation step on one batch of fresh rollouts (pure; see ``make_train_step``).

  Args:
    graphdef, tx, config: static (bound by ``make_train_step``).
    state: TrainState (donated).
    replay: ReplayState (donated; passed through at capacity 0).
    rollout: the fresh Rollout, N = B * G rows, group-major.
    ref_params: frozen reference parameters (ignored when the KL coefficient is 0, and when
      ``state.params`` holds LoRA adapters: the reference is then the base, adapters off).
    rng: the step's update key (``random_keys.update``): parent of the replay method's key and of the
      minibatch shuffles, each folded with the state's step (``random_keys.py``).

  Returns:
    (new TrainState, new ReplayState, dict of float32 scalar metrics).
  """
  replaying = config.replay.replays(replay)  # static
  # The no-grad passes run the shared-prompt pass unchecked when every minibatch is checked to
  # be whole groups of one prompt (the update skips the step otherwise); else they check on the
  # device (a lax.cond compiling both passes).
  rows = rollout.num_rows + config.replay.extra_rows(rollout.num_rows, config.group_size)
  grouped = True if update.minibatches_are_groups(rows, config) else None
  start_logp = functools.partial(_start_logp, graphdef, state.params, config, grouped=grouped)
  start_pass = replay_method.PolicyPass(
      start_logp, functools.partial(_start_count, config, grouped=grouped))
  ctx = _context(config, rollout, state.step, rng)
  evicted, comp, evict_metrics = _compose(config, ctx, replay, start_pass, replaying)
  off_policy_N = _off_policy_rows(config, comp, state.step)
  plan = prox_plan.plan(config, replaying, measured=comp.prox_logp is not None,
                        bounded=comp.prox_rows is not None)
  full_NxT, prox_counts = prox_plan.proximal_pass(plan, comp, off_policy_N, start_pass,
                                                 config.group_size)
  ctx, mismatch_metrics = _sampler_mismatch(plan, rollout, ctx, comp, full_NxT)
  if lora.has_adapters(state.params):
    # The reference is the base model: the adapters switched off, no second copy of weights.
    ref_params = lora.without_adapters(state.params)
  batch = _update_batch(graphdef, plan, config, comp, off_policy_N, full_NxT, ref_params,
                        state.step, grouped)
  (params, opt_state), per_update = update.update_scan(graphdef, tx, config, state, batch, rng,
                                                       replaying)
  # After selection and the update: nothing is replayed in the step that produced it.
  replay_out, insert_metrics = config.replay.after_update(ctx, evicted, comp)
  metrics = _metrics(config, plan, rollout, ctx, comp, batch, per_update, replay_out,
                     [evict_metrics, mismatch_metrics,
                      _continued_metrics(config, comp, off_policy_N),
                      prox_plan.pass_metrics(prox_counts)], insert_metrics)
  new_state, replay_out, skipped = _finite_guard(state, replay, params, opt_state, replay_out,
                                                 per_update)
  return new_state, replay_out, {**metrics, "skipped": skipped}


def _start_logp(graphdef: nnx.GraphDef, params, config: StepConfig, rows: Rollout, *,
                grouped: bool | None = None) -> jax.Array:
  """log pi_prox of ``rows``: the policy at the start of the step, no gradient.

  Args:
    graphdef: the model's structure.
    params: the state's parameters (at the start of the step).
    config: StepConfig.
    rows: a Rollout of n rows ([n, P] prompts, [n, T] completions).
    grouped: ``policy.logprobs``'s (True: the shared-prompt pass unchecked; None: checked).

  Returns:
    [n, T] float32 log-probs.
  """
  logp, _ = policy.logprobs(graphdef, jax.lax.stop_gradient(params), Tokens.of(rows), config,
                            grouped=grouped)
  return jax.lax.stop_gradient(logp)


def _start_count(config: StepConfig, rows: Rollout, *,
                 grouped: bool | None = None) -> tuple[jax.Array, jax.Array]:
  """(real tokens, positions computed) of ``_start_logp``'s pass over ``rows``
  (``policy.pass_tokens``)."""
  return policy.pass_tokens(Tokens.of(rows), config, grouped)


def _context(config: StepConfig, rollout: Rollout, step: jax.Array,
             rng: jax.Array) -> replay_method.StepContext:
  """What the replay method knows of this step's fresh rollouts.

  Args:
    config: StepConfig (G, the estimator, the reward and effective signals).
    rollout: the fresh Rollout, N = B * G rows, group-major.
    step: int32 policy step (the state's).
    rng: the step's update key; the method's own is ``random_keys.replay`` of it.

  Returns:
    StepContext: the fresh rows as [B, G, ...], their [B, G] advantages (on the reward
    signal) and the [B] effective groups (on the effective signal).
  """
  g = config.group_size
  b = rollout.num_rows // g
  signal = lambda name: rollout.scores if name == "score" else rollout.success
  adv_BxG = advantages_lib.group_advantages(signal(config.reward_signal).reshape(b, g),
                                            config.estimator)
  effective_B = advantages_lib.effective_groups(signal(config.effective_signal).reshape(b, g))
  fresh = jax.tree.map(lambda x: x.reshape((b, g) + x.shape[1:]), rollout)
  return replay_method.StepContext(fresh=fresh, advantages=adv_BxG, effective=effective_B,
                                   step=step, rng=random_keys.replay(rng, step))


def _compose(config: StepConfig, ctx: replay_method.StepContext, replay: ReplayState,
             start_logp, replaying: bool) -> tuple[ReplayState, replay_method.Composition, dict]:
  """The replay method's eviction and composition of the update batch.

  Args:
    config: StepConfig (its replay method).
    ctx: the StepContext.
    replay: the ReplayState as it came in ([C] entries of E rollouts).
    start_logp: the start-of-step pass (``method.PolicyPass``: log pi_prox of n rows, and its
      token counts), for methods that score candidates.
    replaying: the method can replay (static).

  Returns:
    (the buffer after eviction, the Composition of N + R rows, {"replay_evicted": the entries
    evicted} when replaying, else {}).
  """
  rc = config.replay
  evicted = rc.evict(replay, ctx.step)
  metrics = {}
  if replaying:
    live = lambda buffer: jnp.sum(buffer.valid.astype(jnp.float32))
    metrics["replay_evicted"] = live(replay) - live(evicted)
  return evicted, rc.compose(ctx, evicted, start_logp), metrics


def _off_policy_rows(config: StepConfig, comp: replay_method.Composition,
                     step: jax.Array) -> jax.Array:
  """bool [N + R]: the rows the objective corrects: the replayed ones and, with
  ``config.continued`` (partial rollouts), the rows holding a token drawn before ``step``
  (``prox.continued_rows``).
  """
  if not config.continued:
    return comp.replayed
  return comp.replayed | prox_lib.continued_rows(comp.rollout, step)


def _sampler_mismatch(plan: prox_plan.ProxPlan, rollout: Rollout,
                      ctx: replay_method.StepContext, comp: replay_method.Composition,
                      full_NxT: jax.Array | None) -> tuple[replay_method.StepContext, dict]:
  """With ``prox_pass="all"``: how far the trainer's log-probs of the fresh tokens are from the
  sampler's, and the fresh rows' pi_gen for the buffer (the trainer's, not the sampler's).

  Args:
    plan: the step's ProxPlan (``every_row``: ``prox_pass="all"``).
    rollout: the fresh Rollout, N rows.
    ctx: the StepContext.
    comp: the Composition of N + R rows.
    full_NxT: [N + R, T] log pi_prox of every row (``prox_plan.proximal_pass``; None unless "all").

  Returns:
    (ctx with ``gen_logp_BxGxT`` set, {"fresh_logp_mismatch": mean |log pi_prox - log mu| over
    the fresh rows' loss tokens of the current version}), or (ctx, {}) unchanged with
    ``prox_pass="replayed"``.
  """
  if not plan.every_row:
    return ctx, {}
  n = rollout.num_rows
  mu_NxT, replayed_N = comp.rollout.behaviour_logp, comp.replayed
  # Tokens drawn by the start-of-step parameters: the fresh rows' (a continued row's earlier
  # tokens came from earlier parameters, whose trainer log-probs the step does not have).
  current_NxT = ~replayed_N[:, None] & (comp.rollout.version >= ctx.step)
  fresh_tok = (comp.loss_mask & current_NxT).astype(jnp.float32)
  mismatch = (jnp.sum(jnp.abs(full_NxT - mu_NxT) * fresh_tok)
              / jnp.maximum(jnp.sum(fresh_tok), 1.0))
  # What this step's rows store as pi_gen: the pass over the fresh rows' current tokens at
  # their places in the batch (rows 0..N-1; POPO's replaced ineffective groups are not in the
  # batch and keep mu, which matters only for POPO-ineff, whose stored ineffective groups have
  # advantage 0); a continued row's earlier tokens keep mu, the log-prob of the distribution
  # that drew them.
  fresh_gen_NxT = jnp.where(current_NxT[:n], full_NxT[:n], rollout.behaviour_logp)
  ctx = ctx.replace(gen_logp=fresh_gen_NxT.reshape(ctx.fresh.behaviour_logp.shape))
  return ctx, {"fresh_logp_mismatch": mismatch}


def _update_batch(graphdef: nnx.GraphDef, plan: prox_plan.ProxPlan, config: StepConfig,
                  comp: replay_method.Composition, off_policy_N: jax.Array,
                  full_NxT: jax.Array | None, ref_params, step: jax.Array,
                  grouped: bool | None = None) -> UpdateBatch:
  """The UpdateBatch: the composed rows with the loss's denominators and reference log-probs.

  Fresh rows: mu is the sampler's log mu and pi_prox is mu (or the start-of-step pass with
  ``prox_pass="all"``, so that rho starts at 1 exactly and w = pi_prox / mu corrects the
  sampler/trainer mismatch). Off-policy rows (replayed; continued with ``config.continued``):
  the objective's denominators (``replay_objectives.py``) of their mu, their pi_prox (the method's own
  pass when it made one, else ``full_NxT``) and their stored pi_gen. With
  ``prox_estimate="interpolate"`` and no pass, those rows keep mu here and carry the age of
  each token: the loss applies the objective to the interpolated pi_prox in each update
  (``update.py``, ``prox.interpolated``).

  Args:
    graphdef: the model's structure.
    plan: the step's ProxPlan (``prox_plan.plan``).
    config: StepConfig.
    comp: the Composition of N + R rows.
    off_policy_N: bool [N + R] the rows the objective corrects (``_off_policy_rows``).
    full_NxT: [N + R, T] float32 log pi_prox, or None (``prox_plan.proximal_pass``).
    ref_params: the frozen reference's parameters (used when the KL coefficient is > 0).
    step: int32 the state's step (the tokens' ages are counted from it).
    grouped: the reference pass's ``policy.logprobs`` argument (see ``train_step``).

  Returns:
    UpdateBatch of N + R rows.
  """
  mixed = comp.rollout
  mu_NxT = mixed.behaviour_logp
  prox_NxT = full_NxT if plan.every_row else mu_NxT
  behaviour_NxT = mu_NxT
  age_NxT = None
  if plan.corrects:
    known_N = off_policy_N  # rows whose denominators are final here
    if plan.interpolate:
      # Denominators in the loss, from pi_prox interpolated in each update; a method's own
      # pass keeps its replayed rows' values.
      measured_N = plan.measured_rows(comp.replayed)
      interpolated_NxT = (off_policy_N & ~measured_N)[:, None] & mixed.completion_mask
      age_NxT = jnp.where(interpolated_NxT, step - mixed.version, 0).astype(jnp.float32)
      known_N = measured_N
    if plan.denominators:
      # The pass, where one ran, already holds the method's own values on the rows it
      # measured (``prox_plan.proximal_pass``); the method's array alone holds mu on every
      # other row, which would give continued rows the naive correction.
      replayed_prox_NxT = {None: None, "pass": full_NxT, "method": comp.prox_logp}[
          plan.prox_from]
      objective = replay_objectives.OBJECTIVES[config.replay.objective]
      replayed_mu_NxT, replayed_ratio_NxT = objective.denominators(mu_NxT, replayed_prox_NxT,
                                                                   comp.gen_logp)
      behaviour_NxT = jnp.where(known_N[:, None], replayed_mu_NxT, mu_NxT)
      prox_NxT = jnp.where(known_N[:, None], replayed_ratio_NxT, prox_NxT)
  tokens = Tokens.of(mixed)
  ref_NxT = None
  if config.loss.kl_coef > 0:
    ref_NxT, _ = policy.logprobs(graphdef, jax.lax.stop_gradient(ref_params), tokens, config,
                                 grouped=grouped)
    ref_NxT = jax.lax.stop_gradient(ref_NxT)
  return UpdateBatch(
      tokens=tokens, loss_mask=comp.loss_mask, advantages=comp.advantages,
      behaviour_logp=behaviour_NxT, prox_logp=prox_NxT, ref_logp=ref_NxT,
      # The loss pass measures how far pi_theta is from each replayed row's pi_gen.
      replayed=comp.replayed if plan.replaying else None,
      gen_logp=comp.gen_logp if plan.corrects else None, age=age_NxT)


def _continued_metrics(config: StepConfig, comp: replay_method.Composition,
                       off_policy_N: jax.Array) -> dict:
  """With ``config.continued``: {"continued_rows": rows the objective corrects that are not
  replayed (partial rollouts continued across updates), among the loss's rows}; else {}."""
  if not config.continued:
    return {}
  used_N = off_policy_N & ~comp.replayed & jnp.any(comp.loss_mask, axis=-1)
  return {"continued_rows": jnp.sum(used_N.astype(jnp.float32))}


def _metrics(config: StepConfig, plan: prox_plan.ProxPlan, rollout: Rollout,
             ctx: replay_method.StepContext, comp: replay_method.Composition,
             batch: UpdateBatch, per_update: dict, replay_out: ReplayState,
             stage_metrics: list[dict], insert_metrics: dict) -> dict:
  """Every metric of the step but ``skipped`` (``step_metrics.py``).

  Args:
    config: StepConfig.
    plan: the step's ProxPlan (whether the method replays; whether the pass covers every row).
    rollout: the fresh Rollout, N rows.
    ctx: the StepContext ([B, G] advantages, [B] effective groups).
    comp: the Composition of N + R rows (the method's metrics).
    batch: the UpdateBatch of N + R rows.
    per_update: name -> [E, M] per-update metrics of the update scan.
    replay_out: the buffer after the method's insertion ([C] entries).
    stage_metrics: the earlier stages' metrics, in order.
    insert_metrics: the method's metrics of its insertion.

  Returns:
    name -> float32 scalar.
  """
  metrics = step_metrics.update_metrics(per_update, plan.replaying)
  grouped = update.minibatches_are_groups(batch.num_rows, config)
  if config.packing == "none":
    # The padded layout's fraction is the batch's: every minibatch computes its fixed
    # positions, whichever rows it holds.
    real, computed = policy.pass_tokens(batch.tokens, config, grouped)
    metrics["update_useful_fraction"] = real / computed
  if plan.every_row or config.loss.kl_coef > 0:
    # The no-grad passes over the whole batch (pi_prox of every row, the reference).
    real, computed = policy.pass_tokens(batch.tokens, config, True if grouped else None)
    metrics["batch_pass_useful_fraction"] = real / computed
  metrics.update(step_metrics.batch_metrics(rollout, ctx.advantages, ctx.effective, batch))
  for more in stage_metrics:
    metrics.update(more)
  if plan.replaying:
    metrics.update(step_metrics.replay_age_metrics(batch.loss_mask, comp.replayed,
                                                   comp.rollout.row_version, ctx.step))
    metrics.update(comp.metrics)
  if config.effective_signal != config.reward_signal:
    metrics["effective_advantage_disagree"] = step_metrics.effective_disagreement(
        ctx.advantages, ctx.effective)
  metrics.update(insert_metrics)
  if plan.replaying:
    metrics["buffer_occupancy"] = jnp.mean(replay_out.valid.astype(jnp.float32))
  metrics["ineffective_fraction"] = 1.0 - metrics["effective_fraction"]
  return metrics


def _finite_guard(state: TrainState, replay_in: ReplayState, params, opt_state,
                  replay_out: ReplayState,
                  per_update: dict) -> tuple[TrainState, ReplayState, jax.Array]:
  """NaN/inf guard, on the device: a non-finite loss or gradient anywhere in the step leaves
  parameters, optimiser state (so the schedule's count too) and buffer exactly as they came
  in; the host counts the skips (metric "skipped") and stops after too many in a row.

  Args:
    state: the TrainState the step started from.
    replay_in: the ReplayState the step started from.
    params, opt_state: after the update scan.
    replay_out: the ReplayState after the method's insertion.
    per_update: name -> [E, M] per-update metrics ("loss", "grad_norm").

  Returns:
    (the next TrainState, its ReplayState, float32 1.0 when the step was skipped, else 0.0).
  """
  finite = (jnp.all(jnp.isfinite(per_update["loss"]))
            & jnp.all(jnp.isfinite(per_update["grad_norm"])))
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  params, opt_state = keep((params, opt_state), (state.params, state.opt_state))
  new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, keep(replay_out, replay_in), 1.0 - finite.astype(jnp.float32)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    config: StepConfig, shardings: sharding_lib.StepShardings | None = None):
  """``fn(state, replay, rollout, ref_params, rng)``, jitted once, state and buffer donated.

  With ``shardings`` (``sharding.step_shardings``) the step is jitted with explicit input and
  output shardings under that mesh: state and buffer keep their layout from step to step (so
  the donation aliases and nothing recompiles), the rollout's rows are split over the batch
  axes, the metrics come back replicated. Rollouts may then be passed as host or
  single-device arrays: they are placed on their sharding first (``sharding.PutInputs``).
  """
  fn = functools.partial(train_step, graphdef, tx, config)
  if shardings is None:
    return jax.jit(fn, donate_argnums=(0, 1))
  s = shardings
  in_shardings = (s.state, s.replay, s.rows, s.ref_params, s.replicated)
  jitted = jax.jit(sharding_lib.use_mesh(fn, s.mesh), donate_argnums=(0, 1),
                   in_shardings=in_shardings, out_shardings=(s.state, s.replay, s.replicated))
  return sharding_lib.PutInputs(jitted, in_shardings)


@functools.lru_cache(maxsize=8)
def cached_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                      config: StepConfig, shardings: sharding_lib.StepShardings | None = None):
  """``make_train_step``, one per (model structure, optimiser, step config, layout) in a
  process: a run built twice in one process (a resumed run, a notebook's second run, the next
  seed) traces, lowers and compiles its step once. ``tx`` is compared by identity
  (``optim.make_optimizer`` returns one object per setting)."""
  return make_train_step(graphdef, tx, config, shardings)
