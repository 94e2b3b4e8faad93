"""A slot pool: rows that outlive a sampler call, decoded in chunks and refilled as they end.

Today's ``sampler.sample`` decodes a static batch until its longest row ends; at reasoning
lengths (heavy-tailed: most rows end early, a few reach T) two thirds of its row-steps produce
no token (``bench.lengths``). A pool keeps N slots, each holding one rollout at its own
position: ``admit`` prefills new prompts into chosen free slots, ``decode`` advances every
unfinished row by up to a set number of tokens, and the caller harvests the rows that ended
(``finished``) and frees their slots (``release``) for the next prompts, so the slots stay
busy. The state (``Pool``) is a pytree: a pool saved between chunks resumes to the same tokens,
since each row draws token t with ``fold_in(its key, t)``, whatever chunks it was decoded in.

Partial rollouts (Kimi k1.5, arXiv 2501.12599; APRIL, arXiv 2509.18521) continue a row across
parameter updates: each token records the version (optimiser updates of the parameters) that
drew it and the log-prob of the distribution it was drawn from (the behaviour policy mu of a
decoupled objective, Hilton et al. arXiv 2110.00641). The cache a continued row carries is
that of the parameters that wrote it (``keep``: cheap; the tokens' log-probs are still those of
the distribution they were drawn from) unless ``reprefill`` recomputes it under the current
parameters (exact, at the cost of a forward pass over every live row's tokens so far).

Each row's keys and values live at slots [0, P) (its left-padded prompt) and P + t (its token
t), written at the row's own index (``KVCache.index`` [N]); a decode step attends every slot
with the row's key mask (the GPU's Pallas kernel reads each row's filled blocks only; the CPU
kernels read every slot, as the static sampler's do). Shape letters: ``types.py`` (here N is
the pool's slots and M the rows admitted at once).
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import sharding as sharding_lib
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.models.causal_lm import CausalLM
from grpo_jax.models.kv_cache import KVCache


@flax.struct.dataclass
class Pool:
  """N slots of rollouts in flight (a pytree; every field has N rows).

  Attributes:
    cache: the slots' KV cache, ``index`` [N]: the slot each row's last drawn token is written
      to when it is fed (P + length - 1).
    prompt_ids: int32 [N, P] left-padded prompts.
    prompt_mask: bool [N, P].
    tokens: int32 [N, T] drawn tokens; ``pad_id`` after a row's length.
    logp: float32 [N, T] behaviour log-prob of each token (0 past the length).
    versions: int32 [N, T] version of the parameters that drew each token (0 past the length).
    length: int32 [N] tokens drawn.
    live: bool [N] the slot holds a rollout (unfinished, or finished and not yet released).
    done: bool [N] the row has ended (EOS, T tokens, or its ``stop_at``).
    ended: bool [N] the row ended on an EOS token (else truncated, or stopped by ``stop_at``).
    key: uint32 [N, 2] key data: token t of the row is drawn with ``fold_in(key, t)``.
    stop_at: int32 [N] the row ends after this many tokens (T unless a benchmark sets lengths).
    ticket: int32 [N] the caller's name for the row (-1 for a free slot).
  """

  cache: KVCache
  prompt_ids: jax.Array
  prompt_mask: jax.Array
  tokens: jax.Array
  logp: jax.Array
  versions: jax.Array
  length: jax.Array
  live: jax.Array
  done: jax.Array
  ended: jax.Array
  key: jax.Array
  stop_at: jax.Array
  ticket: jax.Array

  @property
  def slots(self) -> int:
    return self.length.shape[0]

  @property
  def oldest(self) -> jax.Array:
    """int32 [N] version of each row's first token (its oldest; 0 for an empty row)."""
    return self.versions[:, 0]


def init(model_config, slots: int, prompt_len: int, config: sampler_lib.SamplingConfig,
         mesh=None) -> Pool:
  """An empty pool of ``slots`` rows for prompts of P = ``prompt_len`` tokens; with a ``mesh``
  laid out as ``constrain_pool`` says (N a multiple of the batch shards)."""
  if mesh is not None:
    make = lambda: init(model_config, slots, prompt_len, config)
    return jax.jit(make, out_shardings=shardings(mesh, jax.eval_shape(make)))()
  n, p, t = slots, prompt_len, config.max_new_tokens
  cache = KVCache.init(model_config, n, p + t)
  return Pool(cache=cache.replace(index=jnp.full((n,), p, jnp.int32)),
              prompt_ids=jnp.zeros((n, p), jnp.int32), prompt_mask=jnp.zeros((n, p), bool),
              tokens=jnp.full((n, t), config.pad_id, jnp.int32),
              logp=jnp.zeros((n, t), jnp.float32), versions=jnp.zeros((n, t), jnp.int32),
              length=jnp.zeros((n,), jnp.int32), live=jnp.zeros((n,), bool),
              done=jnp.zeros((n,), bool), ended=jnp.zeros((n,), bool),
              key=jnp.zeros((n, 2), jnp.uint32), stop_at=jnp.full((n,), t, jnp.int32),
              ticket=jnp.full((n,), -1, jnp.int32))


