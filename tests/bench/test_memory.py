"""Memory switches and mixed precision: per-layer remat, blocked attention, float32 master
weights under bfloat16 matmuls, and the per-device memory benchmark's command line."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from grpo_jax import assets
from grpo_jax.models import from_pretrained
from grpo_jax.models.attention import attention, blocked_attention
from grpo_jax.rl import step as step_lib
from grpo_jax.rl.replay import init_replay
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _attention_inputs(b=2, t=10, k=2, g=2, dh=8, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, t, k, g, dh))
  kk = jax.random.normal(keys[1], (b, t, k, dh))
  v = jax.random.normal(keys[2], (b, t, k, dh))
  # Causal, with 3 left-padding keys in row 1 (its first 3 queries see no real key at all).
  real = jnp.arange(t)[None, :] >= jnp.asarray([[0], [3]])
  mask = jnp.tril(jnp.ones((t, t), bool))[None] & real[:, None, :]
  return q, kk, v, mask


@pytest.mark.parametrize("block", [4, 5, 9])  # 4 and 9 pad the last block, 5 divides T = 10
def test_blocked_attention_equals_attention(block):
  q, k, v, mask = _attention_inputs()
  full = attention(q, k, v, mask)
  blocked = blocked_attention(q, k, v, mask, block)
  # Each query's softmax over all keys is computed by the same operations in both; only the
  # batching of queries into dots differs, so float32 rounding at most.
  np.testing.assert_allclose(blocked, full, atol=1e-6, rtol=0)
  loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))
  grads_full = jax.grad(loss(lambda q, k, v: attention(q, k, v, mask)), (0, 1, 2))(q, k, v)
  grads_blocked = jax.grad(loss(lambda q, k, v: blocked_attention(q, k, v, mask, block)),
                           (0, 1, 2))(q, k, v)
  for a, b in zip(grads_blocked, grads_full):  # keys/values: summed over the blocks
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


B, G, P, T = 2, 4, 5, 6


def _rollout(split, seed=0):
  from grpo_jax.generate import sampler as sampler_lib  # pylint: disable=g-import-not-at-top
  graphdef, params = split
  rng = np.random.RandomState(seed)
  ids = np.repeat(rng.randint(6, 128, (B, P)), G, axis=0).astype(np.int32)
  mask = np.ones((B * G, P), bool)
  # left padding on every other group; a group's rows share their prompt and its padding,
  # as the sampler's groups do (the train step's shared-prompt gradient relies on it)
  mask[np.repeat(np.arange(B) % 2 == 0, G), :2] = False
  cfg = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(5,), pad_id=0)
  out = sampler_lib.make_sampler(graphdef, cfg)(params, ids, mask, jax.random.key(seed))
  scores = jnp.asarray([1, 0, 0, 1, 0, 1, 0, 0], jnp.float32)
  return Rollout(prompt_ids=jnp.asarray(ids), prompt_mask=jnp.asarray(mask),
                 completion_ids=out.completion_ids, completion_mask=out.completion_mask,
                 behaviour_logp=out.behaviour_logp, truncated=out.truncated,
                 scores=scores, success=scores > 0,
                 prompt_id=jnp.repeat(jnp.arange(B), G),
                 version=jnp.zeros(out.completion_ids.shape, jnp.int32))


def _step(split, rollout, tx, **kw):
  graphdef, params = split
  config = StepConfig(group_size=G, num_minibatches=2, **kw)
  state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
  return step_lib.make_train_step(graphdef, tx, config)(
      state, init_replay(0, G, P, T), rollout, None, jax.random.key(1))


def test_remat_and_blocked_attention_leave_the_step_unchanged(tiny_qwen3):
  split = nnx.split(tiny_qwen3)
  rollout = _rollout(split)
  tx = optax.sgd(0.1)  # the parameter change is 0.1 x the gradient: compares gradients
  plain, _, m_plain = _step(split, rollout, tx)
  lean, _, m_lean = _step(split, rollout, tx, remat="layer", query_block=4)  # P + T = 11: 3 blocks
  moved = max(float(jnp.max(jnp.abs(a - b)))
              for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(split[1])))
  assert moved > 1e-3
  # Recomputing a block runs the same operations on the same inputs; blocking the queries
  # changes only how rows are batched into dots: float32 rounding of gradients, times 0.1.
  chex_close = lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  jax.tree.map(chex_close, lean.params, plain.params)
  for key in ("loss", "grad_norm", "ratio_mean", "clip_frac_low"):
    np.testing.assert_allclose(m_lean[key], m_plain[key], rtol=1e-5, atol=1e-7)


def test_float32_master_weights_under_bfloat16_matmuls():
  model = from_pretrained(assets.EMBEDDED_MODEL, param_dtype="float32", dtype="bfloat16")
  split = nnx.split(model)
  rollout = _rollout(split)
  tx = optax.adam(1e-5)
  state, _, metrics = _step(split, rollout, tx, prox_pass="all")
  leaves = jax.tree.leaves((state.params, state.opt_state))
  assert {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)} == {jnp.dtype(jnp.float32)}
  assert all(np.isfinite(float(v)) for v in metrics.values())
  # The sampler (cached decode, float32 elementwise attention) and the trainer (full forward,
  # bfloat16 attention dots) round differently: the step measures it (and, with
  # prox_pass="all", corrects it through pi_prox / mu). Small here: XLA:CPU computes bfloat16
  # dots in float32 (measured 1.8e-7); on accelerators it is larger.
  assert 0.0 < float(metrics["fresh_logp_mismatch"]) < 0.1
  # Two minibatches, two Adam updates of at most lr = 1e-5 each: every weight with a nonzero
  # gradient moves by at most 2e-5 (measured: median 1.7e-5). Float32 keeps that. A bfloat16
  # weight (8 significant bits) loses it wherever half its spacing exceeds 2e-5: for
  # |w| >= 2^-6 the spacing is >= 2^-13 ~ 1.2e-4 (and 6.1e-5 just below 2^-6, should a step
  # cross), so such a weight rounds back to itself; over half of this model's are that large.
  old = split[1]["layers"]["mlp"]["up_proj"]["kernel"][...]
  new = state.params["layers"]["mlp"]["up_proj"]["kernel"][...]
  assert float(jnp.mean(new != old)) > 0.9
  stored = old.astype(jnp.bfloat16)
  in_bf16 = (stored.astype(jnp.float32) + (new - old)).astype(jnp.bfloat16)
  large = jnp.abs(old) >= 2.0 ** -6
  assert float(jnp.mean(large)) > 0.5
  assert bool(jnp.all(jnp.where(large, in_bf16 == stored, True)))  # every such update lost


_MEMORY_PROBE = r"""
import json, sys
import jax, jax.numpy as jnp
from flax import nnx
from grpo_jax import assets
from grpo_jax.generate.logprobs import completion_logprobs_and_entropy
from grpo_jax.models import from_pretrained
graphdef, params = nnx.split(from_pretrained(assets.EMBEDDED_MODEL))
out = {}
for remat, block in ((False, 0), (True, 0), (True, 32)):
  def loss(p, ids, cids):
    lp = completion_logprobs_and_entropy(nnx.merge(graphdef, p), ids, jnp.ones(ids.shape, bool),
                                         cids, 1.0, False, remat=remat, query_block=block)[0]
    return jnp.sum(lp)
  s = jax.ShapeDtypeStruct
  compiled = jax.jit(jax.grad(loss)).lower(params, s((8, 64), jnp.int32),
                                           s((8, 192), jnp.int32)).compile()
  out[f"{remat}-{block}"] = compiled.memory_analysis().temp_size_in_bytes
