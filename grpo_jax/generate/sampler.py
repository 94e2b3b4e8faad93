"""Jitted autoregressive sampling over a fixed-size KV cache.

One prefill pass over the left-padded prompts [N, P] fills cache slots [0, P); a
``lax.while_loop`` then decodes one token per iteration into slots [P, P + T). The loop stops as
soon as every row has emitted EOS, and skips the forward pass after the last token, so no
decode step is computed that no row needs. Shapes depend only on (N, P, T): one compilation per
shape (tests/generate/test_sampler.py counts them).

The log-prob recorded for each token is that of the distribution it was actually drawn from
(temperature, then optional top-k and top-p, renormalised): the behaviour policy mu of the
off-policy corrections in POPO (arXiv 2606.01281) and decoupled PPO (arXiv 2110.00641).

The model is any ``models.CausalLM`` (its ``init_cache`` and cached ``hidden_states``); shape
letters: ``types.py``.

A run generates on the slot pool (``pool.py``): its static rounds and evaluations are
``static_round.py``, which uses this module's prefill, draw and settings and gives this loop's
tokens bit for bit; ``sample`` itself stays as the benchmarks' reference static batch.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import sharding as sharding_lib
from grpo_jax.models.causal_lm import CausalLM, positions_from_mask, prompts_repeat
from grpo_jax.types import Rollout

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """Static sampling settings (hashable: part of the jit cache key).

  Attributes:
    max_new_tokens: T, completion length budget.
    eos_ids: token ids that end a completion (Qwen3 chat models have two).
    pad_id: id written after the end of a completion.
    temperature: 0 means greedy (recorded log-probs are then those at temperature 1).
    top_k: keep only the k most likely tokens; 0 disables.
    top_p: keep the smallest set of tokens whose probability reaches p; 1.0 disables.
    prompt_group: rows come in runs of this many copies of one prompt (GRPO's G rollouts per
      prompt, group-major). When every run really is one prompt repeated (checked on the
      device at each call) the prefill runs once per prompt and its cache is repeated;
      otherwise, or with 1, every row is prefilled. Same tokens either way.
    row_block: most rows one prefill + decode holds at a time (0: all N). With N rows in
      blocks of ``row_block`` (a multiple of ``prompt_group`` dividing N), the blocks run one
      after another (``lax.map``), each with its own KV cache of ``row_block`` rows and its own
      decode loop (it stops when its rows are done): the cache's memory is that of one block.
      Block b holds every (N / row_block)-th group from group b on (strided, so that under a
      mesh each device keeps its own rows), and draws the uniforms the unblocked call would
      give its rows: the same tokens, up to the matmuls' rounding at another row count.
  """

  max_new_tokens: int
  eos_ids: tuple[int, ...]
  pad_id: int
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  prompt_group: int = 1
  row_block: int = 0

  def __post_init__(self):
    if self.prompt_group < 1:
      raise ValueError(f"prompt_group must be >= 1, got {self.prompt_group}")
    if self.row_block < 0 or self.row_block % self.prompt_group:
      raise ValueError(f"row_block must be 0 or a positive multiple of prompt_group "
                       f"({self.prompt_group}), got {self.row_block}")
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if not self.eos_ids:
      raise ValueError("eos_ids must name at least one token")
    object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))


def filter_logits(logits_NxV: jax.Array, config: SamplingConfig) -> jax.Array:
  """Temperature-scaled float32 logits with tokens outside top-k / top-p set to -inf."""
  logits = logits_NxV.astype(jnp.float32)
  if config.temperature > 0:
    logits = logits / config.temperature
  if config.top_k > 0 and config.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, _NEG_INF, logits)
  if config.top_p < 1.0:
    sorted_desc = jnp.sort(logits, axis=-1)[..., ::-1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep a token when the mass strictly before it is below p (the top token always stays).
    before = jnp.cumsum(probs, axis=-1) - probs
    cutoff = jnp.min(jnp.where(before < config.top_p, sorted_desc, jnp.inf), axis=-1,
                     keepdims=True)
    logits = jnp.where(logits < cutoff, _NEG_INF, logits)
  return logits


def uniforms(key, n: int) -> jax.Array:
  """The [n, 1] uniforms in (0, 1) one token's draw of n rows uses (``_inverse_cdf_sample``)."""
  return jax.random.uniform(key, (n, 1), minval=jnp.finfo(jnp.float32).tiny)


