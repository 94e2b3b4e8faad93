"""Teacher-forced token log-probabilities of completions under a model.

These are the numbers every policy-gradient loss multiplies: the sampler reports the same
quantity for the tokens it draws, so the two must agree (see tests/generate/test_sampler.py). Log-probs
are ``logit[token] - logsumexp(logits)``, which never materialises a second [N, T, V] array of
log-softmax values. The model is any ``models.CausalLM``; shape letters: ``types.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from grpo_jax.models.causal_lm import CausalLM, prompts_repeat
from grpo_jax.sharding import ambient_batch_shards, constrain


def token_logprobs(logits_xV: jax.Array, tokens_x: jax.Array,
                   temperature: float = 1.0) -> jax.Array:
  """log softmax(logits / temperature)[token], in float32, for any leading shape."""
  logits = logits_xV.astype(jnp.float32)
  if temperature != 1.0:
    logits = logits / temperature
  picked = jnp.take_along_axis(logits, tokens_x[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def completion_logprobs(model: CausalLM, prompt_ids_NxP: jax.Array, prompt_mask_NxP: jax.Array,
                        completion_ids_NxT: jax.Array, temperature: float = 1.0) -> jax.Array:
  """Teacher-forced log-probs [N, T] (see ``completion_logprobs_and_entropy``)."""
  return completion_logprobs_and_entropy(model, prompt_ids_NxP, prompt_mask_NxP,
                                         completion_ids_NxT, temperature, False)[0]


def completion_logprobs_and_entropy(model: CausalLM, prompt_ids_NxP: jax.Array,
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
    remat: checkpoint each decoder block (``CausalLM.hidden_states``): for passes that are
      differentiated, trading one more forward for the blocks' stored activations.
    query_block: queries per attention block (``attention.blocked_attention``; 0 = all at
      once).
    prompt_group: rows come in runs of this many completions of one prompt (GRPO's G,
      group-major). When every run really repeats one prompt (checked on the device), the
      pass runs each prompt once (``CausalLM.grouped_hidden_states``);
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
    ids_NxS = jnp.concatenate([prompt_ids_NxP, completion_ids_NxT], axis=1)
    mask_NxS = jnp.concatenate([prompt_mask_NxP.astype(bool),
                                jnp.ones(completion_ids_NxT.shape, bool)], axis=1)
    hidden_NxSxD, _ = model.hidden_states(ids_NxS, mask_NxS, remat=remat,
                                          query_block=query_block)
    return hidden_NxSxD[:, p - 1: p - 1 + t]  # position p - 1 + t predicts completion token t

  def per_prompt(prompt_ids_NxP, prompt_mask_NxP, completion_ids_NxT):
    # The last completion token predicts nothing here: it is left out (unless it is the only).
    hp_BxPxD, hc_NxTxD = model.grouped_hidden_states(
        prompt_ids_NxP[::g], prompt_mask_NxP[::g], completion_ids_NxT[:, :max(t - 1, 1)], g,
        remat, query_block)
    return jnp.concatenate([jnp.repeat(hp_BxPxD[:, -1:], g, axis=0), hc_NxTxD[:, :t - 1]],
                           axis=1)

  args = (prompt_ids_NxP, prompt_mask_NxP, completion_ids_NxT)
  if g > 1 and n % g == 0:
    if check_prompts:
      hidden_NxTxD = jax.lax.cond(prompts_repeat(prompt_ids_NxP, prompt_mask_NxP, g),
                                  per_prompt, every_row, *args)
    else:
      hidden_NxTxD = per_prompt(*args)
  else:
    hidden_NxTxD = every_row(*args)
  return hidden_logprobs_and_entropy(model, hidden_NxTxD, completion_ids_NxT, temperature,
                                     with_entropy, chunk_tokens)


def hidden_logprobs_and_entropy(model: CausalLM, hidden_NxTxD: jax.Array, tokens_NxT: jax.Array,
                                temperature: float = 1.0, with_entropy: bool = False,
                                chunk_tokens: int = 0):
  """Log-probs (and entropy) of ``tokens_NxT`` under the LM head of final hidden states
  ``hidden_NxTxD`` (position t's state predicts token t), the LM head in blocks of
  ``chunk_tokens`` positions as ``completion_logprobs_and_entropy`` says.

  Returns:
    (logp float32 [N, T], entropy float32 [N, T] or None).
  """
  n, t = tokens_NxT.shape
  completion_ids_NxT = tokens_NxT
  if 0 < chunk_tokens < n * t:
    return _chunked_logprobs_and_entropy(model, hidden_NxTxD, completion_ids_NxT, temperature,
                                         with_entropy, chunk_tokens)
  logits_NxTxV = model.logits(hidden_NxTxD)
  if temperature != 1.0:
    logits_NxTxV = logits_NxTxV / temperature
  lse_NxT = jax.nn.logsumexp(logits_NxTxV, axis=-1)
  picked_NxT = jnp.take_along_axis(logits_NxTxV, completion_ids_NxT[..., None], axis=-1)[..., 0]
  entropy_NxT = None
  if with_entropy:
    # H = logsumexp(z) - sum softmax(z) z, without a second [N, T, V] log-softmax array.
    probs_NxTxV = jnp.exp(logits_NxTxV - lse_NxT[..., None])
    entropy_NxT = lse_NxT - jnp.sum(probs_NxTxV * logits_NxTxV, axis=-1)
  return picked_NxT - lse_NxT, entropy_NxT


def _chunked_logprobs_and_entropy(model: CausalLM, hidden_NxTxD: jax.Array,
                                  tokens_NxT: jax.Array, temperature: float,
                                  with_entropy: bool, chunk: int):
  """The LM head, log-probs and entropy in blocks of X = ``chunk`` positions (see the caller).

  Under a mesh whose batch axes split N into ``shards``, block j is made of X / shards
  positions of every shard (a local transpose, no communication), so every device computes its
  own rows of every block and the loop runs over an unsplit axis. Each position's log-prob
  depends only on its own hidden state, so the grouping changes no value. Local arrays are
  [shards, positions per shard (padded to a multiple of X / shards), ...] before blocking and
  [blocks, X, ...] after.

  Returns:
    (logp float32 [N, T], entropy float32 [N, T] or None).
  """
  n, t, d = hidden_NxTxD.shape
  shards = ambient_batch_shards()
  if n % shards or chunk % shards:
    shards = 1  # rows that do not split evenly: one group (the compiler lays it out)
  per_shard, per_block = n // shards * t, chunk // shards
  num_blocks = -(-per_shard // per_block)
  pad = num_blocks * per_block - per_shard
  hidden_by_shard = hidden_NxTxD.reshape(shards, per_shard, d)
  tokens_by_shard = tokens_NxT.reshape(shards, per_shard)
  if pad:
    # Padding rows (zero hidden state, token 0) are computed and dropped below.
    hidden_by_shard = jnp.pad(hidden_by_shard, ((0, 0), (0, pad), (0, 0)))
    tokens_by_shard = jnp.pad(tokens_by_shard, ((0, 0), (0, pad)))

  def to_blocks(a):
    # [shards, blocks, X / shards, ...] -> [blocks, shards, X / shards, ...] -> [blocks, X, ...].
    by_block = jnp.swapaxes(a.reshape((shards, num_blocks, per_block) + a.shape[2:]), 0, 1)
    return by_block.reshape((num_blocks, shards * per_block) + a.shape[2:])

  hidden_blocks = constrain(to_blocks(hidden_by_shard), (None, "batch", None))
  token_blocks = constrain(to_blocks(tokens_by_shard), (None, "batch"))

  # Remat: the backward pass recomputes this block's logits rather than storing them. In a loop
  # body the recomputation cannot be merged with the forward pass, so XLA's CSE may stay on
  # (prevent_cse=False, as the jax.checkpoint documentation advises under scan).
  @functools.partial(jax.checkpoint, prevent_cse=False)
  def block(xs):
    h_XxD, tokens_X = xs
    logits_XxV = model.logits(h_XxD)
    if temperature != 1.0:
      logits_XxV = logits_XxV / temperature
    lse_X = jax.nn.logsumexp(logits_XxV, axis=-1)
    picked_X = jnp.take_along_axis(logits_XxV, tokens_X[:, None], axis=-1)[:, 0]
    if not with_entropy:
      return picked_X - lse_X
    probs_XxV = jnp.exp(logits_XxV - lse_X[:, None])
    return picked_X - lse_X, lse_X - jnp.sum(probs_XxV * logits_XxV, axis=-1)

  out = jax.lax.map(block, (hidden_blocks, token_blocks))

  def unchunk(blocks):
    by_shard = jnp.swapaxes(blocks.reshape(num_blocks, shards, per_block), 0, 1)
    return by_shard.reshape(shards, num_blocks * per_block)[:, :per_shard].reshape(n, t)

  if not with_entropy:
    return unchunk(out), None
  return unchunk(out[0]), unchunk(out[1])
