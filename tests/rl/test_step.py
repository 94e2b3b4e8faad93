"""The jitted train step: one compilation, exact no-ops, loss parity, the update loop, switches."""

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax import random_keys as grpo_keys
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.generate.logprobs import completion_logprobs, completion_logprobs_and_entropy
from grpo_jax.rl import advantages, losses, optim, step as step_lib
from grpo_jax.rl.replay import init_replay
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout, TrainState

B, G, P, T = 2, 4, 5, 6

# Per-row shifts of the behaviour log-probs (times the completion mask): they move rho =
# pi_theta / mu away from 1 row by row, so a loss depends on every advantage and on the
# denominator it is averaged with (at rho = 1 a group-normalised loss is ~0 whatever it is).
SHIFT_N = np.asarray([0.3, -0.2, 0.1, 0.25, -0.15, 0.05, 0.2, -0.1], np.float32)


def _rollout(split, scores, seed=0, success=None, shift=None):
  """B * G fresh rows sampled from the tiny model; ``shift`` [N] is added to log mu."""
  graphdef, params = split
  rng = np.random.RandomState(seed)
  ids = jnp.asarray(np.repeat(rng.randint(6, 128, (B, P)), G, axis=0), jnp.int32)
  mask = jnp.ones((B * G, P), bool)
  cfg = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(5,), pad_id=0)
  out = _sampler(graphdef, cfg)(params, ids, mask, jax.random.key(seed))
  scores = jnp.asarray(scores, jnp.float32)
  success = scores >= 1.0 if success is None else jnp.asarray(success, bool)
  logp = out.behaviour_logp
  if shift is not None:
    logp = logp + jnp.asarray(shift, jnp.float32)[:, None] * out.completion_mask
  return Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=out.completion_ids,
                 completion_mask=out.completion_mask, behaviour_logp=logp,
                 scores=scores, truncated=out.truncated, success=success,
                 prompt_id=jnp.repeat(jnp.arange(B), G), version=jnp.zeros((B * G, T), jnp.int32))


_SAMPLERS = {}


def _sampler(graphdef, cfg):
  """One jitted sampler per model structure, shared by every test module that builds rollouts."""
  key = (graphdef, cfg)
  if key not in _SAMPLERS:
    _SAMPLERS[key] = sampler_lib.make_sampler(graphdef, cfg)
  return _SAMPLERS[key]


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def traced_step(graphdef, tx, config, donate=False):
  """The jitted train step, failing if it is ever traced a second time (recompilation)."""
  chex.clear_trace_counter()

  @chex.assert_max_traces(n=1)
  def traced(*args):
    return step_lib.train_step(graphdef, tx, config, *args)

  return jax.jit(traced, donate_argnums=(0, 1) if donate else ())


MIXED = [1, 0, 0, 1, 0, 1, 0, 0]  # both groups effective
# Unbiased (ddof = 1) GRPO advantages of MIXED, by hand:
# group 0 [1, 0, 0, 1]: mean 0.5, var = 4 * 0.25 / 3 = 1/3, std 0.5773503 ->
#   +-0.5 / (0.5773503 + 1e-6) = +-0.8660239;
# group 1 [0, 1, 0, 0]: mean 0.25, var = (3 * 0.0625 + 0.5625) / 3 = 0.25, std 0.5 ->
#   0.75 / 0.500001 = 1.4999970 and -0.25 / 0.500001 = -0.4999990.
MIXED_ADV = [0.8660239, -0.8660239, -0.8660239, 0.8660239,
             -0.4999990, 1.4999970, -0.4999990, -0.4999990]