print(json.dumps(out))
"""


def test_remat_and_blocked_attention_shrink_compiled_memory():
  """Gradient of the log-probs of 8 rows x 256 tokens through the embedded model (4 layers,
  4 heads), compiled with XLA:CPU's memory-minimising scheduler (bench/memory.py)."""
  from grpo_jax.bench.memory import CPU_MEMORY_SCHEDULER  # pylint: disable=g-import-not-at-top
  env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {CPU_MEMORY_SCHEDULER}",
         "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True,
                        timeout=600, env=env, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-3000:]
  temp = json.loads(proc.stdout.strip().splitlines()[-1])
  # One layer's attention scores alone are 8 x 4 x 256 x 256 x 4 bytes = 8 MiB; without remat
  # the backward pass keeps those of all 4 layers (and their softmax), with remat one layer's,
  # and with 32-query blocks one block's (1/8 of a layer's).
  assert temp["True-0"] < temp["False-0"] - 16 * 2 ** 20, temp
  assert temp["True-32"] < temp["True-0"] - 4 * 2 ** 20, temp


@pytest.mark.slow
def test_memory_benchmark_compiles_a_config_on_fake_devices():
  cmd = [sys.executable, "-m", "grpo_jax.bench.memory", "--config=configs/popo.py:smoke",
         "--mesh=4", "--config.mesh.data=2", "--config.mesh.tensor=2", "--json"]
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "4 cpu devices" in out
  assert "mesh {'data': 2, 'fsdp': 1, 'tensor': 2}" in out
  assert "| step |" in out and "| sampler |" in out
  stats = json.loads(out[out.index("bytes: ") + len("bytes: "):].splitlines()[0])
  step, sampler = stats["step"], stats["sampler"]
  # The donated state and buffer come back in place: the aliased bytes are the output's
  # except the metrics' (a few dozen float32 scalars), and everything is per device, > 0.
  assert 0 <= step["output"] - step["alias"] < 4096
  assert step["temp"] > 0 and sampler["temp"] > 0
  assert step["total"] == step["argument"] + step["output"] - step["alias"] + step["temp"]
  assert re.search(r"fits \(against the memory JAX gets: [\d.]+ of a GPU, .*\): H100 80GB "
                   r"\([\d.]+ GiB\) yes, H200 141GB \([\d.]+ GiB\) yes, v5e 16GiB \(16.0 GiB\) yes",
                   out), out
  # --json: the last line, the same per-device figures, and the arithmetic beside them.
  result = json.loads(out.strip().splitlines()[-1])
  assert result["step_peak_bytes"] == step["total"]
  assert result["sampler_peak_bytes"] == sampler["total"]
  assert result["sampling_peak_bytes"] == stats["sampling_peak"]
  counted = result["arithmetic_bytes"]
  assert counted["step"] == pytest.approx(2 * counted["state"] + counted["gradients"]
                                          + counted["saved_inputs"]
                                          + counted["block_backward"] + counted["lm_head"])
  assert result["fits"]["H100 80GB"] and result["mesh"] == {"data": 2, "fsdp": 1, "tensor": 2}


