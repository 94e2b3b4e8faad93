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
  """Teacher-forced log-probs of each completion token given its left-padded prompt.

  Args:
    model: the policy.
    prompt_ids_NxP: int32 prompts, left padded.
    prompt_mask_NxP: True for real prompt tokens.
    completion_ids_NxT: int32 completions (tokens after the end are ignored by callers' masks).
    temperature: the sampling temperature the completions were drawn at.

  Returns:
    float32 [N, T]: log pi(completion[t] | prompt, completion[:t]) at ``temperature``.
  """
  _, p = prompt_ids_NxP.shape
  t = completion_ids_NxT.shape[1]
  ids = jnp.concatenate([prompt_ids_NxP, completion_ids_NxT], axis=1)
  mask = jnp.concatenate([prompt_mask_NxP.astype(bool),
                          jnp.ones(completion_ids_NxT.shape, bool)], axis=1)
  hidden, _ = model.hidden_states(ids, mask)
  # Position p - 1 + t predicts completion token t.
  logits_NxTxV = model.logits(hidden[:, p - 1: p - 1 + t])
  return token_logprobs(logits_NxTxV, completion_ids_NxT, temperature)