def test_no_recompilation_across_steps(split):
  graphdef, params = split
  tx = optax.adam(1e-3)
  config = StepConfig(group_size=G, num_minibatches=2)
  fn = traced_step(graphdef, tx, config, donate=True)
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
  fn = step_lib.make_train_step(graphdef, tx, StepConfig(num_minibatches=1, group_size=G,
                                                                   reward_signal="score"))
  state = step_lib.init_train_state(_copy(params), tx)
  # Every group constant: advantages are exactly 0, so the gradient is 0 and Adam's update is 0.
  rollout = _rollout(split, [1, 1, 1, 1, 0.1, 0.1, 0.1, 0.1])
  state, _, metrics = fn(state, init_replay(0, G, P, T), rollout, None, jax.random.key(0))
  assert float(metrics["effective_fraction"]) == 0.0 and float(metrics["grad_norm"]) == 0.0
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def _perturbed(params, scale=0.05, seed=1):
  """Parameters moved by a fixed random direction (a reference policy that is not the policy)."""
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def test_step_loss_equals_direct_policy_loss_with_kl_to_another_reference(split, tiny_qwen3):
  graphdef, params = split
  tx = optax.sgd(0.0)
  loss_cfg = losses.LossConfig(kl_coef=0.04)
  config = StepConfig(num_minibatches=1, group_size=G, loss=loss_cfg)
  rollout = _rollout(split, MIXED, shift=SHIFT_N)
  ref_params = _perturbed(params)
  fn = step_lib.make_train_step(graphdef, tx, config)
  _, _, metrics = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, G, P, T),
                     rollout, ref_params, jax.random.key(0))
  adv = jnp.asarray(MIXED_ADV)
  args = (rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids)
  logp = completion_logprobs(tiny_qwen3, *args)
  ref_logp = completion_logprobs(nnx.merge(graphdef, ref_params), *args)
  expected, aux = losses.policy_loss(logp, rollout.behaviour_logp, rollout.behaviour_logp,
                                     adv, rollout.completion_mask, loss_cfg,
                                     ref_logp_NxT=ref_logp)
  assert float(metrics["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
  assert float(aux["kl_ref"]) > 1e-4  # the reference really differs from the policy
  assert float(metrics["kl_ref"]) == pytest.approx(float(aux["kl_ref"]), rel=1e-4)
  # With the same advantages but the old ddof = 0 scale the loss would differ:
  adv0 = adv * jnp.asarray([0.5773503 / 0.5] * 4 + [0.5 / 0.4330127] * 4)
  wrong, _ = losses.policy_loss(logp, rollout.behaviour_logp, rollout.behaviour_logp,
                                adv0, rollout.completion_mask, loss_cfg,
                                ref_logp_NxT=ref_logp)
  assert abs(float(wrong) - float(expected)) > 1e-3


@pytest.mark.parametrize("estimator,signal", [("drgrpo", "score"), ("rloo", "success")])
def test_estimator_and_reward_signal_switches(split, tiny_qwen3, estimator, signal):
  graphdef, params = split
  tx = optax.sgd(0.0)
  config = StepConfig(num_minibatches=1, group_size=G, estimator=estimator, reward_signal=signal)
  scores = [1.0, 0.1, 0.0, 1.0, 0.1, 1.0, 0.0, 0.1]
  rollout = _rollout(split, scores, shift=SHIFT_N)
  fn = step_lib.make_train_step(graphdef, tx, config)
  _, _, m = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, G, P, T), rollout,
               None, jax.random.key(0))
  if estimator == "drgrpo":
    # score, r - mean: group 0 [1, .1, 0, 1] mean 0.525; group 1 [.1, 1, 0, .1] mean 0.3.
    adv = [0.475, -0.425, -0.525, 0.475, -0.2, 0.7, -0.3, -0.2]
  else:
    # success [1, 0, 0, 1 | 0, 1, 0, 0], r - mean of the other 3:
    # group 0: 1 - 1/3, 0 - 2/3; group 1: 0 - 1/3, 1 - 0.
    adv = [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1 / 3, 1.0, -1 / 3, -1 / 3]
  logp = completion_logprobs(tiny_qwen3, rollout.prompt_ids, rollout.prompt_mask,
                             rollout.completion_ids)
  expected, _ = losses.policy_loss(logp, rollout.behaviour_logp, rollout.behaviour_logp,
                                   jnp.asarray(adv), rollout.completion_mask,
                                   losses.LossConfig())
  assert float(m["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
  assert float(m["advantage_abs_mean"]) == pytest.approx(np.mean(np.abs(adv)), rel=1e-5)


def test_entropy_bonus_switch(split, tiny_qwen3):
  graphdef, params = split
  tx = optax.sgd(0.0)
  loss_cfg = losses.LossConfig(entropy_coef=0.01)
  config = StepConfig(num_minibatches=1, group_size=G, loss=loss_cfg, compute_entropy=True)
  rollout = _rollout(split, MIXED, shift=SHIFT_N)
  fn = step_lib.make_train_step(graphdef, tx, config)
  _, _, m = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, G, P, T), rollout,
               None, jax.random.key(0))
  logp, ent = completion_logprobs_and_entropy(tiny_qwen3, rollout.prompt_ids,
                                              rollout.prompt_mask, rollout.completion_ids)
  expected, aux = losses.policy_loss(logp, rollout.behaviour_logp,
                                     rollout.behaviour_logp, jnp.asarray(MIXED_ADV),
                                     rollout.completion_mask, loss_cfg, entropy_NxT=ent)
  assert float(m["loss"]) == pytest.approx(float(expected), rel=1e-4, abs=1e-6)
  assert float(m["entropy"]) == pytest.approx(float(aux["entropy"]), rel=1e-5)
  assert float(m["entropy"]) > 0.1  # a real distribution, not a zero placeholder