def _by_layout(pool: Pool, fn) -> Pool:
  """``fn(field, logical axes)`` of every field: rows over the batch axes, and the cache's
  key/value heads like the k/v projections."""
  rows = lambda x: fn(x, ("batch",) + (None,) * (len(x.shape) - 1))
  heads = lambda x: fn(x, ("batch", "kv_heads", None, None))
  c = pool.cache
  cache = c.replace(k=tuple(map(heads, c.k)), v=tuple(map(heads, c.v)),
                    key_mask_NxS=rows(c.key_mask_NxS), index=rows(c.index))
  return jax.tree.map(rows, pool.replace(cache=None)).replace(cache=cache)


def constrain_pool(pool: Pool) -> Pool:
  """The pool's layout under a mesh (``sharding.use_mesh``; a no-op on one device): every
  field's rows split over the batch axes, as the sampler's batch is, and the cache's key/value
  heads split like the k/v projections. Each jitted pool call ends with it, so the pool keeps
  one layout from call to call and its donation aliases."""
  return _by_layout(pool, sharding_lib.constrain)


def shardings(mesh, pool: Pool) -> Pool:
  """``constrain_pool``'s layout as NamedShardings of ``pool``'s fields (arrays or shapes)."""
  return _by_layout(pool, lambda x, axes: sharding_lib.logical_sharding(mesh, x.shape, axes))


def _model(graphdef: nnx.GraphDef, params: nnx.State) -> CausalLM:
  dtype = jnp.dtype(nnx.merge(graphdef, params).config.dtype)
  return nnx.merge(graphdef, sampler_lib._in_compute_dtype(params, dtype))  # pylint: disable=protected-access


def _draw(logits_NxV, key_Nx2, t_N, config, call_rows: int = 0, index_N=None, active_N=None):
  """One token per row. By default from its own key: row n's uniform is ``fold_in(key_n,
  t_n)``'s. With ``call_rows`` R > 0 (a static round, ``static_round.py``) every row holds the
  round's key and draws what row ``index_n`` of a sampler call on R rows draws
  (``sampler.uniforms(fold_in(key, t), R)[index_n]``), t being the position of the round's
  unfinished rows, which advance together (``active_N``; None: all of them)."""
  if call_rows:
    t = jnp.max(t_N if active_N is None else jnp.where(active_N, t_N, 0))
    u_Rx1 = sampler_lib.uniforms(jax.random.fold_in(jax.random.wrap_key_data(key_Nx2[0]), t),
                                 call_rows)
    u_Nx1 = u_Rx1[jnp.clip(index_N, 0, call_rows - 1)]
  else:
    u_Nx1 = jax.vmap(lambda k, t: sampler_lib.uniforms(
        jax.random.fold_in(jax.random.wrap_key_data(k), t), 1)[0])(key_Nx2, t_N)
  return sampler_lib._choose(logits_NxV, None, config, draw=lambda _: u_Nx1)  # pylint: disable=protected-access


def _ends(token_N, length_N, stop_at_N, config):
  """(done [N], ended on EOS [N]) after a row's ``length_N``-th token ``token_N``."""
  eos_N = jnp.isin(token_N, jnp.asarray(config.eos_ids, jnp.int32))
  return eos_N | (length_N >= jnp.minimum(stop_at_N, config.max_new_tokens)), eos_N


def admit(graphdef: nnx.GraphDef, params: nnx.State, pool: Pool, prompt_ids_MxP,
          prompt_mask_MxP, slots_M, key_Mx2, ticket_M, stop_at_M, version, *,
          config: sampler_lib.SamplingConfig) -> Pool:
  """Prefills M prompts into the slots ``slots_M`` and draws each row's first token.

  With ``config.prompt_group`` G > 1 and prompts in runs of G copies, the prefill runs once
  per prompt (``sampler._prefill``). An entry of ``slots_M`` equal to N (or more) is dropped,
  so a fixed M can admit fewer rows; the slots named must be free (not ``live``).

  Args:
    graphdef, params: the model (``nnx.split``).
    pool: the pool.
    prompt_ids_MxP, prompt_mask_MxP: the prompts (left padded, P as the pool's).
    slots_M: int32 slot of each row.
    key_Mx2: uint32 key data of each row (``jax.random.key_data``).
    ticket_M: int32 the caller's name of each row.
    stop_at_M: int32 most tokens of each row (T for none).
    version: int32 version of ``params``.
    config: the sampling settings (T = ``max_new_tokens``).

  Returns:
    The pool with the rows live, one token drawn each (done if it already ended them).
  """
  rows = _prefilled(graphdef, params, prompt_ids_MxP, prompt_mask_MxP, key_Mx2, ticket_M,
                    stop_at_M, version, config)
  put = lambda a, b: a.at[slots_M].set(b.astype(a.dtype), mode="drop")
  return constrain_pool(jax.tree.map(put, pool, rows))