def test_memory_benchmark_under_lora_holds_adapter_optimiser_state_only():
  """``bench.memory``'s abstract state under ``:lora=4``: the base once (no Adam moments, no
  float32 master copy, no reference), the adapters and their two moments."""
  from configs import popo  # pylint: disable=g-import-not-at-top
  from grpo_jax import sharding  # pylint: disable=g-import-not-at-top
  from grpo_jax.bench import memory  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=1))
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  _, full_params, _, full = memory.abstract_state(popo.get_config("smoke"), mesh)
  _, _, _, adapted = memory.abstract_state(popo.get_config("smoke,lora=4"), mesh)
  # The embedded model: 927,104 parameters; rank-4 adapters on its 28 projections add
  # 4 x (sum of in + out) = 38,912. Full state: 3 x 4 bytes per parameter (params, mu, nu)
  # plus Adam's step count; LoRA: 4 bytes per base parameter + 3 x 4 per adapter parameter,
  # and the adapters' scales (not trained): one float32 per layer of the 7 stacked projections.
  base, extra, scales = count(full_params), 38_912, 7 * 4
  assert base == 927_104
  counts = nbytes(full.opt_state) - 8 * base  # the scalars (step counts, learning rate)
  assert nbytes(full) == 12 * base + counts + 4
  assert nbytes(adapted) == 4 * base + 12 * extra + 4 * scales + counts + 4


