"""The LM head's backward pass in the compute dtype: autodiff's gradients bit for bit in
float32, and under bfloat16 both backward GEMMs over the vocabulary take bf16 operands."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.models import lm_head

D, V = 16, 40


def _inputs(dtype, vocab_major):
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(2, 3, D)), dtype)
  w = jnp.asarray(rng.normal(size=(V, D) if vocab_major else (D, V)) * 0.3, dtype)
  tokens = jnp.asarray(rng.integers(0, V, (2, 3)), jnp.int32)
  return h, w, tokens


def _loss(head):
  """A log-prob loss of the tokens, weighted per position like a policy gradient's."""
  def loss(h, w, tokens):
    logp = jax.nn.log_softmax(head(h, w), axis=-1)
    picked = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    return jnp.sum(picked * jnp.arange(1.0, 7.0).reshape(2, 3))
  return loss


def _plain(vocab_major):
  spec = "...d,vd->...v" if vocab_major else "...d,dv->...v"
  return lambda h, w: jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)


@pytest.mark.parametrize("vocab_major", [False, True])
def test_float32_gradients_are_autodiffs(vocab_major):
  h, w, tokens = _inputs(jnp.float32, vocab_major)
  ours = jax.grad(_loss(lambda h, w: lm_head.logits(h, w, vocab_major)), (0, 1))(h, w, tokens)
  plain = jax.grad(_loss(_plain(vocab_major)), (0, 1))(h, w, tokens)
  for a, b in zip(ours, plain):
    np.testing.assert_array_equal(a, b)


def _dot_operand_dtypes(fn, *args):
  """The operand dtypes of every dot_general in ``fn``'s jaxpr (nested jaxprs included)."""
  out = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        out.append(tuple(str(v.aval.dtype) for v in eqn.invars))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


@pytest.mark.parametrize("vocab_major", [False, True])
def test_bfloat16_backward_gemms_take_bfloat16_operands(vocab_major):
  """Forward and both backward GEMMs: 3 dot_generals, each of two bf16 operands; plain
  autodiff has float32 cotangents in its two backward GEMMs. The gradients agree with
  autodiff's to bf16 rounding (2^-8 of the largest)."""
  h, w, tokens = _inputs(jnp.bfloat16, vocab_major)
  grad = jax.grad(_loss(lambda h, w: lm_head.logits(h, w, vocab_major)), (0, 1))
  plain = jax.grad(_loss(_plain(vocab_major)), (0, 1))
  assert _dot_operand_dtypes(grad, h, w, tokens) == [("bfloat16", "bfloat16")] * 3
  assert sum("float32" in d for d in _dot_operand_dtypes(plain, h, w, tokens)) == 2
  for a, b in zip(grad(h, w, tokens), plain(h, w, tokens)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, atol=2 ** -7 * np.abs(b).max())
