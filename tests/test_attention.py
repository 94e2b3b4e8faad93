"""The attention switch (``model.attention``): ``blocked`` equals ``xla`` in every pass.

Kernel level: ``flash.flash_attention`` and its custom VJP against the dense ``attention`` at
several block sizes, with left padding and a query offset (forward <= 1e-5, gradients <= 1e-4,
float32, on every query that sees a key); no [X, S] array anywhere in its gradient's jaxpr;
the cache kernel reads no slot past the filled blocks. Model level: the per-row and the
grouped shared-prompt log-prob passes and their gradients, the remat'd pass, and the sampler,
with ``blocked`` against ``xla`` on the tiny Qwen3. ``splash`` runs in Pallas' interpreter
here; ``cudnn`` needs a GPU (bench/accelerator.py runs it there).
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import configuration, errors
from grpo_jax import sampler as sampler_lib
from grpo_jax.logprobs import completion_logprobs_and_entropy
from grpo_jax.models import attention as attn
from grpo_jax.models import flash, from_pretrained, fused_attention
from tests import jaxpr_shapes

FWD, GRAD = 1e-5, 1e-4
N, X, S, KH, QH, W = 3, 13, 21, 2, 2, 8


def _inputs(seed=0, x=X, s=S):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (N, x, KH, QH, W))
  k = jax.random.normal(ks[1], (N, s, KH, W))
  v = jax.random.normal(ks[2], (N, s, KH, W))
  # Rows left padded 0, 3 and 7 key slots.
  key_mask = jnp.arange(s)[None] >= jnp.array([0, 3, 7])[:, None]
  return q, k, v, key_mask, ks[3]


def _max_err(a, b, seen_NxX):
  return float(jnp.max(jnp.abs(jnp.where(seen_NxX[:, :, None, None, None], a - b, 0.0))))


@pytest.mark.parametrize("block_q,block_k", [(4, 5), (13, 21), (1, 1), (8, 16), (64, 64)])
def test_flash_equals_dense_forward_and_gradients(block_q, block_k):
  q, k, v, key_mask, key = _inputs()
  offset = S - X  # queries are the last X slots (as a continuation after a prompt)
  mask = attn.causal_mask(key_mask, X, offset)
  seen = mask.any(-1)  # row 2's first query (slot 8) sees key 7 only; none sees nothing here
  dense = lambda q, k, v: attn.attention(q, k, v, mask)
  blocked = lambda q, k, v: flash.flash_attention(q, k, v, key_mask, offset, block_q=block_q,
                                                  block_k=block_k)
  assert _max_err(blocked(q, k, v), dense(q, k, v), seen) <= FWD
  cot = jax.random.normal(key, (N, X, KH, QH, W)) * seen[:, :, None, None, None]
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cot)
  got = jax.jit(jax.grad(loss(blocked), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2)))(q, k, v)
  for g, w_ in zip(got, want):
    np.testing.assert_allclose(g, w_, atol=GRAD, rtol=0)


def test_fully_masked_queries_give_zero_and_no_gradient():
  q, k, v, key_mask, _ = _inputs(x=S)
  out = flash.flash_attention(q, k, v, key_mask, 0, block_q=4, block_k=4)
  # Row 2 is left padded 7 slots: its first 7 queries see only padding.
  np.testing.assert_array_equal(out[2, :7], 0.0)
  dq = jax.grad(lambda q: jnp.sum(flash.flash_attention(q, k, v, key_mask, 0, block_q=4,
                                                        block_k=4)))(q)
  np.testing.assert_array_equal(dq[2, :7], 0.0)
  assert np.all(np.isfinite(dq))


def test_no_length_by_length_array_in_forward_or_backward():
  length, block = 96, 16  # a distinctive size: no other axis is 96
  q, k, v, key_mask, _ = _inputs(x=length, s=length)
  grad = jax.grad(lambda q, k, v: jnp.sum(flash.flash_attention(
      q, k, v, key_mask, 0, block_q=block, block_k=block)), argnums=(0, 1, 2))
  shapes = jaxpr_shapes.shapes(jax.make_jaxpr(grad)(q, k, v))
  assert shapes and not [s for s in shapes if s.count(length) >= 2]
  # The guard works: the dense kernel's gradient has [N, K, Q, 96, 96] scores.
  dense = jax.grad(lambda q: jnp.sum(attn.attention(q, k, v, attn.causal_mask(key_mask, length))))
  assert [s for s in jaxpr_shapes.shapes(jax.make_jaxpr(dense)(q)) if s.count(length) >= 2]


def _cache(k, v, key_mask, size):
  """KVCache's layout ([N, K, W, S] keys, [N, K, S, W] values) of ``size`` slots: the S given
  keys, zeros after (as ``KVCache.init`` leaves unwritten slots)."""
  pad = lambda a: jnp.pad(a, ((0, 0), (0, size - a.shape[1]), (0, 0), (0, 0)))
  return (jnp.transpose(pad(k), (0, 2, 3, 1)), jnp.transpose(pad(v), (0, 2, 1, 3)),
          jnp.pad(key_mask, ((0, 0), (0, size - key_mask.shape[1]))))


@pytest.mark.parametrize("index,x,block", [(0, 13, 8), (10, 1, 8), (20, 1, 8), (5, 4, 8),
                                           (15, 1, 8), (20, 1, 7), (38, 2, 7), (39, 1, 40)])
def test_cache_kernel_equals_dense_and_reads_only_filled_blocks(index, x, block):
  q, k, v, key_mask, _ = _inputs()
  q = q[:, :x]
  k_c, v_c, mask_c = _cache(k, v, key_mask, 40)
  dense = attn.cache_attention(q, k_c, v_c, mask_c, index, "xla")
  # Blocks of ``block`` slots: the queries' last slot index + x - 1 lies in block
  # (index + x - 1) // block; every block after it is NaN. A kernel that read one of them would
  # return NaN (0 * NaN in the product with the values), as the dense kernel does. Blocks of 7
  # do not divide the 40 slots: the last one is read from slot 33 with 33..34 masked.
  nan_from = min(40, -(-(index + x) // block) * block)
  poison = lambda a, axis: jnp.where(
      jnp.expand_dims(jnp.arange(40) >= nan_from, [d for d in range(4) if d != axis]), np.nan, a)
  k_nan, v_nan = poison(k_c, 3), poison(v_c, 2)
  got = jax.jit(lambda q, i: attn.cache_attention(q, k_nan, v_nan, mask_c, i, "blocked",
                                                   block=block))(q, index)
  seen = attn.causal_mask(mask_c, x, index).any(-1)
  assert np.all(np.isfinite(got))
  assert _max_err(got, dense, seen) <= FWD
  if nan_from < 40:
    assert not np.all(np.isfinite(attn.cache_attention(q, k_nan, v_nan, mask_c, index, "xla")))


def _grouped_inputs():
  b, g, p, t = 2, 3, 7, 9
  ks = jax.random.split(jax.random.key(3), 7)
  qp = jax.random.normal(ks[0], (b, p, KH, QH, W))
  kp, vp = (jax.random.normal(kk, (b, p, KH, W)) for kk in ks[1:3])
  qc = jax.random.normal(ks[3], (b * g, t, KH, QH, W))
  kc, vc = (jax.random.normal(kk, (b * g, t, KH, W)) for kk in ks[4:6])
  prompt_mask = jnp.arange(p)[None] >= jnp.array([0, 4])[:, None]
  return (qp, kp, vp, qc, kc, vc), prompt_mask, g, ks[6]


@pytest.mark.parametrize("impl", ["blocked", "splash"])
def test_grouped_attention_equals_xla(impl, monkeypatch):
  """Prompts and continuations, values and all six gradients; ``splash`` off a TPU runs in
  Pallas' interpreter (same kernel program, interpreted)."""
  if impl == "splash" and jax.default_backend() != "tpu":
    monkeypatch.setattr(fused_attention, "splash_attention",
                        functools.partial(fused_attention.splash_attention, interpret=True))
  arrays, prompt_mask, g, key = _grouped_inputs()
  run = lambda impl: lambda *a: attn.grouped_attention(*a, prompt_mask, g, 0, impl, 4)
  want, got = jax.jit(run("xla"))(*arrays), jax.jit(run(impl))(*arrays)
  seen_p = attn.causal_mask(prompt_mask, prompt_mask.shape[1]).any(-1)
  assert _max_err(got[0], want[0], seen_p) <= FWD
  assert _max_err(got[1], want[1], jnp.ones(got[1].shape[:2], bool)) <= FWD
  cots = [jax.random.normal(kk, o.shape) for kk, o in zip(jax.random.split(key), want)]
  cots[0] = cots[0] * seen_p[:, :, None, None, None]
  loss = lambda f: lambda *a: sum(jnp.sum(o * c) for o, c in zip(f(*a), cots))
  grads_want = jax.jit(jax.grad(loss(run("xla")), argnums=tuple(range(6))))(*arrays)
  grads_got = jax.jit(jax.grad(loss(run(impl)), argnums=tuple(range(6))))(*arrays)
  for a, b in zip(grads_got, grads_want):
    np.testing.assert_allclose(a, b, atol=GRAD, rtol=0)