def test_memory_arithmetic_by_hand():
  """``bench.memory.arithmetic`` of the POPO smoke preset on one device, every term by hand.

  Embedded model: D 128, F 384, L 4, H 4, K 2, W 32, V 1088 (tied). Parameters per layer:
  128 * 32 * (2 * 4 + 2 * 2) = 49,152 (q, k, v, o) + 64 (q/k norms) + 3 * 128 * 384 = 147,456
  (SwiGLU) + 256 (two norms) = 196,928; x 4 = 787,712, + 1088 * 128 = 139,264 embedding + 128
  final norm = 927,104. Batch: 2 prompts x 2 = 4 rows, P + T = 24 + 8 = 32, 2 minibatches of 2.
  """
  from configs import popo  # pylint: disable=g-import-not-at-top
  from grpo_jax.bench import memory  # pylint: disable=g-import-not-at-top
  got = memory.arithmetic(popo.get_config("smoke"), devices=1)
  params = 927_104
  assert got["state"] == params * 4 + params * 8  # float32 weights + two AdamW moments
  assert got["gradients"] == params * 4
  assert got["saved_inputs"] == 4 * 2 * 32 * 128 * 4  # L x U x S x D x float32 = 131,072
  # q, k, v, o widths (2H + 2K) W = 384 and 3F = 1,152, with cotangents: 2 x 2 x 32 x 1,536 x 4
  # = 786,432; the xla kernel at 32 keys (auto below 1,024) adds [2, 4, 32, 32] scores and
  # probabilities in float32: 2 x 2 x 4 x 32 x 32 x 4 = 65,536.
  assert got["block_backward"] == 786_432 + 65_536
  assert got["lm_head"] == 2 * 1024 * 1088 * 4
  assert got["kv_cache"] == 2 * 4 * 4 * 32 * 2 * 32 * 4  # k and v, L, N, S, K, W, float32
  assert got["sampler_logits"] == 4 * 1088 * 4
  assert got["step"] == (2 * got["state"] + got["gradients"] + got["saved_inputs"]
                         + got["block_backward"] + got["lm_head"])
  blocked = popo.get_config("smoke")
  blocked.model.attention = "blocked"
  assert memory.arithmetic(blocked, devices=1)["block_backward"] == 786_432


def test_fits_is_judged_against_the_memory_jax_gets():
  """JAX's allocator takes 75% of a GPU unless XLA_CLIENT_MEM_FRACTION (or its older name)
  says otherwise, and a TPU's whole memory: an H200's 143,771 MiB is 140.4 GiB, of which
  0.75 x 140.4 = 105.3 GiB are JAX's by default and 0.95 x 140.4 = 133.4 with 0.95."""
  from grpo_jax.bench import memory  # pylint: disable=g-import-not-at-top
  assert memory.gpu_memory_fraction({}) == 0.75
  assert memory.gpu_memory_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".95"}) == 0.95
  assert memory.gpu_memory_fraction({"XLA_CLIENT_MEM_FRACTION": "0.9"}) == 0.9
  assert memory.pools(0.75)["H200 141GB"] == pytest.approx(105.3, abs=0.05)
  assert memory.pools(0.95)["H200 141GB"] == pytest.approx(133.4, abs=0.05)
  assert memory.pools(0.75)["H100 80GB"] == pytest.approx(0.75 * 81_559 / 1024)
  assert memory.pools(0.5)["v5e 16GiB"] == 16.0  # a TPU: no fraction
