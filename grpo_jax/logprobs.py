"""Teacher-forced token log-probabilities of completions under a model.

These are the numbers every policy-gradient loss multiplies: the sampler reports the same
quantity for the tokens it draws, so the two must agree (see tests/test_sampler.py). Log-probs
are ``logit[token] - logsumexp(logits)``, which never materialises a second [N, T, V] array of
log-softmax values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.models.qwen3 import Qwen3


def token_logprobs(logits_xV: jax.Array, tokens_x: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
  """log softmax(logits / temperature)[token], in float32, for any leading shape."""
  logits = logits_xV.astype(jnp.float32)
  if temperature != 1.0:
    logits = logits / temperature
  picked = jnp.take_along_axis(logits, tokens_x[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def completion_logprobs(model: Qwen3, prompt_ids_NxP: jax.Array, prompt_mask_NxP: jax.Array,
                        completion_ids_NxT: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Teacher-forced log-probs [N, T] (see ``completion_logprobs_and_entropy``)."""
  return completion_logprobs_and_entropy(model, prompt_ids_NxP, prompt_mask_NxP,
                                         completion_ids_NxT, temperature, False)[0]


def completion_logprobs_and_entropy(model: Qwen3, prompt_ids_NxP: jax.Array,
                                    prompt_mask_NxP: jax.Array, completion_ids_NxT: jax.Array,
                                    temperature: float = 1.0, with_entropy: bool = True,
                                    chunk_tokens: int = 0):
  """Teacher-forced log-probs of each completion token given its left-padded prompt.

  Args:
    model: the policy.
    prompt_ids_NxP: int32 prompts, left padded.
    prompt_mask_NxP: True for real prompt tokens.
    completion_ids_NxT: int32 completions (tokens after the end are ignored by callers' masks).
    temperature: the sampling temperature the completions were drawn at.
    with_entropy: also return the entropy of each next-token distribution.

  Returns:
    (logp float32 [N, T]: log pi(completion[t] | prompt, completion[:t]) at ``temperature``,
     entropy float32 [N, T] or None).
  """
  _, p = prompt_ids_NxP.shape
  t = completion_ids_NxT.shape[1]
  ids = jnp.concatenate([prompt_ids_NxP, completion_ids_NxT], axis=1)
  mask = jnp.concatenate([prompt_mask_NxP.astype(bool),
                          jnp.ones(completion_ids_NxT.shape, bool)], axis=1)
  hidden, _ = model.hidden_states(ids, mask)
  # Position p - 1 + t predicts completion token t.
  logits_NxTxV = model.logits(hidden[:, p - 1: p - 1 + t])
  if temperature != 1.0:
    logits_NxTxV = logits_NxTxV / temperature
  lse_NxT = jax.nn.logsumexp(logits_NxTxV, axis=-1)
  picked = jnp.take_along_axis(logits_NxTxV, completion_ids_NxT[..., None], axis=-1)[..., 0]
  entropy = None
  if with_entropy:
    # H = logsumexp(z) - sum softmax(z) z, without a second [N, T, V] log-softmax array.
    probs = jnp.exp(logits_NxTxV - lse_NxT[..., None])
    entropy = lse_NxT - jnp.sum(probs * logits_NxTxV, axis=-1)
  return picked - lse_NxT, entropy
