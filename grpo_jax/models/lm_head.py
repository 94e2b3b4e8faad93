"""The LM head's matmul with its backward pass in the compute dtype.

Logits are float32 (``preferred_element_type``: the log-softmax and every loss term need them),
so their cotangent is float32 too, and plain autodiff then runs both backward GEMMs over the
vocabulary, dh = g W^T and dW = h^T g, with a float32 operand: on a GPU that is the FP32 /
TF32 path instead of bf16 tensor cores, for the largest GEMMs of the step (V = 151,936 for
Qwen3). ``logits`` rounds the cotangent to the compute dtype first, as mixed-precision
training does for every other layer's activations' gradients, and accumulates both products
in float32. The loss and its log-softmax stay float32; only the gradient flowing into the
head (softmax - one-hot, times the loss's weights) is rounded, to bfloat16's 8 bits of
mantissa under bf16 matmuls. In float32 nothing changes (the cast is the identity): the
gradients are autodiff's bit for bit (tests/models/test_lm_head.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _product(h_xD, w, vocab_major: bool):
  spec = "...d,vd->...v" if vocab_major else "...d,dv->...v"
  return jnp.einsum(spec, h_xD, w, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def logits(h_xD: jax.Array, w: jax.Array, vocab_major: bool) -> jax.Array:
  """float32 logits [..., V] of hidden states [..., D] and a head ``w`` in the compute dtype.

  Args:
    h_xD: hidden states, in the compute dtype.
    w: the head: [D, V] (an ``lm_head`` kernel), or [V, D] with ``vocab_major`` (a tied
      embedding table); in the compute dtype.
    vocab_major: ``w`` is [V, D].
  """
  return _product(h_xD, w, vocab_major)


def _forward(h_xD, w, vocab_major):
  return _product(h_xD, w, vocab_major), (h_xD, w)


def _backward(vocab_major, residuals, g_xV):
  h_xD, w = residuals
  g = g_xV.astype(h_xD.dtype)  # the compute dtype: both GEMMs on its fast path
  f32 = jnp.float32
  dh = jnp.einsum("...v,vd->...d" if vocab_major else "...v,dv->...d", g, w,
                  preferred_element_type=f32)
  lead = "ijklmnopqrstu"[:h_xD.ndim - 1]  # the leading axes, summed over
  spec = f"{lead}v,{lead}d->vd" if vocab_major else f"{lead}d,{lead}v->dv"
  dw = (jnp.einsum(spec, g, h_xD, preferred_element_type=f32) if vocab_major
        else jnp.einsum(spec, h_xD, g, preferred_element_type=f32))
  return dh.astype(h_xD.dtype), dw.astype(w.dtype)


logits.defvjp(_forward, _backward)
