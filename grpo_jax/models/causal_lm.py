"""The causal language model interface the sampler and the log-prob passes use, and the
model-independent helpers of its inputs (shape letters: ``types.py``).

Every model family's model satisfies ``CausalLM``; nothing outside ``grpo_jax/models`` needs
to know which family it holds. The sampler's prefill is ``hidden_states`` of the prompts into
``init_cache(N, P + T)``, its decode step ``hidden_states`` of one token per row (X = 1) with
that cache; the teacher-forced log-prob pass is ``hidden_states`` (or
``grouped_hidden_states``) without a cache, then ``logits``.

Every ``CausalLM`` keeps its decoder blocks in its attribute ``layers`` (``LAYERS``): one module
whose parameters carry a leading layer axis L (``layers.self_attn.q_proj.kernel`` [L, D, H * W]),
so that the passes without a cache scan over the blocks and compile one whatever the depth. One
layer's parameter is named with its index after ``layers`` (``layers.3.self_attn.q_proj``):
checkpoint tensors, LoRA targets and adapter folders are named per layer (``layer_path``).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import jax
import jax.numpy as jnp


LAYERS = "layers"


def is_stacked(path: tuple) -> bool:
  """Whether the parameter at ``path`` (a tuple of names) belongs to the stacked ``layers``:
  its leading axis is the layer."""
  return bool(path) and str(path[0]) == LAYERS


def layer_path(path: tuple, layer: int) -> tuple:
  """The path of layer ``layer``'s slice of a stacked parameter (``is_stacked``):
  ``('layers', 'mlp', 'up_proj', 'kernel')`` -> ``('layers', 3, 'mlp', 'up_proj', 'kernel')``."""
  return (path[0], layer, *path[1:])


# The dtypes a model stores its parameters in and runs its matmuls in (float16 would need loss
# scaling, which nothing here does): ModelConfig and the config validator both check these.
DTYPES = ("float32", "bfloat16")

class LMConfig(Protocol):
  """What generic code reads of a model's config (the rest is the family's own)."""

  @property
  def model_type(self) -> str:
    """The Hugging Face ``model_type`` the config saves as (its family's registry key)."""

  @property
  def dtype(self) -> str:
    """Compute dtype of matmuls (one of ``DTYPES``)."""


class CausalLM(Protocol):
  """A decoder-only language model: token ids in, final hidden states and logits out."""

  config: LMConfig

  def __call__(self, input_ids_NxS: jax.Array, attention_mask_NxS: Optional[jax.Array] = None,
               positions_NxS: Optional[jax.Array] = None) -> jax.Array:
    """float32 logits [N, S, V] of left-padded rows (no cache)."""

  def init_cache(self, batch: int, size: int) -> Any:
    """An empty cache (a pytree) of ``size`` slots S for ``batch`` rows N."""

  def hidden_states(self, input_ids_NxX: jax.Array,
                    attention_mask_NxX: Optional[jax.Array] = None,
                    positions_NxX: Optional[jax.Array] = None, cache: Any = None,
                    remat: bool = False, query_block: int = 0) -> tuple[jax.Array, Any]:
    """(Final-norm hidden states [N, X, D], the updated cache or None).

    Without a cache the X positions attend causally among themselves; with one they are
    written at the cache's next slots and attend to every earlier real slot. ``remat``
    checkpoints each block (no cache); ``query_block`` > 0 computes attention that many
    queries at a time. Neither changes a value.
    """

  def grouped_hidden_states(self, prompt_ids_BxP: jax.Array, prompt_mask_BxP: jax.Array,
                            completion_ids_NxT: jax.Array, group: int, remat: bool = False,
                            query_block: int = 0) -> tuple[jax.Array, jax.Array]:
    """(Prompt hidden [B, P, D], completion hidden [N, T, D]): N = B * group rows, row i
    continuing prompt i // group, each prompt computed once."""

  def packed_hidden_states(self, input_ids_NxC: jax.Array, positions_NxC: jax.Array,
                           segments: Any, remat: bool = False,
                           query_block: int = 0) -> jax.Array:
    """Final-norm hidden states [N, C, D] of packed rows, each slot attending to its own
    sequence's keys (``models.packed_attention.Segments``; ``generate.packing``)."""

  def logits(self, hidden_xD: jax.Array) -> jax.Array:
    """float32 logits [..., V] from final hidden states [..., D]."""


def positions_from_mask(mask_NxS: jax.Array) -> jax.Array:
  """Position ids for left-padded rows: 0 at the first real token, pads clipped to 0."""
  return jnp.maximum(jnp.cumsum(mask_NxS.astype(jnp.int32), axis=-1) - 1, 0)


def prompts_repeat(prompt_ids_NxP: jax.Array, prompt_mask_NxP: jax.Array,
                   group: int) -> jax.Array:
  """True when rows come in runs of ``group`` copies of one prompt (bool scalar, on device).

  GRPO's batches are group-major (G rollouts of each prompt in a row); the sampler's prefill
  and the grouped log-prob pass (``CausalLM.grouped_hidden_states``) then need the prompt once
  per run. False when N is not a multiple of ``group``; True for ``group`` 1.
  """
  n, p = prompt_ids_NxP.shape
  if group <= 1 or n % group:
    return jnp.asarray(group <= 1)
  ids_BxGxP = prompt_ids_NxP.reshape(n // group, group, p)
  mask_BxGxP = prompt_mask_NxP.astype(bool).reshape(n // group, group, p)
  return jnp.all((ids_BxGxP == ids_BxGxP[:, :1]) & (mask_BxGxP == mask_BxGxP[:, :1]))
