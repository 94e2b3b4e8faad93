"""Shared-prompt passes: each prompt of a group-major batch computed once, same numbers.

The sampler's prefill (``SamplingConfig.prompt_group``), the teacher-forced log-prob pass
(``Qwen3.grouped_hidden_states`` via ``prompt_group``) and the train step (``shared_prompts``)
must give what the per-row passes give; the no-grad passes fall back to them when the rows
do not repeat, and the train step, whose gradient takes the grouped pass statically, skips
such a batch.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.generate.logprobs import completion_logprobs_and_entropy
from grpo_jax.models.causal_lm import prompts_repeat
from grpo_jax.rl import losses
from grpo_jax.rl import step as step_lib
from grpo_jax.rl import update as update_lib
from grpo_jax.rl.replay import init_replay
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout

B, G, P, T = 3, 4, 6, 5
N = B * G


@pytest.fixture(scope="module")
def batch():
  """Group-major prompts (prompt i // G in row i), left padded 0, 2 and 5 tokens."""
  rng = np.random.RandomState(0)
  ids = rng.randint(6, 128, (B, P)).astype(np.int32)
  mask = np.ones((B, P), bool)
  mask[1, :2] = False
  mask[2, :5] = False  # one real token
  ids[~mask] = 0
  completion = rng.randint(6, 128, (N, T)).astype(np.int32)
  weights = rng.randn(N, T).astype(np.float32)
  return (jnp.asarray(np.repeat(ids, G, 0)), jnp.asarray(np.repeat(mask, G, 0)),
          jnp.asarray(completion), jnp.asarray(weights))


def _broken(batch):
  """The batch with one row's prompt changed: the runs no longer repeat."""
  ids = np.asarray(batch[0]).copy()
  ids[G + 1, -1] += 1
  return (jnp.asarray(ids),) + batch[1:]


def test_prompts_repeat(batch):
  ids, mask = batch[0], batch[1]
  assert bool(prompts_repeat(ids, mask, G))
  assert bool(prompts_repeat(ids, mask, 1))
  assert not bool(prompts_repeat(_broken(batch)[0], mask, G))
  # Same ids, different padding in one row of a run.
  other_mask = np.asarray(mask).copy()
  other_mask[0, 0] = False
  assert not bool(prompts_repeat(ids, jnp.asarray(other_mask), G))
  assert not bool(prompts_repeat(ids[:N - 1], mask[:N - 1], G))  # N not a multiple of G


@pytest.fixture(scope="module")
def logprob_runs(split, batch):
  """{(group, broken, check): (logp, entropy, grads)} in one jit."""
  graphdef, params = split
  keys = [(1, False, True), (G, False, True), (G, False, False), (1, True, True),
          (G, True, True)]

  def run(params):
    out = []
    for group, broken, check in keys:
      ids, mask, completion, w = _broken(batch) if broken else batch

      def loss(params):
        logp, ent = completion_logprobs_and_entropy(
            nnx.merge(graphdef, params), ids, mask, completion, 0.7, True,
            prompt_group=group, check_prompts=check)
        return jnp.sum(logp * w) + 0.1 * jnp.sum(ent * w), (logp, ent)

      (_, (logp, ent)), grads = jax.value_and_grad(loss, has_aux=True)(params)
      out.append((logp, ent, grads))
    return out

  return dict(zip(keys, jax.jit(run)(params)))


def _max_rel(a, b):
  return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(x)) + 1e-12))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("check", [True, False])
def test_grouped_logprobs_entropy_and_gradients_equal_per_row(logprob_runs, check):
  plain, grouped = logprob_runs[(1, False, True)], logprob_runs[(G, False, check)]
  # float32 sums in another order: agreement to a few ulps of the O(5) log-probs, while a
  # wrong key set, position or mask changes them by O(0.1) or more.
  np.testing.assert_allclose(grouped[0], plain[0], atol=2e-5)
  np.testing.assert_allclose(grouped[1], plain[1], atol=2e-5)
  assert _max_rel(grouped[2], plain[2]) < 1e-4


