"""The pure, jitted GRPO-family train step.

    (TrainState, ReplayState, Rollout, ref_params, rng) -> (TrainState, ReplayState, metrics)

One call: group-relative advantages of the fresh rollouts; the proximal log-probs (for fresh
rows these are the behaviour log-probs, so no pass is needed: pi_prox = mu at the start of the
step; unless ``prox_pass="all"``, used where the sampler's numerics differ from the train
step's, e.g. bfloat16: then one no-grad pass gives pi_prox for every row, the trust region
starts at rho = 1 exactly and the behaviour weight pi_prox / mu corrects the sampler/trainer
mismatch, which is logged as ``fresh_logp_mismatch``); the frozen reference's log-probs (one
no-grad pass, only when the KL coefficient is > 0);
then ``num_epochs`` passes of ``num_minibatches`` shuffled minibatches, each a loss, a gradient
and an optax update, all inside one ``lax.scan``. Replay goes through one interface
(replay/method.py): the method evicts, composes the [N + R]-row update batch (R static) and
inserts after the update, so this file has no branch per method; how replayed rows enter the
loss is the method's ``objective``. State and buffer are donated; with replay capacity 0 the
buffer is passed through untouched and XLA drops it. Everything the loop needs
back is in ``metrics`` (scalars), fetched by the host one step late.

References: GRPO (DeepSeekMath, arXiv 2402.03300); PPO epochs and minibatches (arXiv 1707.06347).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from grpo_jax import advantages as advantages_lib
from grpo_jax import keys
from grpo_jax import logprobs as logprobs_lib
from grpo_jax import losses
from grpo_jax.replay import ReplayState
from grpo_jax.replay import method as replay_method
from grpo_jax import sharding as sharding_lib
from grpo_jax.sharding import constrain
from grpo_jax.models.qwen3 import prompts_repeat
from grpo_jax.types import Rollout, TrainState


SIGNALS = ("score", "success")
PROX_PASSES = ("replayed", "all")
REMAT = ("none", "layer")
SHUFFLES = ("groups", "rows")


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Static settings of the train step (hashable).

  Attributes:
    group_size: G rollouts per prompt.
    estimator: advantage estimator name (advantages.ADVANTAGE_ESTIMATORS).
    reward_signal: "score" (the task reward with shaping) or "success" (the 0/1 accuracy
      signal) as the reward the advantages are computed from.
    effective_signal: the signal a group must vary on to be *effective* (POPO's refill and
      insertion, GRPO-filter's drop): "success" (the accuracy signal) or "score". When it
      differs from ``reward_signal`` the groups where the two disagree are counted in the
      metric ``effective_advantage_disagree``.
    prox_pass: "replayed" (pi_prox from a no-grad pass for replayed rows only; fresh rows use
      mu) or "all" (every row; for bfloat16, where cached decoding and the full forward differ).
    loss: LossConfig of the policy loss.
    num_minibatches: minibatches per epoch (rows split evenly).
    num_epochs: passes over the batch (mu of GRPO).
    temperature: the rollout temperature; policy log-probs are computed at it, so that
      pi_theta and the recorded mu describe the same distribution.
    compute_entropy: compute per-token entropy (needed for an entropy bonus; else a metric).
    replay: the replay method (replay/method.py: NoReplay, popo.PopoConfig,
      prioritized.PrioritizedReplayConfig, headroom.HeadroomConfig); static.
    logprob_chunk: completion positions per chunk of the LM head in every log-prob pass
      (0 = all at once); bounds the [chunk, V] logits held at a time.
    remat: activation checkpointing of the differentiated pass: "none", or "layer" (each
      decoder block's insides are recomputed in the backward pass instead of stored).
    query_block: queries per attention block in every log-prob pass (0 = all at once): bounds
      the [rows, heads, block, P + T] attention scores held at a time
      (``qwen3.blocked_attention``).
    shuffle: how an epoch's rows are dealt into minibatches: "groups" (whole groups of G rows
      at a time, so each minibatch holds complete groups, as verl counts its PPO minibatches
      in prompts; falls back to "rows" when the rows are not a multiple of G times the
      minibatches) or "rows" (every row on its own).
    shared_prompts: every log-prob pass runs each prompt once for its G group-major rows when
      they repeat one prompt (``logprobs.completion_logprobs_and_entropy``'s
      ``prompt_group``); False always runs [prompt; completion] per row.
  """

  group_size: int
  estimator: str = "grpo"
  reward_signal: str = "success"
  effective_signal: str = "success"
  prox_pass: str = "replayed"
  loss: losses.LossConfig = losses.LossConfig()
  num_minibatches: int = 1
  num_epochs: int = 1
  temperature: float = 1.0
  compute_entropy: bool = False
  replay: Any = replay_method.NoReplay()
  logprob_chunk: int = 0
  remat: str = "none"
  query_block: int = 0
  shuffle: str = "groups"
  shared_prompts: bool = True

  def __post_init__(self):
    if self.shuffle not in SHUFFLES:
      raise ValueError(f"shuffle must be one of {SHUFFLES}, got {self.shuffle!r}")
    for name in ("reward_signal", "effective_signal"):
      if getattr(self, name) not in SIGNALS:
        raise ValueError(f"{name} must be one of {SIGNALS}, got {getattr(self, name)!r}")
    if self.prox_pass not in PROX_PASSES:
      raise ValueError(f"prox_pass must be one of {PROX_PASSES}, got {self.prox_pass!r}")
    if self.remat not in REMAT:
      raise ValueError(f"remat must be one of {REMAT}, got {self.remat!r}")
    if self.query_block < 0:
      raise ValueError(f"query_block must be >= 0, got {self.query_block}")


