"""Replay diagnostics and pi_gen in the train step, for every method: replayed rows from older
parameters report their drift under every objective, and under bfloat16 a group replayed at
the parameters that produced it has drift 0 and ratio 1 (its stored pi_gen is the trainer's)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.models import from_pretrained
from grpo_jax.rl import replay as replay_lib, step as step_lib
from grpo_jax.rl.replay import headroom, popo, prioritized
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout
from tests.rl.test_step import B, G, P, T, _copy, _rollout

MIXED = [1, 0, 0, 1, 0, 1, 0, 0]  # both groups effective: stored
ONE_INEFFECTIVE = [1, 0, 0, 1, 0, 0, 0, 0]  # group 1 all wrong: POPO refills it

METHODS = {
    # name: (replay config, buffer capacity)
    "popo-decoupled": (popo.Popo(objective="decoupled"), 4),
    "popo-pi_old": (popo.Popo(objective="pi_old"), 4),
    "popo-align_mu": (popo.Popo(objective="align_mu"), 4),
    "rollout-align_mu": (prioritized.PrioritizedReplay(warmup_steps=0), 32),
    # tau = 1e3: the gate admits whatever drift one Adam step causes (D ~ 13 at lr 1e-2).
    "headroom-align_mu": (headroom.HeadroomDrift(slots=2, candidates=2, tau=1e3), 4),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_replayed_rows_from_older_parameters_report_their_drift(split, name):
  """Step 0 (Adam 1e-2) stores its groups; step 1 replays them under the parameters one update
  later. The drift (log pi_theta - log pi_gen)^2 and the weight pi_theta / pi_gen are measured
  on the loss pass's own log-probs, so they are > 0 and != 1 under every objective. Mutation:
  the old diagnostics compared pi_prox with mu after the objective set one to the other, and
  read exactly 0 and 1 under pi_old and align_mu (the default of rollout replay and
  Headroom-Drift)."""
  graphdef, params = split
  cfg, capacity = METHODS[name]
  tx = optax.adam(1e-2)
  fn = step_lib.make_train_step(graphdef, tx, StepConfig(num_minibatches=1,
                                                         group_size=G, replay=cfg))
  state = step_lib.init_train_state(_copy(params), tx)
  replay = replay_lib.init_replay(capacity, cfg.entry_size(G), P, T)
  state, replay, m0 = fn(state, replay, _rollout(split, MIXED, seed=1), None, jax.random.key(0))
  assert float(m0["replay_rows"]) == 0.0 and int(replay.num_inserted) > 0
  _, _, m = fn(state, replay, _rollout(split, ONE_INEFFECTIVE, seed=2), None, jax.random.key(1))
  assert float(m["replay_rows"]) >= G and float(m["replay_age_mean"]) == 1.0
  assert float(m["replay_drift"]) > 1e-6
  assert abs(float(m["replay_is_weight_mean"]) - 1.0) > 1e-4
  assert float(m["replay_is_weight_max"]) > float(m["replay_is_weight_mean"])


def _bf16_rollout(graphdef, params, seed, scores):
  """B * G rows sampled by the bf16 model, mu recorded by its (cached, bf16) sampler."""
  rng = np.random.RandomState(seed)
  ids = jnp.asarray(np.repeat(rng.randint(6, 128, (B, P)), G, axis=0), jnp.int32)
  mask = jnp.ones((B * G, P), bool)
  cfg = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(5,), pad_id=0, prompt_group=G)
  out = sampler_lib.make_sampler(graphdef, cfg)(params, ids, mask, jax.random.key(seed))
  scores = jnp.asarray(scores, jnp.float32)
  return Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=out.completion_ids,
                 completion_mask=out.completion_mask, behaviour_logp=out.behaviour_logp,
                 scores=scores, truncated=out.truncated, success=scores >= 1.0,
                 prompt_id=jnp.repeat(jnp.arange(B), G),
                 version=jnp.zeros(out.completion_ids.shape, jnp.int32))


def test_bf16_group_replayed_at_its_own_parameters_has_no_drift(data_dir):
  """bf16 matmuls, prox_pass="all", learning rate 0: Headroom-Drift stores step 0's groups and
  replays them at step 1 under the same parameters. Their D (the candidate pass against the
  stored pi_gen) is exactly 0 and the loss pass's pi_theta / pi_gen exactly 1, although the
  sampler's mu differs from the trainer's log-probs (fresh_logp_mismatch > 0). Mutation: store
  the sampler's mu as pi_gen (the code before) and D measures the sampler/trainer mismatch."""
  bf16 = from_pretrained(os.fspath(data_dir / "tiny_qwen3"), dtype="bfloat16")
  graphdef, params = nnx.split(bf16)
  cfg = headroom.HeadroomDrift(slots=2, candidates=2, tau=1e-3)
  tx = optax.sgd(0.0)
  fn = step_lib.make_train_step(graphdef, tx, StepConfig(num_minibatches=1, 
      group_size=G, replay=cfg, prox_pass="all"))
  state = step_lib.init_train_state(params, tx)
  replay = replay_lib.init_replay(4, G, P, T)
  state, replay, m0 = fn(state, replay, _bf16_rollout(graphdef, state.params, 1, MIXED), None,
                         jax.random.key(0))
  assert float(m0["fresh_logp_mismatch"]) > 0.0
  stored = np.asarray(replay.rollouts.completion_mask[:2])
  gen = np.asarray(replay.gen_logp[:2])[stored]
  mu = np.asarray(replay.rollouts.behaviour_logp[:2])[stored]
  assert np.any(gen != mu)  # the stored pi_gen is the trainer's, not the sampler's mu
  _, _, m = fn(state, replay, _bf16_rollout(graphdef, state.params, 2, ONE_INEFFECTIVE), None,
               jax.random.key(1))
  assert float(m["headroom_admitted"]) == 2.0
  assert float(m["headroom_candidate_drift"]) == 0.0
  assert float(m["replay_drift"]) == 0.0
  assert float(m["replay_is_weight_mean"]) == 1.0