def _inverse_cdf_sample(u_Nx1, logp_NxV):
  """One draw per row from softmax probabilities by inverting the CDF at ``u_Nx1``.

  Exactly the categorical distribution, from N uniforms instead of the N * V Gumbel variates
  of ``jax.random.categorical``: generating those was a quarter of a decode step on CPU.
  Zero-probability (filtered) tokens leave the CDF flat and can never be the first index
  where it reaches u, since u > 0.
  """
  cdf_NxV = jnp.cumsum(jnp.exp(logp_NxV), axis=-1)
  return jnp.argmax(cdf_NxV >= u_Nx1 * cdf_NxV[:, -1:], axis=-1)


def _choose(logits_NxV, key, config: SamplingConfig, draw=None):
  """Draws one token per row; returns (tokens [N], behaviour log-probs [N]). ``draw(key)``
  gives the rows' uniforms (default ``uniforms(key, N)``)."""
  if config.temperature == 0:
    tokens_N = jnp.argmax(logits_NxV, axis=-1)
    logp_NxV = jax.nn.log_softmax(logits_NxV.astype(jnp.float32), axis=-1)
  else:
    filtered_NxV = filter_logits(logits_NxV, config)
    logp_NxV = jax.nn.log_softmax(filtered_NxV, axis=-1)
    u_Nx1 = (draw or (lambda k: uniforms(k, logits_NxV.shape[0])))(key)
    tokens_N = _inverse_cdf_sample(u_Nx1, logp_NxV)
  logp_N = jnp.take_along_axis(logp_NxV, tokens_N[:, None], axis=-1)[:, 0]
  return tokens_N.astype(jnp.int32), logp_N


def _in_compute_dtype(params: nnx.State, dtype) -> nnx.State:
  """Floating parameters cast once to the compute dtype, before the decode loop.

  Every layer casts its weights to the compute dtype where it uses them, so the values are
  the same; casting once up front keeps the loop from re-reading float32 master weights (and
  re-casting them) at every token when ``param_dtype`` is float32 and ``dtype`` bfloat16.
  """
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      params)


def _prefill(model: CausalLM, prompt_ids_NxP, prompt_mask_NxP, size: int, group: int):
  """The prompts' cache (``size`` slots) and the logits of each row's first token.

  With ``group > 1`` and prompts that repeat in runs of ``group`` rows (``prompts_repeat``),
  only the first row of each run is run through the model and its cache entries and logits
  are repeated: the prefill costs N / group rows instead of N.

  Returns:
    (float32 logits [N, V], the model's cache for N rows with P slots written).
  """
  n = prompt_ids_NxP.shape[0]

  def prefill(ids_NxP, mask_NxP):
    cache = model.init_cache(ids_NxP.shape[0], size)
    hidden_NxPxD, cache = model.hidden_states(ids_NxP, mask_NxP, positions_from_mask(mask_NxP),
                                              cache)
    return model.logits(hidden_NxPxD[:, -1]), cache

  if group <= 1 or n % group:
    return prefill(prompt_ids_NxP, prompt_mask_NxP)

  def shared(ids_NxP, mask_NxP):
    logits_BxV, cache = prefill(ids_NxP[::group], mask_NxP[::group])
    repeat = lambda x: jnp.repeat(x, group, axis=0) if x.ndim else x
    return repeat(logits_BxV), jax.tree.map(repeat, cache)

  return jax.lax.cond(prompts_repeat(prompt_ids_NxP, prompt_mask_NxP, group), shared, prefill,
                      prompt_ids_NxP, prompt_mask_NxP)


def sample(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids_NxP: jax.Array,
           prompt_mask_NxP: jax.Array, rng: jax.Array, *,
           config: SamplingConfig) -> Rollout:
  """Samples one completion per prompt row (pure; jit with ``make_sampler``).

  Args:
    graphdef: static structure of the model (from ``nnx.split``).
    params: the model's state.
    prompt_ids_NxP: int32 prompts, left padded (every row has at least one real token).
    prompt_mask_NxP: True for real prompt tokens.
    rng: PRNG key; token t of every row uses ``fold_in(rng, t)``.
    config: static sampling settings (``row_block``: the rows in blocks, one at a time).

  Returns:
    A Rollout of the N rows: the prompts, [N, T] completion tokens, mask and behaviour
    log-probs, the truncation flags; scores, success, prompt_id and version unset (0, False,
    -1, 0) for the host to fill (version [N, T]).

  Raises:
    ValueError: ``config.row_block`` does not divide N (at trace time).
  """
  dtype = jnp.dtype(nnx.merge(graphdef, params).config.dtype)
  model: CausalLM = nnx.merge(graphdef, _in_compute_dtype(params, dtype))
  n = prompt_ids_NxP.shape[0]
  rows = config.row_block
  if not rows or rows >= n:
    return _sample_rows(model, prompt_ids_NxP, prompt_mask_NxP, rng, config)
  if n % rows:
    raise ValueError(f"sampler row_block {rows} does not divide the {n} rows")
  blocks = n // rows
  to_blocks, from_blocks = row_blocks(n, rows, config.prompt_group)

  def block(inputs):
    ids_RxP, mask_RxP, b = inputs
    draw = lambda key: to_blocks(uniforms(key, n))[b]  # the unblocked call's uniforms
    return _sample_rows(model, ids_RxP, mask_RxP, rng, config, draw)

  out = jax.lax.map(block, (to_blocks(prompt_ids_NxP), to_blocks(prompt_mask_NxP),
                            jnp.arange(blocks)))
  return jax.tree.map(from_blocks, out)