def test_cudnn_call_on_the_reference_kernel_equals_blocked():
  """Everything of ``cudnn_attention`` but cuDNN: left padding rolled to cuDNN's right padding
  and back, per-row lengths, grouped heads, run on ``jax.nn.dot_product_attention``'s xla
  implementation (float32 here)."""
  q, k, v, key_mask, key = _inputs(x=S)
  got = fused_attention.cudnn_attention(q, k, v, key_mask, implementation="xla")
  want = flash.flash_attention(q, k, v, key_mask, 0)
  seen = attn.causal_mask(key_mask, S).any(-1)
  assert _max_err(got, want, seen) <= FWD
  cot = jax.random.normal(key, q.shape) * seen[:, :, None, None, None]
  grads = [jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * cot), argnums=(0, 1, 2))(q, k, v)
           for f in (lambda *a: fused_attention.cudnn_attention(*a, key_mask, "xla"),
                     lambda *a: flash.flash_attention(*a, key_mask, 0))]
  for a, b in zip(*grads):
    np.testing.assert_allclose(a, b, atol=GRAD, rtol=0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a GPU")
def test_cudnn_equals_blocked_on_gpu():
  q, k, v, key_mask, _ = _inputs(x=S)
  bf = lambda a: a.astype(jnp.bfloat16)
  got = fused_attention.cudnn_attention(bf(q), bf(k), bf(v), key_mask)
  want = flash.flash_attention(bf(q), bf(k), bf(v), key_mask, 0)
  seen = attn.causal_mask(key_mask, S).any(-1)
  assert _max_err(got.astype(jnp.float32), want.astype(jnp.float32), seen) <= 2e-2


# --- the model: every pass with attention=blocked against attention=xla -----------------------

B, G, P, T = 2, 3, 6, 7


@pytest.fixture(scope="module")
def models(data_dir):
  path = os.fspath(data_dir / "tiny_qwen3")
  # Blocks of 4 queries / keys: several blocks per row, a partial one at the end.
  return {impl: from_pretrained(path, attention=impl, attention_block=4)
          for impl in ("xla", "blocked")}


@pytest.fixture(scope="module")
def batch():
  rng = np.random.RandomState(0)
  ids = jnp.asarray(np.repeat(rng.randint(6, 128, (B, P)), G, axis=0), jnp.int32)
  mask = jnp.asarray(np.repeat(np.arange(P)[None] >= np.array([[0], [3]]), G, axis=0))
  completions = jnp.asarray(rng.randint(6, 128, (B * G, T)), jnp.int32)
  return ids, mask, completions


@pytest.mark.parametrize("group,remat", [(1, False), (G, False), (G, True)])
def test_model_logprobs_and_gradients_blocked_equal_xla(models, batch, group, remat):
  ids, mask, completions = batch

  def loss_and_grad(model):
    graphdef, params = nnx.split(model)

    def loss(params):
      logp, ent = completion_logprobs_and_entropy(
          nnx.merge(graphdef, params), ids, mask, completions, remat=remat,
          prompt_group=group)
      return jnp.sum(logp) + 0.1 * jnp.sum(ent), logp

    (_, logp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logp, grads

  logp_x, grads_x = loss_and_grad(models["xla"])
  logp_b, grads_b = loss_and_grad(models["blocked"])
  np.testing.assert_allclose(logp_b, logp_x, atol=FWD, rtol=0)
  flat_x = dict(nnx.to_flat_state(grads_x))
  for path, g in nnx.to_flat_state(grads_b):
    np.testing.assert_allclose(g[...], flat_x[path][...], atol=GRAD, rtol=0, err_msg=str(path))


def test_sampler_blocked_equals_xla(models, batch):
  ids, mask, _ = batch
  config = sampler_lib.SamplingConfig(max_new_tokens=T, eos_ids=(1,), pad_id=0, temperature=1.0,
                                      prompt_group=G)
  outs = {impl: sampler_lib.make_sampler(nnx.graphdef(m), config)(
      nnx.state(m), ids, mask, jax.random.key(5)) for impl, m in models.items()}
  np.testing.assert_array_equal(outs["blocked"].completion_ids, outs["xla"].completion_ids)
  np.testing.assert_allclose(outs["blocked"].behaviour_logp, outs["xla"].behaviour_logp,
                             atol=FWD, rtol=0)


def test_auto_picks_blocked_from_the_threshold_on_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("auto's CPU rule")
  assert attn.resolve("auto", attn.BLOCKED_FROM_KEYS - 1) == "xla"
  assert attn.resolve("auto", attn.BLOCKED_FROM_KEYS) == "blocked"
  assert attn.resolve("xla", 10 ** 6) == "xla"


def _config(**model):
  from configs import popo  # pylint: disable=g-import-not-at-top
  c = popo.get_config("smoke")
  c.model.update(model)
  return c


@pytest.mark.parametrize("field,value,says", [
    ("attention", "flash", "model.attention: 'flash'; known: auto, xla, blocked"),
    ("attention", "splash", "'splash' needs a TPU backend"),
    ("attention", "cudnn", "'cudnn' needs a GPU backend"),
    ("attention_block", 0, "model.attention_block: 0 must be >= 1"),
])
def test_bad_attention_config_is_one_line(field, value, says):
  if jax.default_backend() in ("gpu", "tpu") and value in ("cudnn", "splash"):
    pytest.skip("allowed on this backend")
  with pytest.raises(errors.ConfigError) as e:
    config = _config(**{field: value})
    configuration.validate(config)
    configuration.check_backend(config)  # the loop's check once the devices are up
  assert says in str(e.value) and "\n" not in str(e.value)


def test_a_run_with_blocked_attention_trains(tmp_path):
  """The whole loop under ``model.attention=blocked`` with a block that divides nothing (3):
  loading, sampling, the POPO step, evaluation and a checkpoint."""
  from grpo_jax import metrics, train  # pylint: disable=g-import-not-at-top
  c = _config(attention="blocked", attention_block=3)
  c.total_steps, c.eval.every, c.checkpoint.every = 2, 2, 2
  c.eval.greedy = False
  train.train_and_evaluate(c, os.fspath(tmp_path))
  steps = [r for r in metrics.read_metrics(os.fspath(tmp_path)) if "loss" in r]
  assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