@pytest.mark.parametrize("query_block,remat", [(2, False), (3, True)])
def test_grouped_pass_with_query_blocks_and_remat(split, batch, logprob_runs, query_block, remat):
  """Queries in blocks (3 leaves a padded block of the T' = 4 completion queries; both split
  the P = 6 prompt queries) and per-layer remat: the per-row pass's log-probs and gradients."""
  graphdef, params = split
  ids, mask, completion, w = batch

  def loss(params):
    logp, ent = completion_logprobs_and_entropy(
        nnx.merge(graphdef, params), ids, mask, completion, 0.7, True, remat=remat,
        query_block=query_block, prompt_group=G, check_prompts=False)
    return jnp.sum(logp * w) + 0.1 * jnp.sum(ent * w), (logp, ent)

  (_, (logp, ent)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  plain = logprob_runs[(1, False, True)]
  np.testing.assert_allclose(logp, plain[0], atol=2e-5)
  np.testing.assert_allclose(ent, plain[1], atol=2e-5)
  assert _max_rel(grads, plain[2]) < 1e-4


def test_rows_that_do_not_repeat_fall_back_to_the_per_row_pass(logprob_runs):
  plain, checked = logprob_runs[(1, True, True)], logprob_runs[(G, True, True)]
  np.testing.assert_array_equal(checked[0], plain[0])  # the same pass, bit for bit
  # and the changed row really differs from the unbroken batch's
  assert float(jnp.max(jnp.abs(plain[0][G + 1] - logprob_runs[(1, False, True)][0][G + 1]))) > 1e-3


@pytest.mark.parametrize("broken", [False, True])
def test_shared_prefill_samples_the_same_tokens(split, batch, broken):
  graphdef, params = split
  ids, mask = (_broken(batch) if broken else batch)[:2]
  outs = []
  for group in (1, G):
    config = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(5,), pad_id=0,
                                        temperature=1.0, prompt_group=group)
    outs.append(sampler_lib.make_sampler(graphdef, config)(params, ids, mask,
                                                           jax.random.key(4)))
  np.testing.assert_array_equal(outs[1].completion_ids, outs[0].completion_ids)
  np.testing.assert_array_equal(outs[1].lengths, outs[0].lengths)
  np.testing.assert_allclose(outs[1].behaviour_logp, outs[0].behaviour_logp, atol=2e-5)


def test_train_step_with_shared_prompts_equals_per_row(split, batch):
  """Two minibatches of whole groups, one update each: same parameters and metrics."""
  graphdef, params = split
  ids, mask, completion, _ = batch
  rng = np.random.RandomState(1)
  success = np.tile([True, False, True, True], B)  # every group mixed
  rollout = Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=completion,
                    completion_mask=jnp.asarray(rng.rand(N, T) < 0.8),
                    behaviour_logp=jnp.asarray(-rng.rand(N, T) * 4, jnp.float32),
                    truncated=jnp.zeros((N,), bool), scores=jnp.asarray(success, jnp.float32),
                    success=jnp.asarray(success),
                    prompt_id=jnp.repeat(jnp.arange(B), G), version=jnp.zeros((N, T), jnp.int32))
  tx = optax.sgd(0.5)  # updates linear in the gradients (Adam would magnify ~0 ones)
  results = []
  for shared in (False, True):
    config = StepConfig(group_size=G, num_minibatches=B, shared_prompts=shared,
                                 loss=losses.LossConfig(kl_coef=0.05))
    fn = step_lib.make_train_step(graphdef, tx, config)
    state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
    results.append(fn(state, init_replay(0, G, P, T), rollout, jax.tree.map(jnp.copy, params),
                      jax.random.key(0)))
  (plain, _, m_plain), (shared, _, m_shared) = results
  update = lambda new: jax.tree.map(lambda a, b: a - b, new.params, params)
  assert _max_rel(update(shared), update(plain)) < 1e-4
  for k in ("loss", "kl_ref", "grad_norm"):
    assert float(m_shared[k]) == pytest.approx(float(m_plain[k]), rel=1e-4, abs=1e-6), k


def _step_rollout(ids, mask, completion):
  rng = np.random.RandomState(1)
  success = np.tile([True, False, True, True], B)  # every group mixed
  return Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=completion,
                 completion_mask=jnp.asarray(rng.rand(N, T) < 0.8),
                 behaviour_logp=jnp.asarray(-rng.rand(N, T) * 4, jnp.float32),
                 truncated=jnp.zeros((N,), bool), scores=jnp.asarray(success, jnp.float32),
                 success=jnp.asarray(success),
                 prompt_id=jnp.repeat(jnp.arange(B), G), version=jnp.zeros((N, T), jnp.int32))