@pytest.mark.parametrize("shuffle", ["groups", "rows"])
def test_minibatch_epoch_loop_equals_a_reference_loop(split, tiny_qwen3, shuffle):
  """M = 2 minibatches x E = 2 epochs against a plain-Python loop over the same permutations.

  ``shuffle="groups"`` deals whole groups (a permutation of the B groups, each expanded to
  its G rows; the step then runs its shared-prompt passes), ``"rows"`` single rows.

  pi_prox stays the start-of-step policy in every minibatch (here the behaviour log-probs, fresh
  rows), every field is permuted with the same indices, and with a large SGD step the clip is
  active in later minibatches. Mutations this catches: prox recomputed per minibatch, a field
  left unpermuted, one key reused for both epochs, the loss on the wrong rows.
  """
  graphdef, params = split
  m_, e_ = 2, 2
  # SGD at 0.3 already puts 50-80% of the later minibatches' tokens outside the clip. A larger
  # step (3.0 before) makes the trajectory chaotic: a float32 rounding difference between the
  # jitted step and this eager loop moves a token across a clip boundary, whose gradient then
  # differs discontinuously, and the parameters part by 0.03-0.6 relative after 4 updates.
  tx = optax.sgd(0.3)
  loss_cfg = losses.LossConfig()
  config = StepConfig(group_size=G, num_minibatches=m_, num_epochs=e_, loss=loss_cfg,
                               shuffle=shuffle)
  rollout = _rollout(split, MIXED, shift=SHIFT_N)
  assert B % m_ == 0  # whole groups split evenly, so "groups" does not fall back to rows
  fn = step_lib.make_train_step(graphdef, tx, config)
  rng = jax.random.key(3)
  state, _, m = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, G, P, T),
                   rollout, None, rng)

  n = B * G
  adv = jnp.asarray(MIXED_ADV)
  p = _copy(params)
  opt_state = tx.init(p)
  seen_losses, clip_fracs = [], []
  # keys.shuffle(rng, step 0, 2): the step's epoch keys, by hand.
  shuffle_keys = jax.random.split(
      jax.random.fold_in(jax.random.fold_in(rng, 0), grpo_keys.SHUFFLE), e_)
  for key in shuffle_keys:
    if shuffle == "groups":  # group j -> rows j*G .. j*G + G - 1, in the permuted order
      perm = (np.asarray(jax.random.permutation(key, B))[:, None] * G + np.arange(G)).ravel()
    else:
      perm = np.asarray(jax.random.permutation(key, n))
    for rows in np.split(perm, m_):
      def loss_fn(q, rows=rows):
        logp = completion_logprobs(nnx.merge(graphdef, q), rollout.prompt_ids[rows],
                                   rollout.prompt_mask[rows],
                                   rollout.completion_ids[rows])
        mu = rollout.behaviour_logp[rows]
        return losses.policy_loss(logp, mu, mu, adv[rows], rollout.completion_mask[rows],
                                  loss_cfg)
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
      updates, opt_state = tx.update(grads, opt_state, p)
      p = optax.apply_updates(p, updates)
      seen_losses.append(float(loss))
      clip_fracs.append(float(aux["clip_frac_low"]) + float(aux["clip_frac_high"]))
  assert float(m["loss"]) == pytest.approx(np.mean(seen_losses), rel=1e-4, abs=1e-6)
  assert clip_fracs[0] < clip_fracs[-1] and max(clip_fracs[1:]) > 0.05  # the clip acts later
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(p)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_learning_rate_counts_train_steps_not_minibatch_updates(split):
  """Cosine schedule, warm-up 2 of 6 train steps, peak 1e-3, 4 minibatches per step.

  optax.warmup_cosine_decay_schedule(0, 1e-3, 2, 6) by train step k:
    k = 0: 0; k = 1: 1e-3 * 1/2 = 5e-4; k = 2: 1e-3 (warm-up end);
    cosine over the remaining 4 steps, lr = 1e-3 * (1 + cos(pi * (k - 2) / 4)) / 2:
    k = 3: 8.5355e-4; k = 4: 5e-4; k = 5: 1.4645e-4; (k = 6 = total_steps would be 0).
  Counting minibatch updates instead (the bug), step 1 would read count 7 -> well past warm-up.
  """
  graphdef, params = split
  cfg = ml_collections.ConfigDict({
      "total_steps": 6,
      "rl": {"num_minibatches": 4, "num_epochs": 1},
      "opt": {"learning_rate": 1e-3, "warmup_steps": 2, "schedule": "cosine", "grad_clip": 1.0,
              "b1": 0.9, "b2": 0.999, "weight_decay": 0.0}})
  tx = optim.make_optimizer(optim.OptimizerSettings.from_config(cfg))
  fn = step_lib.make_train_step(graphdef, tx, StepConfig(group_size=G,
                                                                   num_minibatches=4))
  state = step_lib.init_train_state(_copy(params), tx)
  rollout = _rollout(split, MIXED)
  replay = init_replay(0, G, P, T)
  seen = []
  for _ in range(6):
    state, replay, m = fn(state, replay, rollout, None, jax.random.key(0))
    seen.append(float(m["learning_rate"]))
  expected = [0.0, 5e-4, 1e-3, 8.5355339e-4, 5e-4, 1.4644661e-4]
  np.testing.assert_allclose(seen, expected, rtol=1e-5, atol=1e-10)