def init_train_state(params, tx: optax.GradientTransformation, mesh=None) -> TrainState:
  """Step 0, ``params`` and the optimiser's initial state.

  With a ``mesh`` the state is created by one jitted call whose outputs are laid out by
  ``sharding.tree_shardings`` (the optimiser state split like the parameter it belongs to) and
  whose input parameters are donated (they become the state's, with no copy).
  """
  init = lambda p: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p))
  if mesh is None:
    return init(params)
  shardings = sharding_lib.tree_shardings(mesh, jax.eval_shape(init, params))
  return jax.jit(init, out_shardings=shardings, donate_argnums=0)(params)


def _policy_logprobs(graphdef, params, batch, config: StepConfig, with_entropy: bool = False,
                     remat: bool = False, grouped: bool | None = None):
  """Log-probs (and entropy) of ``batch``'s completions; ``grouped`` None checks the prompts.

  ``grouped`` True runs the shared-prompt pass unchecked, False the per-row pass, None decides
  on the device (``logprobs.completion_logprobs_and_entropy``).
  """
  model = nnx.merge(graphdef, params)
  group = config.group_size if config.shared_prompts and grouped is not False else 1
  return logprobs_lib.completion_logprobs_and_entropy(
      model, batch["prompt_ids_NxP"], batch["prompt_mask_NxP"], batch["completion_ids_NxT"],
      config.temperature, with_entropy, chunk_tokens=config.logprob_chunk, remat=remat,
      query_block=config.query_block, prompt_group=group, check_prompts=grouped is None)


def _grouped_pass_possible(rows: int, config: StepConfig) -> bool:
  """Whether a pass over ``rows`` rows may run grouped (static; the prompts are checked too)."""
  g = config.group_size
  return config.shared_prompts and g > 1 and rows % g == 0