def test_a_batch_whose_groups_do_not_repeat_is_skipped_not_trained(split, batch):
  """The gradient takes the shared-prompt pass statically (minibatches of whole groups): a
  batch with one row's prompt changed would be trained with its group's first prompt, so
  the step leaves the state as it was and says why (prompts_repeat 2/3: one of the three
  one-group minibatches broken). Mutation (no guard): the parameters move."""
  graphdef, params = split
  ids, mask, completion, _ = _broken(batch)
  tx = optax.sgd(0.5)
  config = StepConfig(group_size=G, num_minibatches=B)
  assert update_lib.minibatches_are_groups(N, config)
  fn = step_lib.make_train_step(graphdef, tx, config)
  state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
  new, _, m = fn(state, init_replay(0, G, P, T), _step_rollout(ids, mask, completion), None,
                 jax.random.key(0))
  assert float(m["skipped"]) == 1.0
  assert float(m["prompts_repeat"]) == pytest.approx(2 / 3)
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def test_which_updates_take_the_shared_prompt_gradient():
  """Statically: whole groups per minibatch (the "groups" shuffle, N a multiple of G x M) and
  a method whose rows are whole groups; rollout-level replay's single rows take the per-row
  pass, as do row shuffles and batches that do not divide into groups."""
  from grpo_jax.rl.replay import prioritized, popo  # pylint: disable=g-import-not-at-top
  base = StepConfig(group_size=G, num_minibatches=B)
  with_ = lambda **kw: dataclasses.replace(base, **kw)
  assert update_lib.minibatches_are_groups(N, base)
  assert update_lib.minibatches_are_groups(N, with_(replay=popo.Popo()))
  assert not update_lib.minibatches_are_groups(
      N, with_(replay=prioritized.PrioritizedReplay()))
  assert not update_lib.minibatches_are_groups(N, with_(shuffle="rows"))
  assert not update_lib.minibatches_are_groups(N, with_(shared_prompts=False))
  assert not update_lib.minibatches_are_groups(N + G, base)  # 4 groups in 3 minibatches


def test_bfloat16_sampler_and_grouped_pass_run_and_track_float32(data_dir, batch):
  """bf16 matmuls through the cached decode and the grouped pass (XLA:CPU lacks some bf16 dot
  forms: a bf16 x bf16 -> f32 product in the cache's attention failed to run once)."""
  import os  # pylint: disable=g-import-not-at-top
  from grpo_jax.models import from_pretrained  # pylint: disable=g-import-not-at-top
  bf16 = from_pretrained(os.fspath(data_dir / "tiny_qwen3"), dtype="bfloat16")
  graphdef, params = nnx.split(bf16)
  ids, mask = batch[:2]
  config = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(5,), pad_id=0,
                                      temperature=1.0, prompt_group=G)
  out = sampler_lib.make_sampler(graphdef, config)(params, ids, mask, jax.random.key(2))
  logp = jax.jit(lambda p: completion_logprobs_and_entropy(
      nnx.merge(graphdef, p), ids, mask, out.completion_ids, prompt_group=G)[0])(params)
  m = np.asarray(out.completion_mask)
  # The sampler's cached bf16 attention and the teacher-forced bf16 pass round differently
  # (hence prox.rows=all under bf16); both follow the same model: log-probs of O(-5) agree
  # to a few 0.1, where a wiring bug gives errors of their own size.
  assert m.sum() > 0
  assert float(np.max(np.abs(np.asarray(logp)[m] - np.asarray(out.behaviour_logp)[m]))) < 0.5
  # The grouped pass rounds as the per-row pass does: the prompt and own-row halves of each
  # attention output are summed in float32 and rounded once. Rounded apart (the mutation),
  # the two passes differ by 0.012 on average under bf16 (measured; up to 0.04).
  per_row = jax.jit(lambda p: completion_logprobs_and_entropy(
      nnx.merge(graphdef, p), ids, mask, out.completion_ids, prompt_group=1)[0])(params)
  assert float(np.mean(np.abs(np.asarray(logp)[m] - np.asarray(per_row)[m]))) < 1e-4
