"""Model FLOPs of the GRPO step's phases, counted from a ModelConfig (pure functions).

Conventions, the same in every function here:

* 2 FLOPs per multiply-add. Counted: every matmul of the model (q/k/v/o projections, the three
  SwiGLU matmuls, the LM head) and the two attention products (scores q.k and the weighted sum
  of values). Not counted: elementwise work (norms, RoPE, softmax, SiLU, residual adds, masks,
  log-softmax, sampling) and the embedding lookup (a gather). XLA's own count
  (``cost_analysis()``) adds those, a few percent at the shapes of this project
  (tests/bench/test_bench_flops.py compares the two).
* Attention is counted as the dense kernel (``model.attention=xla``) executes it, not as the
  causal minimum: the full masked [queries, keys] score matrix (``attention.attention``), so a
  teacher-forced pass over S = P + T tokens costs S * S score entries per head, not
  S * (S + 1) / 2; a cached pass attends every query to all the cache's slots, written or not
  (the sampler's cache has P + T slots from the start). The ``blocked`` kernel skips the key
  blocks above the diagonal and decodes over the filled prefix only, about half of that: its
  model FLOPs here are the dense count (the same work a reader compares kernels on).
* A backward pass costs twice its forward pass (the gradient with respect to the inputs and
  with respect to the weights of every matmul), so a differentiated pass is 3x a forward.
  Recomputation under ``remat="layer"`` is not counted: these are model FLOPs, the work the
  step needs, the numerator of model FLOPs utilisation.

Shape letters (``types.py``): D width, H query heads, K key/value heads, W head width, F MLP
width, V vocab, L layers; N rows, P prompt length, T completion length.

``fit_growth`` (the fits of ``bench/growth.py``) is here too, as another pure function.
"""

from __future__ import annotations

import numpy as np

from grpo_jax.models.model_config import ModelConfig


def matmul_flops_per_token(config: ModelConfig) -> int:
  """FLOPs of the L decoder blocks' weight matmuls for one token (attention products excluded).

  Per layer: q [D, H*W], k and v [D, K*W] each, o [H*W, D], gate and up [D, F], down [F, D].
  """
  c = config
  macs = (c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
          + 3 * c.hidden_size * c.intermediate_size)
  return 2 * macs * c.num_layers


def attention_flops(config: ModelConfig, queries: int, keys: int) -> int:
  """FLOPs of the attention products of ``queries`` tokens over ``keys`` slots, one row, L layers.

  Per layer, query and key slot: scores (H heads of a W dot product) and the weighted sum of
  values (H heads of W multiply-adds), 2 * H * W multiply-adds. GQA shares keys between the
  H / K query heads of a group but does not share the products, so K does not appear.
  """
  c = config
  return 2 * 2 * c.num_heads * c.head_dim * queries * keys * c.num_layers


def lm_head_flops(config: ModelConfig, positions: int) -> int:
  """FLOPs of the LM head ([D, V], tied or not) at ``positions`` positions."""
  return 2 * config.hidden_size * config.vocab_size * positions


def forward_flops(config: ModelConfig, rows: int, prompt_len: int, completion_len: int, *,
                  lm_head_positions: int, prompt_group: int = 1) -> int:
  """Model FLOPs of one teacher-forced forward pass over ``rows`` rows of P + T tokens.

  The pass of ``logprobs.completion_logprobs_and_entropy``: all S = P + T tokens through the L
  blocks, the full masked S x S attention per head (what the code computes: S * S, not the
  causal half), and the LM head at ``lm_head_positions`` positions per row only (T for a
  log-prob pass; P + T for ``Qwen3.__call__``).

  Args:
    config: the architecture.
    rows: N.
    prompt_len: P.
    completion_len: T.
    lm_head_positions: positions per row the LM head is applied at.
    prompt_group: > 1 counts the grouped pass (``Qwen3.grouped_hidden_states``): rows / group
      prompts of P tokens attending causally (P x P), and per row T' = T - 1 completion tokens
      (the last predicts nothing and is left out; T' = 1 when T = 1) attending to P + T' keys.

  Returns:
    FLOPs (2 per multiply-add) of the whole batch.
  """
  if prompt_group > 1 and rows % prompt_group == 0:
    p, tc = prompt_len, max(completion_len - 1, 1)
    prompts = rows // prompt_group * (p * matmul_flops_per_token(config)
                                      + attention_flops(config, p, p))
    completions = rows * (tc * matmul_flops_per_token(config)
                          + attention_flops(config, tc, p + tc)
                          + lm_head_flops(config, lm_head_positions))
    return prompts + completions
  s = prompt_len + completion_len
  per_row = (s * matmul_flops_per_token(config) + attention_flops(config, s, s)
             + lm_head_flops(config, lm_head_positions))
  return rows * per_row


def train_flops(config: ModelConfig, rows: int, prompt_len: int, completion_len: int, *,
                lm_head_positions: int, prompt_group: int = 1) -> int:
  """Model FLOPs of a differentiated pass: forward + backward = 3 x ``forward_flops``."""
  return 3 * forward_flops(config, rows, prompt_len, completion_len,
                           lm_head_positions=lm_head_positions, prompt_group=prompt_group)