def admit_all(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids_NxP, prompt_mask_NxP, rng,
              index_N, *, rows: int, config: sampler_lib.SamplingConfig) -> Pool:
  """A pool of exactly these N rows, all admitted at once as the rows ``index_N`` of a sampler
  call on ``rows`` rows with key ``rng`` (a static round, ``static_round.py``): ``admit`` into
  an empty pool of N slots, without the copy of the prefill's cache into the pool's."""
  n, t = prompt_ids_NxP.shape[0], config.max_new_tokens
  key_Nx2 = jnp.broadcast_to(jax.random.key_data(rng), (n, 2))
  return constrain_pool(_prefilled(graphdef, params, prompt_ids_NxP, prompt_mask_NxP, key_Nx2,
                                   index_N.astype(jnp.int32), jnp.full((n,), t, jnp.int32),
                                   jnp.int32(0), config, rows))


def _prefilled(graphdef, params, prompt_ids_MxP, prompt_mask_MxP, key_Mx2, ticket_M, stop_at_M,
               version, config, call_rows: int = 0) -> Pool:
  """The M rows prefilled, one token drawn each (``_draw``), as a pool of their own: ``admit``
  puts them into its slots, ``admit_all`` is them."""
  model = _model(graphdef, params)
  m, p = prompt_ids_MxP.shape
  t = config.max_new_tokens
  prompt_mask_MxP = prompt_mask_MxP.astype(bool)
  logits_MxV, cache = sampler_lib._prefill(model, prompt_ids_MxP, prompt_mask_MxP, p + t,  # pylint: disable=protected-access
                                           config.prompt_group)
  token_M, logp_M = _draw(logits_MxV, key_Mx2, jnp.zeros((m,), jnp.int32), config, call_rows,
                          ticket_M)
  one = jnp.ones((m,), jnp.int32)
  done_M, eos_M = _ends(token_M, one, stop_at_M, config)
  first = lambda x0, fill, dtype: jnp.full((m, t), fill, dtype).at[:, 0].set(x0)
  return Pool(cache=cache.replace(index=jnp.full((m,), p, jnp.int32)),
              prompt_ids=prompt_ids_MxP, prompt_mask=prompt_mask_MxP,
              tokens=first(token_M, config.pad_id, jnp.int32),
              logp=first(logp_M, 0.0, jnp.float32),
              versions=first(jnp.broadcast_to(version, (m,)), 0, jnp.int32), length=one,
              live=jnp.ones((m,), bool), done=done_M, ended=eos_M, key=key_Mx2,
              stop_at=stop_at_M, ticket=ticket_M)