def _epoch_order(key, rows: int, config: StepConfig) -> jax.Array:
  """A permutation of the batch's rows for one epoch (``StepConfig.shuffle``)."""
  g, m = config.group_size, config.num_minibatches
  if config.shuffle == "groups" and rows % (g * m) == 0:
    groups = jax.random.permutation(key, rows // g)
    return (groups[:, None] * g + jnp.arange(g)[None]).reshape(rows)
  return jax.random.permutation(key, rows)


def train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, config: StepConfig,
               state: TrainState, replay: ReplayState, rollout: Rollout, ref_params,
               rng: jax.Array):
  """One optimisation step on one batch of fresh rollouts (pure; see ``make_train_step``).

  Args:
    graphdef, tx, config: static (bound by ``make_train_step``).
    state: TrainState (donated).
    replay: ReplayState (donated; passed through at capacity 0).
    rollout: the fresh Rollout, N = B * G rows, group-major.
    ref_params: frozen reference parameters (ignored when the KL coefficient is 0).
    rng: the step's update key (``keys.update``): parent of the replay method's key and of the
      minibatch shuffles, each folded with the state's step (``keys.py``).

  Returns:
    (new TrainState, new ReplayState, dict of float32 scalar metrics).
  """
  c = config
  rc = c.replay
  replay_in = replay
  n = rollout.num_rows
  g = c.group_size
  b = n // g
  signal = lambda name: rollout.scores_N if name == "score" else rollout.success_N
  adv_BxG = advantages_lib.group_advantages(signal(c.reward_signal).reshape(b, g), c.estimator)
  effective_B = advantages_lib.effective_groups(signal(c.effective_signal).reshape(b, g))
  fresh = jax.tree.map(lambda x: x.reshape((b, g) + x.shape[1:]), rollout)
  ctx = replay_method.StepContext(fresh=fresh, advantages_BxG=adv_BxG, effective_B=effective_B,
                                  step=state.step, rng=keys.replay(rng, state.step))
  start_params = jax.lax.stop_gradient(state.params)

  def start_logp(rows: Rollout) -> jax.Array:
    """log pi_prox: the policy at the start of the step, no gradient."""
    logp, _ = _policy_logprobs(graphdef, start_params, _rows_batch(rows), c)
    return jax.lax.stop_gradient(logp)

  # Replay, through the method interface (replay/method.py): evict, compose; insert comes last.
  replaying = rc.replays(replay)
  live_before = jnp.sum(replay.valid_C.astype(jnp.float32))
  replay = rc.evict(replay, state.step)
  extra_metrics = {}
  if replaying:
    extra_metrics["replay_evicted"] = live_before - jnp.sum(replay.valid_C.astype(jnp.float32))
  comp = rc.compose(ctx, replay, start_logp)
  mixed = comp.rollout
  rows = mixed.num_rows
  replayed_N = comp.replayed_N

  mu_NxT = mixed.behaviour_logp_NxT
  batch = _rows_batch(mixed)
  batch.update({
      "mask_NxT": comp.loss_mask_NxT,
      "behaviour_logp_NxT": mu_NxT,
      # Fresh rows: the proximal policy (params at the start of the step) is the behaviour one.
      "prox_logp_NxT": mu_NxT,
      "advantages_N": comp.advantages_N,
  })
  # log pi_prox by row: fresh rows keep mu unless prox_pass="all" (then the start-of-step pass,
  # so rho starts at 1 exactly and w = pi_prox / mu corrects the sampler/trainer mismatch);
  # replayed rows take the start-of-step policy (decoupled, pi_old: the method's own pass when
  # it made one) or, clipped around their behaviour policy (align_mu), the stored pi_gen: the
  # trainer's log-probs at generation, which is mu itself in float32 and mu without the
  # sampler/trainer mismatch under bfloat16 (the behaviour weight keeps mu).
  replay_prox = replaying and rc.objective != "align_mu"  # static
  full = None
  if c.prox_pass == "all" or (replay_prox and comp.prox_logp_NxT is None):
    full = start_logp(mixed)  # one no-grad pass over the batch
  prox = mu_NxT if full is None or c.prox_pass != "all" else full
  if replaying:
    if replay_prox:
      replayed_prox = full if comp.prox_logp_NxT is None else comp.prox_logp_NxT
    else:
      replayed_prox = comp.gen_logp_NxT
    prox = jnp.where(replayed_N[:, None], replayed_prox, prox)
  batch["prox_logp_NxT"] = prox
  if c.prox_pass == "all":
    fresh_tok = (batch["mask_NxT"] & ~replayed_N[:, None]).astype(jnp.float32)
    extra_metrics["fresh_logp_mismatch"] = (
        jnp.sum(jnp.abs(full - mu_NxT) * fresh_tok) / jnp.maximum(jnp.sum(fresh_tok), 1.0))
    # What this step's rows store as pi_gen: the pass over the fresh rows at their places in
    # the batch (rows 0..N-1; POPO's replaced ineffective groups are not in the batch and keep
    # mu, which matters only for POPO-ineff, whose stored ineffective groups have advantage 0).
    fresh_gen = jnp.where(replayed_N[:n, None], rollout.behaviour_logp_NxT, full[:n])
    ctx = ctx.replace(gen_logp_BxGxT=fresh_gen.reshape(fresh.behaviour_logp_NxT.shape))
  if replaying:
    if rc.objective == "pi_old":
      # Replayed rows as if the current policy had sampled them: mu := pi_prox, so w = 1.
      batch["behaviour_logp_NxT"] = jnp.where(replayed_N[:, None], batch["prox_logp_NxT"],
                                              batch["behaviour_logp_NxT"])
    # The loss pass measures how far pi_theta is from each replayed row's pi_gen.
    batch["replay_gen_logp_NxT"] = comp.gen_logp_NxT
    batch["replayed_N"] = replayed_N
    extra_metrics.update(_replay_age_metrics(batch["mask_NxT"], replayed_N, mixed.version_N,
                                             state.step))
    extra_metrics.update(comp.metrics)
  adv_N = batch["advantages_N"]
  if c.effective_signal != c.reward_signal:
    teaches_B = jnp.any(jnp.abs(adv_BxG) > 1e-6, axis=-1)
    extra_metrics["effective_advantage_disagree"] = jnp.sum(
        (teaches_B != effective_B).astype(jnp.float32))

  use_kl = c.loss.kl_coef > 0
  if use_kl:
    ref_logp, _ = _policy_logprobs(graphdef, jax.lax.stop_gradient(ref_params), batch, c)
    batch["ref_logp_NxT"] = jax.lax.stop_gradient(ref_logp)

  def loss_fn(params, mb, grouped):
    logp, entropy = _policy_logprobs(graphdef, params, mb, c, c.compute_entropy,
                                     remat=c.remat == "layer", grouped=grouped)
    loss, aux = losses.policy_loss(logp, mb["prox_logp_NxT"], mb["behaviour_logp_NxT"],
                                   mb["advantages_N"], mb["mask_NxT"], c.loss,
                                   ref_logp_NxT=mb.get("ref_logp_NxT"), entropy_NxT=entropy)
    if replaying:
      aux.update(_replay_drift_sums(logp, mb, c.loss.is_cap))
    return loss, aux

  def minibatch_update(carry, mb):
    params, opt_state = carry
    grad_fn = lambda grouped: functools.partial(
        jax.value_and_grad(loss_fn, has_aux=True), grouped=grouped)
    if _grouped_pass_possible(mb["completion_ids_NxT"].shape[0], c):
      # The check around the whole gradient, so that each branch is a plain forward+backward.
      repeat = prompts_repeat(mb["prompt_ids_NxP"], mb["prompt_mask_NxP"], c.group_size)
      (loss, aux), grads = jax.lax.cond(repeat, grad_fn(True), grad_fn(False), params, mb)
    else:
      (loss, aux), grads = grad_fn(False)(params, mb)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    out = {"loss": loss, "grad_norm": optax.tree.norm(grads), **aux}
    # The rate this update used, when the optimiser exposes it (optax.inject_hyperparams).
    lr = optax.tree_utils.tree_get(opt_state, "learning_rate",
                                   filtering=lambda _, v: isinstance(v, jax.Array))
    if lr is not None:
      out["learning_rate"] = jnp.asarray(lr, jnp.float32)
    return (params, opt_state), out

  def epoch(carry, key):
    perm = _epoch_order(key, rows, c)
    # Under a mesh each minibatch's rows are split like the batch (the scan runs over the
    # unsplit minibatch axis).
    shaped = jax.tree.map(
        lambda x: constrain(
            x[perm].reshape((c.num_minibatches, rows // c.num_minibatches) + x.shape[1:]),
            (None, "batch")), batch)
    return jax.lax.scan(minibatch_update, carry, shaped)

  (params, opt_state), per_update = jax.lax.scan(
      epoch, (state.params, state.opt_state), keys.shuffle(rng, state.step, c.num_epochs))

  metrics = {k: jnp.mean(v) for k, v in per_update.items() if not k.startswith("_")}
  if replaying:
    metrics.update(_replay_drift_metrics(per_update))
  # Averages over what is real: the fresh rows (and groups) with at least one completion token
  # (an allocator's empty groups are padding), and the update batch's rows that count in the
  # loss (masked replay slots, dropped groups and padding do not).
  fresh_row_N = jnp.any(rollout.completion_mask_NxT, axis=-1)
  fresh_group_B = jnp.any(fresh_row_N.reshape(b, g), axis=-1)
  loss_row_N = jnp.any(batch["mask_NxT"], axis=-1)
  lengths_N = jnp.sum(rollout.completion_mask_NxT, axis=-1).astype(jnp.float32)
  metrics.update(
      grad_norm_max=jnp.max(per_update["grad_norm"]),
      **({"learning_rate": per_update["learning_rate"][-1, -1]}
         if "learning_rate" in per_update else {}),
      reward_mean=_mean_over(rollout.scores_N, fresh_row_N),
      success_mean=_mean_over(rollout.success_N, fresh_row_N),
      effective_fraction=_mean_over(effective_B, fresh_group_B),
      advantage_abs_mean=_mean_over(jnp.abs(adv_N), loss_row_N),
      completion_length_mean=_mean_over(lengths_N, fresh_row_N),
      # Fraction of the loss's rows whose advantage is non-zero: the rows that teach.
      nonzero_advantage_fraction=_mean_over(jnp.abs(adv_N) > 1e-8, loss_row_N),
      loss_rows=jnp.sum(loss_row_N.astype(jnp.float32)),
  )
  # After selection and the update: nothing is replayed in the step that produced it.
  replay, insert_metrics = rc.after_update(ctx, replay, comp)
  extra_metrics.update(insert_metrics)
  if replaying:
    extra_metrics["buffer_occupancy"] = jnp.mean(replay.valid_C.astype(jnp.float32))
  metrics.update(extra_metrics)
  metrics["ineffective_fraction"] = 1.0 - metrics["effective_fraction"]
  # NaN/inf guard, on the device: a non-finite loss or gradient anywhere in the step leaves
  # parameters, optimiser state (so the schedule's count too) and buffer exactly as they came
  # in; the host counts the skips (metric "skipped") and stops after too many in a row.
  finite = (jnp.all(jnp.isfinite(per_update["loss"]))
            & jnp.all(jnp.isfinite(per_update["grad_norm"])))
  keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  params, opt_state = keep((params, opt_state), (state.params, state.opt_state))
  replay = keep(replay, replay_in)
  metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
  new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, replay, metrics


def _rows_batch(rows: Rollout) -> dict:
  """The token arrays a log-prob pass reads, by name."""
  return {"prompt_ids_NxP": rows.prompt_ids_NxP, "prompt_mask_NxP": rows.prompt_mask_NxP,
          "completion_ids_NxT": rows.completion_ids_NxT}


def _mean_over(x: jax.Array, where: jax.Array) -> jax.Array:
  """Mean of ``x`` over the entries where ``where`` (0 when there are none), float32."""
  w = where.astype(jnp.float32)
  return jnp.sum(x.astype(jnp.float32) * w) / jnp.maximum(jnp.sum(w), 1.0)


def _replay_age_metrics(mask_NxT, replayed_N, version_N, step) -> dict:
  """Rows replayed in the loss and their age in train steps (step - version)."""
  used_N = replayed_N & jnp.any(mask_NxT, axis=-1)
  age_N = (step - version_N).astype(jnp.float32)
  return {"replay_rows": jnp.sum(used_N.astype(jnp.float32)),
          "replay_age_mean": _mean_over(age_N, used_N),
          "replay_age_max": jnp.max(jnp.where(used_N, age_N, 0.0))}


def _replay_drift_sums(logp_NxT, mb, is_cap: float) -> dict:
  """Per-update sums over the minibatch's replayed tokens of the policy's divergence from each
  row's pi_gen, from the loss pass's own log pi_theta (whatever the objective sets pi_prox and
  mu to): ``_sum/`` keys are summed and ``_max/`` keys maxed over the updates, then divided by
  ``_replay_drift_metrics``."""
  tok = mb["mask_NxT"] & mb["replayed_N"][:, None]
  tok_f = tok.astype(jnp.float32)
  log_r = jax.lax.stop_gradient(logp_NxT.astype(jnp.float32)) - mb["replay_gen_logp_NxT"]
  r = jnp.exp(jnp.clip(log_r, -20.0, 20.0))
  return {"_sum/replay_tokens": jnp.sum(tok_f),
          "_sum/replay_sq_log_ratio": jnp.sum(jnp.square(log_r) * tok_f),
          "_sum/replay_ratio": jnp.sum(r * tok_f),
          "_sum/replay_over_cap": jnp.sum((r > is_cap) * tok_f),
          "_max/replay_ratio": jnp.max(jnp.where(tok, r, 0.0))}


def _replay_drift_metrics(per_update: dict) -> dict:
  """Replay diagnostics over every update's replayed tokens (``_replay_drift_sums``):
  replay_drift = mean (log pi_theta - log pi_gen)^2; replay_is_weight_mean / max = pi_theta /
  pi_gen, the importance weight of the policy being trained against the one that generated
  the row (pi_gen = mu in float32); replay_is_capped_frac = share of those above ``is_cap``."""
  tokens = jnp.maximum(jnp.sum(per_update["_sum/replay_tokens"]), 1.0)
  total = lambda name: jnp.sum(per_update[f"_sum/{name}"]) / tokens
  return {"replay_drift": total("replay_sq_log_ratio"),
          "replay_is_weight_mean": total("replay_ratio"),
          "replay_is_weight_max": jnp.max(per_update["_max/replay_ratio"]),
          "replay_is_capped_frac": total("replay_over_cap")}


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
