"""``rl.packing=tokens`` in the train step: the same losses, gradients and metrics as the padded
layout (``none``), to float32 rounding, for each objective, aggregation, replay method and
update schedule; rows of every length (empty, one token, full) in the batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax.rl import losses, replay as replay_lib, step as step_lib
from grpo_jax.rl.policy_losses import cispo, gspo
from grpo_jax.rl.replay import popo, prioritized
from grpo_jax.rl.replay import init_replay
from grpo_jax.rl.step_config import StepConfig
from tests.rl.test_popo import ONE_INEFFECTIVE, _buffer_with
from tests.rl.test_step import G, MIXED, P, SHIFT_N, T, _copy, _rollout

# Completion lengths of the 8 rows: an empty row, one-token rows and full ones (T = 6).
LENGTHS = [6, 1, 0, 4, 2, 6, 3, 5]


def _cut(rollout):
  """The rollout with each row's completion cut to LENGTHS (its mask and mu past the cut)."""
  mask = jnp.arange(T)[None] < jnp.asarray(LENGTHS)[:, None]
  mask = mask & rollout.completion_mask | (mask & ~rollout.completion_mask.any(-1)[:, None])
  return rollout.replace(completion_mask=mask,
                         behaviour_logp=jnp.where(mask, rollout.behaviour_logp, 0.0))


def _both(split, rollout, buffer=None, ref=None, **kw):
  """(none's, tokens') (state, metrics) after one step from the same inputs, SGD lr 1."""
  graphdef, params = split
  out = []
  for packing in ("none", "tokens"):
    tx = optax.sgd(1.0)
    fn = step_lib.make_train_step(graphdef, tx, StepConfig(
        group_size=G, packing=packing, **{"num_minibatches": 1, **kw}))
    state = step_lib.init_train_state(_copy(params), tx)
    buf = init_replay(0, G, P, T) if buffer is None else jax.tree.map(jnp.copy, buffer)
    state, _, metrics = fn(state, buf, rollout, ref, jax.random.key(0))
    out.append((state, {k: float(v) for k, v in metrics.items()}))
  return out


def _assert_same(split, runs, rtol=2e-4):
  (s_none, m_none), (s_tok, m_tok) = runs
  assert set(m_none) == set(m_tok)
  # The ones that differ: the layout's fractions of real tokens (loss, whole-batch, gathered
  # pi_prox and Headroom's candidate passes).
  for key in (k for k in m_none if not k.endswith("useful_fraction")):
    assert m_tok[key] == pytest.approx(m_none[key], rel=rtol, abs=2e-6), key
  moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(split[1]),
                                                          jax.tree.leaves(s_none.params)))
  assert moved > 1e-4
  for a, b in zip(jax.tree.leaves(s_none.params), jax.tree.leaves(s_tok.params)):
    np.testing.assert_allclose(a, b, atol=2e-4 * moved)


@pytest.mark.parametrize("case", ["ppo-token-mean-entropy", "gspo-seq-mean-kl",
                                  "cispo-sum-norm-all"])
def test_packed_step_equals_padded(split, case):
  rollout = _cut(_rollout(split, MIXED, shift=SHIFT_N))
  kw, ref = {}, None
  if case == "ppo-token-mean-entropy":
    # Two epochs of two minibatches: the second update's ratio moves off 1.
    kw = dict(loss=losses.LossConfig(aggregation="token-mean", entropy_coef=0.01),
              compute_entropy=True, num_minibatches=2, num_epochs=2)
  elif case == "gspo-seq-mean-kl":
    kw = dict(loss=losses.LossConfig(policy=gspo.Gspo(), kl_coef=0.05), remat="layer")
    ref = jax.tree.map(lambda x: x * 0.99, split[1])  # the KL's reference pass, packed too
  else:
    kw = dict(loss=losses.LossConfig(policy=cispo.Cispo(), aggregation="seq-mean-token-sum-norm"),
              prox_pass="all", logprob_chunk=8)
  runs = _both(split, rollout, ref=ref, **kw)
  _assert_same(split, runs)
  if case == "gspo-seq-mean-kl":
    # One update over both groups (prompts of 5 real tokens; LENGTHS sum to 27): 2 x 5 + 27 =
    # 37 real tokens. none: the shared-prompt pass, 2 x 5 + 8 x (6 - 1) = 50 positions; it
    # never feeds the last token of the two rows reaching T = 6, so 37 - 2 = 35 of them are
    # real: 0.70.
    # tokens: packed rows of C = 5 + 6 = 11; rows longest first (prompt + completion):
    #   row 0 (11) -> packed row 0 (full); row 5 (11) -> 1; row 7 (10) -> 2; row 3 (9) -> 3;
    #   row 6 (8) -> 4; row 4 (group 1's copy in 4: +2) -> 4 (10); row 1 (group 0's copy in 3:
    #   +1) -> 3 (10); row 2 (empty, group 0's copy in 0: +0) -> 0.
    # Five packed rows of 11, one a pass: 37 / 55 = 0.6727. At this tiny shape the prompt (5
    # of 11 slots) is copied into four packed rows, so packing computes more than the shared-
    # prompt pass; at reasoning lengths (P << T) it is the other way round.
    assert runs[0][1]["update_useful_fraction"] == pytest.approx(35 / 50)
    assert runs[1][1]["update_useful_fraction"] == pytest.approx(37 / 55)
    # The reference pass runs over the same 8 rows: the same fractions.
    assert runs[0][1]["batch_pass_useful_fraction"] == pytest.approx(35 / 50)
    assert runs[1][1]["batch_pass_useful_fraction"] == pytest.approx(37 / 55)