def generation_flops(config: ModelConfig, rows: int, prompt_len: int,
                     completion_len: int, prompt_group: int = 1) -> int:
  """Model FLOPs of ``sampler.sample`` drawing ``completion_len`` tokens for ``rows`` rows.

  Prefill: the P prompt tokens through the L blocks, each attending to the cache's P + T slots
  (the cached path masks the unwritten slots but computes them), and the LM head at the last
  position only. Then T - 1 decode steps (the first token comes from the prefill's logits):
  one token per row through the blocks, attending to all P + T slots, and the LM head. Every
  row runs to T tokens (no early stop at EOS: an upper bound when rows can end early).

  Args:
    config: the architecture.
    rows: N.
    prompt_len: P.
    completion_len: T.
    prompt_group: > 1 counts the shared prefill (``SamplingConfig.prompt_group``): rows /
      group prompts are prefilled.

  Returns:
    FLOPs (2 per multiply-add) of the whole batch.
  """
  p, t = prompt_len, completion_len
  prefilled = rows // prompt_group if rows % prompt_group == 0 else rows
  slots = p + t
  prefill = (p * matmul_flops_per_token(config) + attention_flops(config, p, slots)
             + lm_head_flops(config, 1))
  decode_step = (matmul_flops_per_token(config) + attention_flops(config, 1, slots)
                 + lm_head_flops(config, 1))
  return prefilled * prefill + rows * (t - 1) * decode_step


def step_phases(config: ModelConfig, rows: int, prompt_len: int, completion_len: int,
                kl: bool, prox_pass: bool, epochs: int = 1,
                prompt_group: int = 1) -> dict[str, int]:
  """Model FLOPs of one GRPO step on ``rows`` fresh rollouts, by phase.

  The phases of ``step.train_step`` (without replayed rows), LM head at the T completion
  positions of every log-prob pass; minibatches split the rows, so they do not change the sum.

  Args:
    config: the architecture.
    rows: N.
    prompt_len: P.
    completion_len: T.
    kl: a KL coefficient > 0 (one no-grad pass of the reference model).
    prox_pass: one no-grad pass of the start-of-step policy (``prox_pass="all"``).
    epochs: passes over the batch, each a forward + backward of every row.
    prompt_group: > 1 counts the shared-prompt prefill and log-prob passes (rows are groups
      of this many completions of one prompt).

  Returns:
    {"generation", "reference", "prox", "forward_backward"} -> FLOPs (0 for a skipped pass);
    their sum is the step's.
  """
  shape = (config, rows, prompt_len, completion_len)
  kw = dict(lm_head_positions=completion_len, prompt_group=prompt_group)
  forward = forward_flops(*shape, **kw)
  return {
      "generation": generation_flops(*shape, prompt_group=prompt_group),
      "reference": forward if kl else 0,
      "prox": forward if prox_pass else 0,
      "forward_backward": epochs * train_flops(*shape, **kw),
  }


# --- growth fits ----------------------------------------------------------------------------

LINEAR_EXPONENT = 1.3  # below: at most linear
QUADRATIC_EXPONENT = 2.3  # above: faster than quadratic
QUADRATIC_SHARE = 0.10  # the quadratic term's share of the fit at the largest x


def fit_growth(xs, ys) -> dict:
  """How ``ys`` grows with ``xs``: a power law, a linear and a quadratic least-squares fit.

  Fits: ``exponent``, the slope of log y against log x (least squares; y = k * x^exponent);
  ``linear`` (a, b) of y = a + b x; ``quadratic`` (a, b, c) of y = a + b x + c x^2, and
  ``quadratic_share`` = c x_max^2 / (a + b x_max + c x_max^2), the part of the quadratic fit's
  value at the largest x that its x^2 term makes.

  The verdict, in this order:
    "non-increasing": exponent <= 0 (noise at sizes too small to time, say);
    "super-quadratic": exponent > 2.3;
    "linear": exponent < 1.3 and quadratic_share < 0.10 (an affine cost a + b x with a large
      constant has an exponent below 1; it is still called linear);
    "quadratic": quadratic_share >= 0.10 (so c > 0);
    "super-linear": anything else (exponent >= 1.3 with no sizable x^2 term).
  With fewer than three distinct xs there is no quadratic fit (``quadratic`` and
  ``quadratic_share`` are None) and the verdict uses the exponent alone: "non-increasing" at
  or below 0, "linear" below 1.3, "super-quadratic" above 2.3, else "super-linear". Three
  points determine a quadratic exactly, so with three, timing noise alone gives c != 0: read
  the verdict with the exponent.

  Args:
    xs: positive sizes (at least two distinct).
    ys: positive costs at those sizes.

  Returns:
    {"exponent", "linear", "quadratic", "quadratic_share", "growth"}.
  """
  x = np.asarray(xs, np.float64)
  y = np.asarray(ys, np.float64)
  if x.shape != y.shape or len(np.unique(x)) < 2:
    raise ValueError(f"need ys for at least two distinct xs, got xs={xs}, ys={ys}")
  if np.any(x <= 0) or np.any(y <= 0):
    raise ValueError(f"xs and ys must be positive for a log-log fit, got xs={xs}, ys={ys}")
  exponent = float(np.polyfit(np.log(x), np.log(y), 1)[0])
  b, a = np.polyfit(x, y, 1)
  out = {"exponent": exponent, "linear": (float(a), float(b)), "quadratic": None,
         "quadratic_share": None}
  if len(np.unique(x)) >= 3:
    c2, b2, a2 = np.polyfit(x, y, 2)
    x_max = float(np.max(x))
    share = c2 * x_max ** 2 / (a2 + b2 * x_max + c2 * x_max ** 2)
    out.update(quadratic=(float(a2), float(b2), float(c2)), quadratic_share=float(share))
  share = out["quadratic_share"]
  if exponent <= 0.0:
    growth = "non-increasing"
  elif exponent > QUADRATIC_EXPONENT:
    growth = "super-quadratic"
  elif exponent < LINEAR_EXPONENT and (share is None or share < QUADRATIC_SHARE):
    growth = "linear"
  elif share is not None and share >= QUADRATIC_SHARE:
    growth = "quadratic"
  else:
    growth = "super-linear"
  out["growth"] = growth
  return out