def decode(graphdef: nnx.GraphDef, params: nnx.State, pool: Pool, version, *, steps: int,
           config: sampler_lib.SamplingConfig, call_rows: int = 0) -> tuple[Pool, jax.Array]:
  """Advances every live, unfinished row by up to ``steps`` tokens (a chunk).

  Each step feeds every slot's last token through the model (the N slots are one batch:
  free and finished slots are computed too, and their results dropped) and draws the next
  token of each unfinished row; the loop stops early once no row is unfinished. With
  ``call_rows`` (a static round, ``static_round.py``: every unfinished row at one position)
  the rows draw as the rows of one sampler call (``_draw``), and the cache and the tokens are
  written one slot and one column for all rows, as the sampler writes them.

  Returns:
    (the pool, int32 decode steps run: N token positions were computed at each).
  """
  model = _model(graphdef, params)
  n, p = pool.prompt_ids.shape
  t_max = config.max_new_tokens
  first_position_N = jnp.sum(pool.prompt_mask, axis=-1).astype(jnp.int32)
  rows = jnp.arange(n)

  def cond(state):
    i, pool = state
    return (i < steps) & jnp.any(pool.live & ~pool.done)

  def body(state):
    i, pool = state
    active_N = pool.live & ~pool.done
    last_N = pool.tokens[rows, jnp.maximum(pool.length - 1, 0)]
    if call_rows:  # a static round: every unfinished row writes the same slot (one slice)
      index = p + jnp.maximum(jnp.max(jnp.where(active_N, pool.length, 0)) - 1, 0)
    else:
      index = p + jnp.maximum(pool.length - 1, 0)
    h_Nx1xD, cache = model.hidden_states(last_N[:, None], jnp.ones((n, 1), bool),
                                         (first_position_N + pool.length - 1)[:, None],
                                         pool.cache.replace(index=index))
    cache = cache.replace(index=pool.cache.index)  # the pool's own [N]: set again each step
    token_N, logp_N = _draw(model.logits(h_Nx1xD[:, 0]), pool.key, pool.length, config,
                            call_rows, pool.ticket, active_N)
    length_N = pool.length + active_N.astype(jnp.int32)
    done_N, eos_N = _ends(token_N, length_N, pool.stop_at, config)
    if call_rows:
      # A static round: the unfinished rows' tokens go to one column (a slice, as the sampler
      # writes them), a finished row keeps its pad and 0; the versions stay those of admission.
      column = jnp.max(jnp.where(active_N, pool.length, 0))
      put = lambda a, b, fill: jax.lax.dynamic_update_slice(
          a, jnp.where(active_N, b, fill).astype(a.dtype)[:, None], (0, column))
      written = dict(tokens=put(pool.tokens, token_N, config.pad_id),
                     logp=put(pool.logp, logp_N, 0.0))
    else:
      at_N = jnp.where(active_N, pool.length, t_max)  # t_max: out of range, dropped
      put = lambda a, b: a.at[rows, at_N].set(b, mode="drop")
      written = dict(tokens=put(pool.tokens, token_N), logp=put(pool.logp, logp_N),
                     versions=put(pool.versions, jnp.broadcast_to(version, (n,)).astype(
                         jnp.int32)))
    pool = pool.replace(
        cache=cache, **written, length=length_N, done=jnp.where(active_N, done_N, pool.done),
        ended=jnp.where(active_N, eos_N, pool.ended))
    return i + 1, pool

  steps_run, pool = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), pool))
  return constrain_pool(pool), steps_run


def release(pool: Pool, free_N) -> Pool:
  """The pool with the slots where ``free_N`` is True emptied (harvested or discarded rows)."""
  return constrain_pool(pool.replace(live=pool.live & ~free_N, done=pool.done & ~free_N,
                                    ticket=jnp.where(free_N, -1, pool.ticket)))


def reprefill(graphdef: nnx.GraphDef, params: nnx.State, pool: Pool) -> Pool:
  """The pool with every slot's cache recomputed under ``params`` (one forward pass over each
  row's prompt and the tokens it has fed, [N, P + T] positions): continued rows then attend to
  keys and values of the current parameters, as a fresh row would. Tokens, log-probs and
  versions are unchanged (each token keeps the distribution it was drawn from)."""
  model = _model(graphdef, params)
  n, p = pool.prompt_ids.shape
  t = pool.tokens.shape[1]
  fed_NxT = jnp.arange(t)[None, :] < (pool.length - 1)[:, None]
  ids = jnp.concatenate([pool.prompt_ids, pool.tokens], axis=1)
  mask = jnp.concatenate([pool.prompt_mask, fed_NxT], axis=1)
  positions = jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1
  fresh = model.init_cache(n, p + t)
  _, cache = model.hidden_states(ids, mask, jnp.maximum(positions, 0), fresh)
  return constrain_pool(pool.replace(cache=cache.replace(index=pool.cache.index)))


@functools.lru_cache(maxsize=32)
def make_pool_fns(graphdef: nnx.GraphDef, config: sampler_lib.SamplingConfig, steps: int,
                  mesh=None):
  """(admit, decode, release, reprefill) jitted, the pool donated: ``admit(params, pool, ids,
  mask, slots, keys, tickets, stop_at, version)``, ``decode(params, pool, version) -> (pool,
  steps run)`` of chunks of ``steps`` tokens, ``release(pool, free)``, ``reprefill(params,
  pool)``. One compilation per admitted row count M (pad M to a few sizes); the functions are
  cached per (graphdef, config, steps, mesh), so pools of one model share their compilations.
  With a ``mesh`` each is traced under it: the pool (from ``init(..., mesh=mesh)``) keeps its
  rows split over the batch axes (``constrain_pool``), the parameters their own layout, and
  the host's inputs (prompts, slots, keys) are placed by the call."""
  under = (lambda fn: fn) if mesh is None else (
      lambda fn: sharding_lib.use_mesh(fn, mesh))
  return (jax.jit(under(functools.partial(admit, graphdef, config=config)), donate_argnums=(1,)),
          jax.jit(under(functools.partial(decode, graphdef, steps=steps, config=config)),
                  donate_argnums=(1,)),
          jax.jit(under(release), donate_argnums=(0,)),
          jax.jit(under(functools.partial(reprefill, graphdef)), donate_argnums=(1,)))
