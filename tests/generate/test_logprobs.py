"""Chunked LM head of the log-prob passes: same numbers and gradients, never [N*T, V] logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import assets
from grpo_jax.generate.logprobs import completion_logprobs_and_entropy
from grpo_jax.models import from_pretrained
from tests import jaxpr_shapes

N, P, T = 4, 6, 8
CHUNKS = (1, 2, 5, 8, 31)  # 5 and 31 do not divide N * T = 32 (padding path)
TEMPERATURES = (1.0, 0.7)


@pytest.fixture(scope="module")
def setup():
  model = from_pretrained(assets.EMBEDDED_MODEL)
  graphdef, params = nnx.split(model)
  v = model.config.vocab_size
  rng = np.random.RandomState(0)
  prompt_ids = jnp.asarray(rng.randint(0, v, (N, P)), jnp.int32)
  # Left padding: row i has i pad tokens (row 0 none).
  prompt_mask = jnp.asarray(np.arange(P)[None, :] >= np.arange(N)[:, None])
  completion_ids = jnp.asarray(rng.randint(0, v, (N, T)), jnp.int32)
  weights = jnp.asarray(rng.randn(N, T), jnp.float32)
  return dict(graphdef=graphdef, params=params, v=v, batch=(prompt_ids, prompt_mask,
                                                             completion_ids), weights=weights)


def _fn(setup, chunk, temperature, with_entropy=True):
  graphdef, batch = setup["graphdef"], setup["batch"]

  def fn(params):
    return completion_logprobs_and_entropy(nnx.merge(graphdef, params), *batch, temperature,
                                           with_entropy, chunk_tokens=chunk)
  return fn


def _loss(setup, chunk, temperature=1.0):
  fn, w = _fn(setup, chunk, temperature), setup["weights"]

  def loss(params):
    logp, entropy = fn(params)
    return jnp.sum(logp * w) + 0.1 * jnp.sum(entropy * w[::-1])
  return loss


@pytest.fixture(scope="module")
def forward(setup):
  """{(chunk, temperature): (logp, entropy)}, every configuration compiled in one jit."""
  keys = [(c, tau) for tau in TEMPERATURES for c in (0, N * T) + CHUNKS]
  out = jax.jit(lambda p: [_fn(setup, c, tau)(p) for c, tau in keys])(setup["params"])
  return dict(zip(keys, out))


@pytest.fixture(scope="module")
def grads(setup):
  """{chunk: gradient of a weighted sum of log-probs and entropies w.r.t. the params}."""
  keys = (0, 5, 1)
  out = jax.jit(lambda p: [jax.grad(_loss(setup, c))(p) for c in keys])(setup["params"])
  return dict(zip(keys, out))


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_equals_unchunked(forward, chunk, temperature):
  logp, entropy = forward[(0, temperature)]
  logp_c, entropy_c = forward[(chunk, temperature)]
  assert logp_c.shape == entropy_c.shape == (N, T)
  # Random tokens have |logp| ~ 16, where one float32 ulp is 1.9e-6: allow 1e-6 plus ~2 ulps
  # (blocks and the full array are fused differently; observed <= 4.5e-7 relative).
  np.testing.assert_allclose(logp_c, logp, atol=1e-6, rtol=1e-6)
  tol = dict(atol=1e-6, rtol=1e-6)
  if chunk < 4:
    # XLA:CPU lowers a 1- or 2-row LM head with a different matmul kernel, whose logits differ
    # from the full-size ones by a few ulps (4.3e-6 at |logit| ~ 12). H = lse - sum p z
    # subtracts two numbers of the logits' size, so its float32 rounding is a few ulps of
    # the logits (~2e-5 absolute), not of H. Float32 noise, not chunking.
    tol = dict(atol=5e-5, rtol=0)
  np.testing.assert_allclose(entropy_c, entropy, **tol)
  assert np.all(np.isfinite(logp)) and np.all(logp < 0)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_chunk_at_least_rows_is_single_shot(forward, temperature):
  for a, b in zip(forward[(0, temperature)], forward[(N * T, temperature)]):
    np.testing.assert_array_equal(a, b)


def test_without_entropy(setup, forward):
  logp, entropy = jax.jit(_fn(setup, 5, 0.7, with_entropy=False))(setup["params"])
  assert entropy is None
  np.testing.assert_allclose(logp, forward[(0, 0.7)][0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("chunk", (5, 1))
def test_gradients_match(grads, chunk):
  # float32 sums over the N * T positions are reassociated chunk by chunk, so compare each
  # leaf to its own scale (observed: <= ~1.5e-6 of the leaf's max).
  for path, g0 in jax.tree_util.tree_leaves_with_path(grads[0]):
    g = _get(grads[chunk], path)
    scale = float(jnp.max(jnp.abs(g0)))
    assert scale > 0, path
    np.testing.assert_allclose(g, g0, atol=1e-6 + 1e-5 * scale, rtol=1e-5, err_msg=str(path))


def _get(tree, path):
  leaves = dict(jax.tree_util.tree_leaves_with_path(tree))
  return leaves[path]


def _vocab_shapes(setup, fn) -> set:
  v = setup["v"]
  found = jaxpr_shapes.shapes(jax.make_jaxpr(fn)(setup["params"]))
  return {s for s in found if s and s[-1] == v}


@pytest.mark.parametrize("what", ("forward", "grad"))
def test_chunked_never_materialises_full_logits(setup, what):
  v = setup["v"]
  full = {(N, T, v), (N * T, v)}
  make = ((lambda c: _fn(setup, c, 0.7)) if what == "forward" else
          (lambda c: jax.grad(_loss(setup, c, 0.7))))
  unchunked = _vocab_shapes(setup, make(0))
  assert unchunked & full  # the probe can see the full tensor when it is there
  chunked = _vocab_shapes(setup, make(5))
  assert (5, v) in chunked
  # Every [..., V] value is one chunk: neither [N, T, V], nor [N*T, V], nor the padded [35, V].
  assert all(np.prod(s) == 5 * v for s in chunked), chunked
