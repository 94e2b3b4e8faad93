"""The static schedule on the slot pool: a round of rows admitted together and decoded until
the longest ends, drawing exactly what one sampler call on the same rows draws.

Without ``rollout.partial`` every step's rollouts come in rounds of S = B x G rows
(``allocation/rounds.py``), and every evaluation batch is one such call. A round here is the
pool (``pool.py``) with static admission: all R rows admitted at once (``pool.admit_all``:
each prompt prefilled once when its rows come in runs of ``prompt_group``), then decoded until
no row is unfinished (``pool.decode``). Its rows draw as the rows of one ``sampler.sample``
call: they hold the call's key, and row i draws token t from ``sampler.uniforms(fold_in(key,
t), R)[i]``; since they advance together, each decode step writes one cache slot and one token
column for all of them, as the sampler does. The prefill, the decode step and the draw are the
sampler's own functions, so a round gives ``sampler.sample``'s tokens and behaviour log-probs
bit for bit
(tests/generate/test_static_round.py): the static rounds, the evaluation and partial rollouts
run on one generation engine, and the sampler's loop is kept only as the benchmarks'
reference. With ``row_block`` the rows run in blocks, one after another (``lax.map``), each
row keeping its index in the call, as the sampler's blocks do.

Shape letters: ``types.py`` (R = N here: the call's rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax.generate import pool as pool_lib
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.types import Rollout


def _round(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids_NxP, prompt_mask_NxP,
           index_N, rng, *, rows: int, config: sampler_lib.SamplingConfig) -> Rollout:
  """The N rows (row n drawing as row ``index_N[n]`` of a call on ``rows`` rows) in one pool."""
  pool = pool_lib.admit_all(graphdef, params, prompt_ids_NxP, prompt_mask_NxP, rng, index_N,
                            rows=rows, config=config)
  pool, _ = pool_lib.decode(graphdef, params, pool, jnp.int32(0),
                            steps=config.max_new_tokens, config=config, call_rows=rows)
  n, t = prompt_ids_NxP.shape[0], config.max_new_tokens
  return Rollout(prompt_ids=prompt_ids_NxP, prompt_mask=prompt_mask_NxP.astype(bool),
                 completion_ids=pool.tokens,
                 completion_mask=jnp.arange(t)[None, :] < pool.length[:, None],
                 behaviour_logp=pool.logp, truncated=~pool.ended,
                 scores=jnp.zeros((n,), jnp.float32), success=jnp.zeros((n,), bool),
                 prompt_id=jnp.full((n,), -1, jnp.int32), version=jnp.zeros((n, t), jnp.int32))


def sample(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids_NxP: jax.Array,
           prompt_mask_NxP: jax.Array, rng: jax.Array, *,
           config: sampler_lib.SamplingConfig) -> Rollout:
  """``sampler.sample``'s contract and result, on the pool (pure; jit with ``make_round_fn``).

  Args:
    graphdef, params: the model (``nnx.split``).
    prompt_ids_NxP, prompt_mask_NxP: left-padded prompts (every row has a real token).
    rng: the call's key; token t of row n is drawn from ``uniforms(fold_in(rng, t), N)[n]``.
    config: static sampling settings (``row_block``: the rows in blocks, one at a time).

  Returns:
    A Rollout of the N rows, as ``sampler.sample`` returns it.

  Raises:
    ValueError: ``config.row_block`` does not divide N (at trace time).
  """
  n = prompt_ids_NxP.shape[0]
  index_N = jnp.arange(n, dtype=jnp.int32)
  block = config.row_block
  if not block or block >= n:
    return _round(graphdef, params, prompt_ids_NxP, prompt_mask_NxP, index_N, rng, rows=n,
                  config=config)
  if n % block:
    raise ValueError(f"sampler row_block {block} does not divide the {n} rows")
  to_blocks, from_blocks = sampler_lib.row_blocks(n, block, config.prompt_group)  # its blocks
  out = jax.lax.map(
      lambda xs: _round(graphdef, params, *xs, rng, rows=n, config=config),
      (to_blocks(prompt_ids_NxP), to_blocks(prompt_mask_NxP), to_blocks(index_N)))
  return jax.tree.map(from_blocks, out)


def make_round_fn(graphdef: nnx.GraphDef, config: sampler_lib.SamplingConfig, mesh=None):
  """``fn(params, prompt_ids_NxP, prompt_mask_NxP, rng) -> Rollout``, jitted once per shape;
  under a ``mesh`` laid out as ``sampler.make_sampler``'s (rows split over the batch axes, the
  completions replicated for every process to read)."""
  return sampler_lib.jit_rows(functools.partial(sample, graphdef, config=config), mesh)


@functools.lru_cache(maxsize=16)
def cached_round_fn(graphdef: nnx.GraphDef, config: sampler_lib.SamplingConfig, mesh=None):
  """``make_round_fn``, one per (model structure, sampling config, mesh) in a process: a run's
  rounds and evaluations, and a run built twice in one process, compile each shape once."""
  return make_round_fn(graphdef, config, mesh)