def test_packed_step_equals_padded_with_popo_replay(split):
  # POPO refills group 1 from the buffer: the gathered pi_prox pass and the loss, packed.
  rollout = _cut(_rollout(split, ONE_INEFFECTIVE))
  replay, _ = _buffer_with(split, MIXED, version=0, shift=-0.3)
  runs = _both(split, rollout, buffer=replay, prox_chunks=2,
               replay=popo.Popo(fill="replay", max_uses=1))
  assert runs[1][1]["replay_slots_filled"] == 1.0
  _assert_same(split, runs)
  # The gathered pass over the replayed group reports its own fraction, beside the loss pass's.
  for _, m in runs:
    assert 0 < m["prox_pass_useful_fraction"] <= 1


def test_packed_step_equals_padded_with_rollout_replay_rows(split):
  # Rollout-level replay adds single rows (not whole groups): the per-row packing.
  old = _rollout(split, MIXED, seed=9)
  replay = replay_lib.init_replay(16, 1, P, T)
  rows = jax.tree.map(lambda x: x[:, None], _cut(old))
  stored = jnp.asarray([0.7, -0.4, 0.9, -1.1, 0.3, 0.0, 0.0, 0.0])
  replay = replay_lib.insert(replay, rows.replace(version=jnp.full_like(rows.version, -1)),
                             stored[:, None], stored != 0)
  runs = _both(split, _cut(_rollout(split, MIXED, shift=SHIFT_N)), buffer=replay,
               replay=prioritized.PrioritizedReplay(tau_max=10, rho=0.5, warmup_steps=0))
  assert runs[1][1]["replay_rows"] >= 3.0  # 4 slots; the stored empty row has no token
  _assert_same(split, runs)


def test_packed_step_equals_padded_with_headroom_and_continued_rows(split):
  # Headroom-Drift's candidate pass (its pi_prox of the admitted groups) and continued rows
  # (group 1's first two tokens of version 1 at step 3) with pi_prox interpolated per token:
  # every pass packed.
  from grpo_jax.rl.replay import headroom  # pylint: disable=g-import-not-at-top
  rollout = _cut(_rollout(split, MIXED, shift=SHIFT_N))
  version = np.full((8, T), 3, np.int32)
  version[G:, :2] = 1
  rollout = rollout.replace(version=jnp.asarray(version))
  replay, _ = _buffer_with(split, MIXED, version=2, shift=-0.3)
  runs = []
  graphdef, params = split
  for packing in ("none", "tokens"):
    tx = optax.sgd(1.0)
    config = StepConfig(num_minibatches=1, group_size=G, packing=packing, continued=True,
                        prox_estimate="interpolate",
                        replay=headroom.HeadroomDrift(slots=2, candidates=2, tau=1.0))
    fn = step_lib.make_train_step(graphdef, tx, config)
    state = step_lib.init_train_state(_copy(params), tx).replace(step=jnp.int32(3))
    state, _, m = fn(state, jax.tree.map(jnp.copy, replay), rollout, None, jax.random.key(0))
    runs.append((state, {k: float(v) for k, v in m.items()}))
  assert runs[1][1]["continued_rows"] == 4.0 and runs[1][1]["replay_rows"] > 0
  _assert_same(split, runs)


def test_packed_step_equals_padded_under_lora(tiny_qwen3):
  """Adapters only trained (rank 2, B drawn away from 0): the same adapter update."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from grpo_jax.models import from_pretrained, lora  # pylint: disable=g-import-not-at-top
  from tests.conftest import DATA  # pylint: disable=g-import-not-at-top
  model = from_pretrained(str(DATA / "tiny_qwen3"))
  lora.attach(model, lora.LoraConfig(2, 4.0, lora.DEFAULT_TARGETS), nnx.Rngs(0))
  for i, site in enumerate(lora.dense_layers(model)):
    if site.rank:
      site.set_factors(b=0.1 * jax.random.normal(jax.random.key(i), (site.rank, site.shape[1])))
  split = nnx.split(model)
  rollout = _cut(_rollout(split, MIXED, shift=SHIFT_N))
  _assert_same(split, _both(split, rollout, num_minibatches=2))
