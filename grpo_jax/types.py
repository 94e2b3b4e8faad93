"""Pytrees that cross module boundaries, and the shape-letter glossary.

Shape letters, used as suffixes in array names (``logp_NxT``) and in docstrings:
  B  groups (prompts) per step          G  rollouts per group
  N  rows of a flat batch (N = B * G)   P  prompt tokens (left padded)
  T  completion tokens                  V  vocabulary
  C  replay-buffer capacity (entries)   L  layers
  D  model width

Masks are bool; log-probs and everything a loss touches are float32.
"""

from __future__ import annotations

import flax
import jax


@flax.struct.dataclass
class Completions:
  """What the sampler returns for N left-padded prompts.

  Attributes:
    tokens_NxT: int32 completion tokens; ``pad_id`` after the end of each completion.
    mask_NxT: bool, True for generated tokens up to and including the first EOS.
    logp_NxT: float32 log-probability of each token under the distribution it was sampled
      from (temperature and top-k / top-p applied); 0 where ``mask_NxT`` is False.
    lengths_N: int32 number of True entries of ``mask_NxT``.
    truncated_N: bool, True when a row reached T tokens without emitting EOS.
  """

  tokens_NxT: jax.Array
  mask_NxT: jax.Array
  logp_NxT: jax.Array
  lengths_N: jax.Array
  truncated_N: jax.Array
