"""The train step's log-prob passes: one function for the proximal, reference and loss passes.

Every pass runs at the rollout temperature (so that pi_theta and the recorded mu describe the
same distribution), with the step's LM-head chunking and attention blocks, and runs each prompt
once for its G rows when they repeat one prompt (``StepConfig.shared_prompts``); with
``rl.packing=tokens`` over packed rows of the real tokens (``generate.packed_logprobs``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import sharding
from grpo_jax.generate import logprobs as logprobs_lib
from grpo_jax.generate import packed_logprobs as packed_lib
from grpo_jax.generate import packing
from grpo_jax.models.causal_lm import prompts_repeat
from grpo_jax.rl.batch import Tokens
from grpo_jax.rl.step_config import StepConfig


def logprobs(graphdef: nnx.GraphDef, params, tokens: Tokens, config: StepConfig,
             with_entropy: bool = False, remat: bool = False,
             grouped: bool | None = None) -> tuple[jax.Array, jax.Array | None]:
  """Log-probs (and entropy) of the rows' completions under ``params``.

  Args:
    graphdef: the model's structure.
    params: its parameters.
    tokens: Tokens of the rows ([N, P] prompts, [N, T] completions).
    config: StepConfig (temperature, chunking, shared prompts).
    with_entropy: also the per-token entropy.
    remat: recompute each decoder block's insides in the backward pass.
    grouped: True runs the shared-prompt pass unchecked, False the per-row pass, None decides
      on the device (``logprobs.completion_logprobs_and_entropy``).

  Returns:
    ([N, T] float32 log-probs, [N, T] float32 entropy or None).
  """
  model = nnx.merge(graphdef, params)
  group = config.group_size if config.shared_prompts and grouped is not False else 1
  if config.packing == "tokens":
    return _packed(model, tokens, config, with_entropy, remat, group, grouped)
  return logprobs_lib.completion_logprobs_and_entropy(
      model, tokens.prompt_ids, tokens.prompt_mask, tokens.completion_ids, config.temperature,
      with_entropy, chunk_tokens=config.logprob_chunk, remat=remat,
      query_block=config.query_block, prompt_group=group, check_prompts=grouped is None)


def _packed(model, tokens: Tokens, config: StepConfig, with_entropy: bool, remat: bool,
            group: int, grouped: bool | None):
  """``logprobs`` over packed rows (``rl.packing=tokens``, ``generate.packed_logprobs``): each
  group's prompt once when the rows are whole groups of one prompt (checked on the device
  when ``grouped`` is None, as the padded pass does), else one row a unit."""
  n = tokens.completion_ids.shape[0]
  shards = packing_shards(n)
  run = lambda g: packed_lib.packed_logprobs_and_entropy(
      model, tokens.prompt_ids, tokens.prompt_mask, tokens.completion_ids,
      tokens.completion_mask, config.temperature, with_entropy,
      chunk_tokens=config.logprob_chunk, remat=remat, group=g,
      rows_per_pass=config.packing_rows, query_block=config.query_block, shards=shards)
  if group <= 1 or (n // shards) % group:
    return run(1)
  if grouped is None:
    return jax.lax.cond(prompts_repeat(tokens.prompt_ids, tokens.prompt_mask, group),
                        lambda: run(group), lambda: run(1))
  return run(group)


def packing_shards(rows: int) -> int:
  """S: blocks of ``rows`` packed apart (``packing.plan``): the batch shards of the mesh set
  while tracing (``sharding.use_mesh``), so each device packs its own rows; 1 without a mesh
  or when the rows do not split evenly (then packed rows may span devices: same values)."""
  s = sharding.ambient_batch_shards()
  return s if rows % s == 0 else 1


def pass_tokens(tokens: Tokens, config: StepConfig,
                grouped: bool | None) -> tuple[jax.Array, jax.Array]:
  """(real tokens, token positions computed) of one ``logprobs`` pass over ``tokens``, float32.

  Real: the real tokens among the positions computed: each unit's prompt once (a group's, when
  the pass runs each prompt once; else each row's) plus every completion's tokens (the grouped
  padded pass feeds a completion's first T - 1 only). Computed: with ``packing=none`` the
  padded layout's positions (each prompt's P and each row's T - 1, or each row's P + T); with
  ``tokens`` the packed rows of the passes that ran (``packed_logprobs``: ``rows_per_pass`` x C
  of each device's block a pass, up to the last one holding a unit). ``grouped`` as
  ``logprobs`` (None: whether the prompts repeat is checked here too)."""
  n, p = tokens.prompt_ids.shape
  t = tokens.completion_ids.shape[1]
  g = config.group_size if config.shared_prompts and grouped is not False else 1
  shards = packing_shards(n) if config.packing == "tokens" else 1
  if g > 1 and (n // shards) % g:
    g = 1
  mask = (jnp.ones((n, t), bool) if tokens.completion_mask is None
          else tokens.completion_mask.astype(bool))
  f32 = lambda x: jnp.asarray(x, jnp.float32)

  def count(g: int):
    if config.packing == "tokens":
      plan = packing.plan(tokens.prompt_mask, mask, g, shards)
      r = max(1, min(config.packing_rows, n // shards))
      passes = (plan.used + r - 1) // r
      return (f32(packing.real_tokens(plan, g)),
              f32(passes * shards * r * packing.capacity(p, t)))
    if g > 1:
      # Each prompt once, then every row's first T - 1 completion tokens: a row reaching T has
      # its last token scored but never fed, so it is not a position computed.
      real = (jnp.sum(tokens.prompt_mask[::g], dtype=jnp.float32)
              + jnp.sum(mask[:, :t - 1], dtype=jnp.float32))
      return real, f32(n // g * p + n * (t - 1))
    real = jnp.sum(tokens.prompt_mask, dtype=jnp.float32) + jnp.sum(mask, dtype=jnp.float32)
    return real, f32(n * (p + t))

  if g > 1 and grouped is None:
    repeat = prompts_repeat(tokens.prompt_ids, tokens.prompt_mask, g)
    grouped_counts, row_counts = count(g), count(1)
    return tuple(jnp.where(repeat, a, b) for a, b in zip(grouped_counts, row_counts))
  return count(g)


def grouped_pass_possible(rows: int, config: StepConfig) -> bool:
  """Whether a pass over ``rows`` rows may run grouped (static; the prompts are checked too)."""
  g = config.group_size
  return config.shared_prompts and g > 1 and rows % g == 0