def row_blocks(n: int, rows: int, group: int):
  """(to_blocks, from_blocks) between N rows and [N / rows, rows] blocks: row i = (j * blocks +
  b) * group + g is row j * group + g of block b (every (N / rows)-th group from group b on, so
  that under a mesh each device keeps its own rows)."""
  blocks = n // rows
  to_blocks = lambda x: jnp.swapaxes(
      x.reshape((rows // group, blocks, group) + x.shape[1:]), 0, 1).reshape(
          (blocks, rows) + x.shape[1:])
  from_blocks = lambda x: jnp.swapaxes(
      x.reshape((blocks, rows // group, group) + x.shape[2:]), 0, 1).reshape(
          (n,) + x.shape[2:])
  return to_blocks, from_blocks


def _sample_rows(model: CausalLM, prompt_ids_NxP, prompt_mask_NxP, rng,
                 config: SamplingConfig, draw=None) -> Rollout:
  """``sample`` of N rows in one prefill and one decode loop; ``draw(key)`` gives the rows'
  uniforms of a token (``_choose``)."""
  n, p = prompt_ids_NxP.shape
  t_max = config.max_new_tokens
  prompt_mask_NxP = prompt_mask_NxP.astype(bool)
  logits_NxV, cache = _prefill(model, prompt_ids_NxP, prompt_mask_NxP, p + t_max,
                               config.prompt_group)
  first_position_N = jnp.sum(prompt_mask_NxP, axis=-1).astype(jnp.int32)
  eos_ids = jnp.asarray(config.eos_ids, jnp.int32)

  def emit(t, logits_NxV, tokens_NxT, logp_NxT, done_N, lengths_N):
    """Draws token t of every unfinished row and records it."""
    token_N, logp_N = _choose(logits_NxV, jax.random.fold_in(rng, t), config, draw)
    token_N = jnp.where(done_N, config.pad_id, token_N)
    logp_N = jnp.where(done_N, 0.0, logp_N)
    tokens_NxT = jax.lax.dynamic_update_slice(tokens_NxT, token_N[:, None], (0, t))
    logp_NxT = jax.lax.dynamic_update_slice(logp_NxT, logp_N[:, None], (0, t))
    lengths_N = lengths_N + (~done_N).astype(jnp.int32)
    return token_N, tokens_NxT, logp_NxT, done_N | jnp.isin(token_N, eos_ids), lengths_N

  # Token 0 comes from the prefill logits; each loop iteration feeds the previous token and
  # draws the next, so exactly one decode forward runs per token after the first, none wasted.
  token_N, tokens_NxT, logp_NxT, done_N, lengths_N = emit(
      0, logits_NxV, jnp.full((n, t_max), config.pad_id, jnp.int32),
      jnp.zeros((n, t_max), jnp.float32), jnp.zeros((n,), bool), jnp.zeros((n,), jnp.int32))

  def cond(state):
    t, done_N = state[0], state[4]
    return (t < t_max) & ~jnp.all(done_N)

  def body(state):
    t, cache, token_N, tokens_NxT, done_N, logp_NxT, lengths_N = state
    h_Nx1xD, cache = model.hidden_states(token_N[:, None], jnp.ones((n, 1), bool),
                                         (first_position_N + t - 1)[:, None], cache)
    token_N, tokens_NxT, logp_NxT, done_N, lengths_N = emit(
        t, model.logits(h_Nx1xD[:, 0]), tokens_NxT, logp_NxT, done_N, lengths_N)
    return t + 1, cache, token_N, tokens_NxT, done_N, logp_NxT, lengths_N

  state = (jnp.ones((), jnp.int32), cache, token_N, tokens_NxT, done_N, logp_NxT, lengths_N)
  _, _, _, tokens_NxT, done_N, logp_NxT, lengths_N = jax.lax.while_loop(cond, body, state)
  mask_NxT = jnp.arange(t_max)[None, :] < lengths_N[:, None]
  return Rollout(prompt_ids=prompt_ids_NxP, prompt_mask=prompt_mask_NxP,
                 completion_ids=tokens_NxT, completion_mask=mask_NxT, behaviour_logp=logp_NxT,
                 truncated=~done_N, scores=jnp.zeros((n,), jnp.float32),
                 success=jnp.zeros((n,), bool), prompt_id=jnp.full((n,), -1, jnp.int32),
                 version=jnp.zeros((n, t_max), jnp.int32))


def make_sampler(graphdef: nnx.GraphDef, config: SamplingConfig, mesh=None):
  """``fn(params, prompt_ids_NxP, prompt_mask_NxP, rng) -> Rollout``, jitted once per shape.

  With a ``mesh`` the prompts' rows (and the KV cache's) are split over the batch axes, the
  parameters keep the layout they come with (``sharding.tree_shardings``), and the completions
  come back replicated, so that every process can read (and score) all of them. N must then be
  a multiple of the batch shards (``sharding.batch_shards``).
  """
  return jit_rows(functools.partial(sample, graphdef, config=config), mesh)


def jit_rows(fn, mesh=None):
  """``fn(params, prompt_ids_NxP, prompt_mask_NxP, rng) -> Rollout`` jitted; under a ``mesh``
  the rows split over the batch axes and the result replicated (``make_sampler``'s layout)."""
  if mesh is None:
    return jax.jit(fn)
  rows, everywhere = sharding_lib.rows_sharding(mesh), sharding_lib.replicated(mesh)
  in_shardings = (None, rows, rows, everywhere)
  jitted = jax.jit(sharding_lib.use_mesh(fn, mesh), in_shardings=in_shardings,
                   out_shardings=everywhere)
  return sharding_lib.PutInputs(jitted, in_shardings)


@functools.lru_cache(maxsize=16)
def cached_sampler(graphdef: nnx.GraphDef, config: SamplingConfig, mesh=None):
  """``make_sampler``, one per (model structure, sampling config, mesh) in a process: the
  rollouts and the evaluations of a run, and a run built twice in one process (a resume, the
  next seed), trace, lower and compile each of their samplers once."""
  return make_sampler(graphdef, config, mesh)


GENERATION_CONFIG = "generation_config.json"


def _as_ids(value) -> list[int]:
  """An ``eos_token_id`` field (None, an int or a list of ints) as a list."""
  if value is None:
    return []
  if isinstance(value, (list, tuple)):
    return [int(i) for i in value if i is not None]
  return [int(value)]


def stop_token_ids(tokenizer, model_path: str | None = None) -> tuple[int, ...]:
  """Token ids that end a completion: the tokenizer's EOS, then the model folder's.

  Qwen3 instruct checkpoints stop on both ``<|im_end|>`` (the tokenizer's eos_token) and
  ``<|endoftext|>``; the second is only named by ``generation_config.json``.

  Args:
    tokenizer: transformers tokenizer (its ``eos_token_id`` comes first; None is skipped).
    model_path: Hugging Face model folder; its ``generation_config.json`` is read when it exists
      (a missing file, or no path, means the tokenizer's id alone).

  Returns:
    The ids in order of first appearance, without repeats (empty if neither names one).

  Raises:
    ValueError: ``generation_config.json`` exists but cannot be read (names the file).
  """
  ids = _as_ids(tokenizer.eos_token_id)
  if model_path is not None:
    path = os.path.join(model_path, GENERATION_CONFIG)
    if os.path.isfile(path):
      import transformers  # pylint: disable=g-import-not-at-top
      try:
        gen = transformers.GenerationConfig.from_pretrained(model_path)
        ids += _as_ids(getattr(gen, "eos_token_id", None))
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(f"cannot read the stop tokens of {path}: {e}") from e
  return tuple(dict.fromkeys(ids))


def sampling_config_for(tokenizer, max_new_tokens: int, *, temperature: float = 1.0,
                        top_k: int = 0, top_p: float = 1.0,
                        extra_eos_ids: Sequence[int] = (),
                        model_path: str | None = None,
                        prompt_group: int = 1, row_block: int = 0) -> SamplingConfig:
  """SamplingConfig whose EOS / pad ids come from a transformers tokenizer.

  The EOS ids are ``stop_token_ids(tokenizer, model_path)`` followed by ``extra_eos_ids``.
  """
  eos = (*stop_token_ids(tokenizer, model_path), *(int(i) for i in extra_eos_ids))
  eos = tuple(dict.fromkeys(eos))
  pad = tokenizer.pad_token_id
  if pad is None:
    pad = eos[0] if eos else 0  # no EOS at all: SamplingConfig says so
  return SamplingConfig(max_new_tokens=max_new_tokens, eos_ids=eos, pad_id=int(pad),
                        temperature=temperature, top_k=top_k, top_p=top_p,
                        prompt_group=prompt_group, row_block=row_block)