def test_update_raises_logprob_of_positive_advantage_rows(split, tiny_qwen3):
  graphdef, params = split
  tx = optax.sgd(0.5)
  rollout = _rollout(split, MIXED)
  fn = step_lib.make_train_step(graphdef, tx, StepConfig(num_minibatches=1, group_size=G))
  state, _, _ = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, G, P, T),
                   rollout, None, jax.random.key(0))
  seq_logp = lambda p: jnp.sum(completion_logprobs(
      nnx.merge(graphdef, p), rollout.prompt_ids, rollout.prompt_mask,
      rollout.completion_ids) * rollout.completion_mask, axis=-1)
  delta = np.asarray(seq_logp(state.params) - seq_logp(params))
  pos = np.asarray(MIXED, bool)
  assert delta[pos].mean() > 0 > delta[~pos].mean()


def test_effective_and_advantage_disagreement_is_counted(split):
  """Advantages on the score, effectiveness on success: a group of 0 / 0.1 format scores has
  non-zero advantages but is ineffective (counted once); a constant-score group agrees."""
  graphdef, params = split
  tx = optax.sgd(0.0)
  config = StepConfig(num_minibatches=1,
                      group_size=G, reward_signal="score", effective_signal="success")
  fn = step_lib.make_train_step(graphdef, tx, config)
  rollout = _rollout(split, [0.0, 0.1, 0.0, 0.1, 1, 1, 1, 1])
  _, _, m = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, G, P, T), rollout,
               None, jax.random.key(0))
  assert float(m["effective_advantage_disagree"]) == 1.0
  assert float(m["effective_fraction"]) == 0.0
  assert advantages.effective_groups(jnp.asarray([[0.0, 0.1]])).tolist() == [True]


def test_prox_pass_all_measures_the_sampler_mismatch(split):
  """prox_pass="all": pi_prox from the step's own forward for fresh rows too; the measured
  |log pi_prox - log mu| equals the mean |shift| we put into mu (float32 forward and decode agree
  to ~1e-6). SHIFT_N's mean absolute value is (.3+.2+.1+.25+.15+.05+.2+.1)/8 = 0.16875 when
  every row has the same number of tokens; weighted by tokens in general, computed below."""
  graphdef, params = split
  tx = optax.sgd(0.0)
  fn = step_lib.make_train_step(graphdef, tx, StepConfig(num_minibatches=1,
                                                         group_size=G, prox_pass="all"))
  rollout = _rollout(split, MIXED, shift=SHIFT_N)
  _, _, m = fn(step_lib.init_train_state(_copy(params), tx), init_replay(0, G, P, T), rollout,
               None, jax.random.key(0))
  tokens = np.asarray(rollout.completion_mask.sum(-1), np.float64)
  expected = np.sum(np.abs(SHIFT_N) * tokens) / tokens.sum()
  assert float(m["fresh_logp_mismatch"]) == pytest.approx(expected, abs=1e-4)
  # Fresh rows then carry the behaviour weight pi_prox / mu = exp(-shift) (capped at 2).
  assert float(m["is_weight_mean"]) != pytest.approx(1.0, abs=1e-3)


def test_step_config_validation():
  with pytest.raises(ValueError, match="reward_signal"):
    StepConfig(num_minibatches=1, group_size=G, reward_signal="accuracy")
  with pytest.raises(ValueError, match="prox_pass"):
    StepConfig(num_minibatches=1, group_size=G, prox_pass="some")


