"""Teacher-forced token log-probabilities of completions under a model.

These are the numbers every policy-gradient loss multiplies: the sampler reports the same
quantity for the tokens it draws, so the two must agree (see tests/test_sampler.py). Log-probs
are ``logit[token] - logsumexp(logits)``, which never materialises a second [N, T, V] array of
log-softmax values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from grpo_jax.models.qwen3 import Qwen3, prompts_repeat
from grpo_jax.sharding import ambient_batch_shards, constrain


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
                                    chunk_tokens: int = 0, remat: bool = False,
                                    query_block: int = 0, prompt_group: int = 1,
                                    check_prompts: bool = True):
  """Teacher-forced log-probs of each completion token given its left-padded prompt.

  The LM head's output is the largest array of every log-prob pass: float32 logits [N, T, V]
  are N * T * V * 4 bytes (at Qwen3's V = 151,936 and N * T = 8 * 1024 that is ~5 GB, and the
  backward pass of the loss can hold more of that size, e.g. the logits' cotangent).
  With ``chunk_tokens > 0`` the N * T completion positions are instead flattened, padded to a
  multiple of ``chunk_tokens`` and pushed through the LM head one [chunk_tokens, V] block at a
  time (``lax.map``), each block under ``jax.checkpoint`` so the backward pass recomputes its
  logits instead of storing them: at most one block of logits (and one of its cotangent) is
  alive at a time. The numbers are the same as the single-shot path up to float rounding.

  Args:
    model: the policy.
    prompt_ids_NxP: int32 prompts, left padded.
    prompt_mask_NxP: True for real prompt tokens.
    completion_ids_NxT: int32 completions (tokens after the end are ignored by callers' masks).
    temperature: the sampling temperature the completions were drawn at.
    with_entropy: also return the entropy of each next-token distribution.
    chunk_tokens: completion positions per LM-head block (static). 0, or a value >= N * T,
      computes all logits at once.
    remat: checkpoint each decoder block (``Qwen3.hidden_states``): for passes that are
      differentiated, trading one more forward for the blocks' stored activations.
    query_block: queries per attention block (``qwen3.blocked_attention``; 0 = all at once).
    prompt_group: rows come in runs of this many completions of one prompt (GRPO's G,
      group-major). When every run really repeats one prompt (checked on the device), the
      pass runs each prompt once (``Qwen3.grouped_hidden_states``);
      otherwise every row is [prompt; completion]. The same log-probs up to float rounding.
    check_prompts: with False the caller guarantees that the runs repeat (the grouped pass
      runs without the check). A differentiated caller makes the check itself, around the
      whole gradient: under ``jax.grad`` a ``lax.cond`` here would keep the residuals of both
      branches (measured 1.7x slower than either branch alone on the reference workload).

  Returns:
    (logp float32 [N, T]: log pi(completion[t] | prompt, completion[:t]) at ``temperature``,
     entropy float32 [N, T] or None).
  """
  n, p = prompt_ids_NxP.shape
  t = completion_ids_NxT.shape[1]
  g = prompt_group

  def every_row(prompt_ids_NxP, prompt_mask_NxP, completion_ids_NxT):
    ids = jnp.concatenate([prompt_ids_NxP, completion_ids_NxT], axis=1)
    mask = jnp.concatenate([prompt_mask_NxP.astype(bool),
                            jnp.ones(completion_ids_NxT.shape, bool)], axis=1)
    hidden, _ = model.hidden_states(ids, mask, remat=remat, query_block=query_block)
    return hidden[:, p - 1: p - 1 + t]  # position p - 1 + t predicts completion token t

  def per_prompt(prompt_ids_NxP, prompt_mask_NxP, completion_ids_NxT):
    # The last completion token predicts nothing here: it is left out (unless it is the only).
    hp, hc = model.grouped_hidden_states(prompt_ids_NxP[::g], prompt_mask_NxP[::g],
                                         completion_ids_NxT[:, :max(t - 1, 1)], g, remat,
                                         query_block)
    return jnp.concatenate([jnp.repeat(hp[:, -1:], g, axis=0), hc[:, :t - 1]], axis=1)

  args = (prompt_ids_NxP, prompt_mask_NxP, completion_ids_NxT)
  if g > 1 and n % g == 0:
    if check_prompts:
      hidden_NxTxD = jax.lax.cond(prompts_repeat(prompt_ids_NxP, prompt_mask_NxP, g),
                                  per_prompt, every_row, *args)
    else:
      hidden_NxTxD = per_prompt(*args)
  else:
    hidden_NxTxD = every_row(*args)
  if 0 < chunk_tokens < n * t:
    return _chunked_logprobs_and_entropy(model, hidden_NxTxD, completion_ids_NxT, temperature,
                                         with_entropy, chunk_tokens)
  logits_NxTxV = model.logits(hidden_NxTxD)
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


def _chunked_logprobs_and_entropy(model: Qwen3, hidden_NxTxD: jax.Array,
                                  tokens_NxT: jax.Array, temperature: float,
                                  with_entropy: bool, chunk: int):
  """The LM head, log-probs and entropy in [chunk, V] blocks (see the caller).

  Local shape letters: S = batch shards (1 without a mesh), M = N * T / S completion positions
  per shard, K = chunk, M' = M padded to a multiple of K / S.

  Under a mesh whose batch axes split N into S shards, block j is made of K / S positions of
  every shard (a local transpose, no communication), so every device computes its own rows of
  every block and the loop runs over an unsplit axis. Each position's log-prob depends only on
  its own hidden state, so the grouping changes no value.

  Returns:
    (logp float32 [N, T], entropy float32 [N, T] or None).
  """
  n, t, d = hidden_NxTxD.shape
  s = ambient_batch_shards()
  if n % s or chunk % s:
    s = 1  # rows that do not split evenly: one group (the compiler lays it out)
  m, k = n // s * t, chunk // s
  num_chunks = -(-m // k)
  pad = num_chunks * k - m
  hidden_SxMxD = hidden_NxTxD.reshape(s, m, d)  # M' after padding
  tokens_SxM = tokens_NxT.reshape(s, m)
  if pad:
    # Padding rows (zero hidden state, token 0) are computed and dropped below.
    hidden_SxMxD = jnp.pad(hidden_SxMxD, ((0, 0), (0, pad), (0, 0)))
    tokens_SxM = jnp.pad(tokens_SxM, ((0, 0), (0, pad)))
  # [S, M'/(K/S), K/S, ...] -> [M'/(K/S), S, K/S, ...] -> blocks [M'/(K/S), K, ...].
  to_blocks = lambda x: jnp.swapaxes(x.reshape((s, num_chunks, k) + x.shape[2:]), 0, 1).reshape(
      (num_chunks, s * k) + x.shape[2:])
  hidden_blocks = constrain(to_blocks(hidden_SxMxD), (None, "batch", None))
  token_blocks = constrain(to_blocks(tokens_SxM), (None, "batch"))

  # Remat: the backward pass recomputes this block's logits rather than storing them. In a loop
  # body the recomputation cannot be merged with the forward pass, so XLA's CSE may stay on
  # (prevent_cse=False, as the jax.checkpoint documentation advises under scan).
  @functools.partial(jax.checkpoint, prevent_cse=False)
  def block(xs):
    h_KxD, tok_K = xs
    logits_KxV = model.logits(h_KxD)
    if temperature != 1.0:
      logits_KxV = logits_KxV / temperature
    lse_K = jax.nn.logsumexp(logits_KxV, axis=-1)
    picked_K = jnp.take_along_axis(logits_KxV, tok_K[:, None], axis=-1)[:, 0]
    if not with_entropy:
      return picked_K - lse_K
    probs_KxV = jnp.exp(logits_KxV - lse_K[:, None])
    return picked_K - lse_K, lse_K - jnp.sum(probs_KxV * logits_KxV, axis=-1)

  out = jax.lax.map(block, (hidden_blocks, token_blocks))
  unchunk = lambda blocks: jnp.swapaxes(blocks.reshape(num_chunks, s, k), 0, 1).reshape(
      s, num_chunks * k)[:, :m].reshape(n, t)
  if not with_entropy:
    return unchunk(out), None
  return unchunk(out[0]), unchunk(out[1])