@pytest.mark.parametrize("field", ["scores", "behaviour_logp"])
def test_non_finite_input_skips_the_update_on_device(split, field):
  """A NaN score (-> NaN advantages) or an inf behaviour log-prob (-> non-finite loss) leaves
  parameters, optimiser state and the replay buffer exactly as they came in; the step counter
  advances and the skip is reported. The next, finite step updates again."""
  from grpo_jax.rl.replay import popo  # pylint: disable=g-import-not-at-top
  graphdef, params = split
  tx = optax.adam(1e-2)
  fn = step_lib.make_train_step(graphdef, tx, StepConfig(num_minibatches=1, 
      group_size=G, replay=popo.Popo(), reward_signal="score"))
  state = step_lib.init_train_state(_copy(params), tx)
  good = _rollout(split, MIXED)
  state, replay, m = fn(state, init_replay(4, G, P, T), good, None, jax.random.key(0))
  assert float(m["skipped"]) == 0.0 and int(replay.num_inserted) == 2
  before = jax.tree.map(np.asarray, (state.params, state.opt_state, replay))
  bad = good.replace(**{field: getattr(good, field).at[0].set(
      jnp.nan if field == "scores" else jnp.inf)})
  state, replay, m = fn(state, replay, bad, None, jax.random.key(1))
  assert float(m["skipped"]) == 1.0 and int(state.step) == 2
  after = jax.tree.map(np.asarray, (state.params, state.opt_state, replay))
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
    np.testing.assert_array_equal(a, b)
  state, _, m = fn(state, replay, good, None, jax.random.key(2))
  assert float(m["skipped"]) == 0.0
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before[0]),
                                                   jax.tree.leaves(state.params))]
  assert any(moved)


def test_a_step_built_twice_with_the_same_settings_is_one_jitted_function(split):
  """A run built twice in one process (a resume, the next seed) reuses its compiled step and
  sampler: equal settings give the same optimiser object, so the same cached step; equal
  layouts built separately compare equal. Any setting that changes the program gives another."""
  from grpo_jax import sharding as sharding_lib  # pylint: disable=g-import-not-at-top
  from grpo_jax.models import family  # pylint: disable=g-import-not-at-top
  graphdef, params = split

  def opt_config(lr):
    return optim.OptimizerSettings.from_config(ml_collections.ConfigDict({
        "total_steps": 6, "rl": {"num_minibatches": 2, "num_epochs": 1},
        "opt": {"learning_rate": lr, "warmup_steps": 2, "schedule": "constant",
                "grad_clip": 1.0, "b1": 0.9, "b2": 0.999, "weight_decay": 0.0}}))

  tx = optim.make_optimizer(opt_config(1e-3))
  assert optim.make_optimizer(opt_config(1e-3)) is tx
  assert optim.make_optimizer(opt_config(2e-3)) is not tx
  config = StepConfig(num_minibatches=1, group_size=G)
  fn = step_lib.cached_train_step(graphdef, tx, config)
  assert step_lib.cached_train_step(graphdef, tx, StepConfig(num_minibatches=1, group_size=G)) is fn
  assert step_lib.cached_train_step(graphdef, tx, StepConfig(num_minibatches=1,
                                                             group_size=G, num_epochs=2)) is not fn
  assert step_lib.cached_train_step(graphdef, optim.make_optimizer(opt_config(2e-3)),
                                    config) is not fn
  # Two layouts of one mesh, each built from its own (equal) state: one key.
  mesh = jax.make_mesh((1, 1, 1), sharding_lib.MESH_AXES)
  state = jax.eval_shape(lambda p: TrainState(
      step=jnp.zeros((), jnp.int32), params=p, opt_state=tx.init(p)), params)
  replay = jax.eval_shape(lambda: init_replay(0, G, P, T))
  layout = lambda: sharding_lib.step_shardings(mesh, state, replay, family.param_axes())
  assert layout() == layout() and hash(layout()) == hash(layout())
  assert step_lib.cached_train_step(graphdef, tx, config, layout()) is (
      step_lib.cached_train_step(graphdef, tx, config, layout()))
  assert layout() != sharding_lib.step_shardings(mesh, state, replay, family.param_axes(),
                                                 ref_params=params)
  sampling = sampler_lib.SamplingConfig(max_new_tokens=4, eos_ids=(1,), pad_id=0)
  assert sampler_lib.cached_sampler(graphdef, sampling) is sampler_lib.cached_sampler(
      graphdef, sampler_lib.SamplingConfig(max_new_tokens=4, eos_ids=(1,), pad_id=0))
