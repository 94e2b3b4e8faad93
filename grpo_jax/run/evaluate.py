"""Held-out evaluation: mean@k, pass@k, constant-group fraction, completion lengths.

mean@k is the average success over k samples per prompt; pass@k the fraction of prompts with
at least one success (the unbiased estimator of Chen et al., arXiv 2107.03374, with n = k).
The constant-group fraction is the share of prompts whose k samples all succeed or all fail:
the "ineffective groups" of POPO (arXiv 2606.01281) and DAPO (arXiv 2503.14476), for which a
group-relative advantage is zero.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from grpo_jax import random_keys
from grpo_jax import sharding
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.generate import static_round
from grpo_jax.generate import tokenization
from grpo_jax.rewards import scoring


def group_metrics(success_NxK: np.ndarray, lengths_NxK: np.ndarray | None = None) -> dict:
  """Summary statistics of k samples for each of n prompts.

  Args:
    success_NxK: bool/0-1 success of sample j on prompt i.
    lengths_NxK: optional completion lengths in tokens.

  Returns:
    dict with mean_at_k and its standard error mean_at_k_se, pass_at_k,
    all_correct_fraction, all_wrong_fraction, constant_fraction (their sum) and, when lengths
    are given, mean_length. The standard error takes the prompt as the unit: a prompt's k
    samples are correlated (they share its difficulty), so it is the sample standard deviation
    of the per-prompt success rates over sqrt(n) (a cluster standard error), which covers the
    draw of both the prompts and their samples; NaN for one prompt.
  """
  success = np.asarray(success_NxK, bool)
  per_prompt = success.mean(axis=1)
  n = per_prompt.shape[0]
  out = {
      "mean_at_k": float(per_prompt.mean()),
      "mean_at_k_se": float(per_prompt.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan"),
      "pass_at_k": float(success.any(axis=1).mean()),
      "all_correct_fraction": float(success.all(axis=1).mean()),
      "all_wrong_fraction": float((~success).all(axis=1).mean()),
  }
  out["constant_fraction"] = out["all_correct_fraction"] + out["all_wrong_fraction"]
  if lengths_NxK is not None:
    out["mean_length"] = float(np.mean(lengths_NxK))
  return out


def pool(per_set: dict[str, dict], sizes: dict[str, int]) -> dict:
  """The metrics of several held-out sets as one set of all their prompts.

  Every metric is a mean over prompts, so the pooled value is the sets' values weighted by
  their sizes; a standard error (a key ending in ``_se``) pools as the square root of the
  weighted sum of squares (the sets are independent: the variance of sum_s w_s m_s is
  sum_s w_s^2 se_s^2).

  Args:
    per_set: {set name: {metric: value}}, the same metrics for every set.
    sizes: {set name: its number of prompts}.
  """
  total = sum(sizes.values())
  out = {}
  for key in next(iter(per_set.values())):
    if key.endswith("_se"):
      out[key] = math.sqrt(sum((sizes[n] / total * per_set[n][key]) ** 2 for n in per_set))
    else:
      out[key] = sum(per_set[n][key] * sizes[n] for n in per_set) / total
  return out


def aes(accuracy: float, mean_length: float, base_accuracy: float, base_mean_length: float,
        alpha: float = 1.0, beta: float = 3.0, gamma: float = 5.0) -> float:
  """Accuracy-Efficiency Score against a baseline run (O1-Pruner, arXiv 2501.12570, eq. 18).

  dL = (L_base - L) / L_base (relative length reduction), dAcc = (Acc - Acc_base) / Acc_base;
  AES = alpha dL + beta dAcc when dAcc >= 0, else alpha dL - gamma |dAcc|. Yoo et al.
  (arXiv 2606.04560) report AES margins over GRPO; the constants are O1-Pruner's.

  Raises:
    ValueError: a baseline accuracy or length that is not positive.
  """
  if base_accuracy <= 0 or base_mean_length <= 0:
    raise ValueError(f"AES needs a positive baseline accuracy and length, got "
                     f"{base_accuracy}, {base_mean_length}")
  d_len = (base_mean_length - mean_length) / base_mean_length
  d_acc = (accuracy - base_accuracy) / base_accuracy
  return alpha * d_len + (beta * d_acc if d_acc >= 0 else -gamma * abs(d_acc))


def evaluate(graphdef: nnx.GraphDef, params: nnx.State, tokenizer, task,
             problems: Sequence, *, k: int, temperature: float, prompt_len: int,
             completion_len: int, rows_per_batch: int = 512, seed: int = 0,
             render=None, model_path: str | None = None, mesh=None,
             scorer: scoring.Scorer | None = None) -> dict:
  """Samples k completions per problem, scores them (the run's rewards), summarises.

  Every sampler batch has the same number of rows, ``min(rows_per_batch, k * len(problems))``
  (``rows_per_batch`` first rounded down to a multiple of k, at least k; the last batch is
  padded with repeats), so the sampler compiles once per distinct size and a small evaluation
  does not pay for padding. The batch starting at row i samples with ``random_keys.evaluation_batch(seed,
  i)``; token t of a row is drawn with ``fold_in(that key, t)`` and uniforms
  of shape [rows, 1], whose first rows do not depend on the row count (threefry is
  partitionable by default), so the size does not change the results.

  Args:
    graphdef, params: the model, split.
    tokenizer: transformers tokenizer.
    task: the task (``prompt(problem)``; ``score`` / ``is_success`` without a ``scorer``).
    problems: held-out problems.
    k: samples per problem.
    temperature: sampling temperature (0 = greedy; then k = 1 is enough).
    prompt_len, completion_len: P and T.
    rows_per_batch: most sampler batch rows (rounded down to a multiple of k, at least k).
    seed: sampling seed.
    render: optional ``problem -> prompt text`` (e.g. with a chat template); default
      ``task.prompt``.
    model_path: model folder whose ``generation_config.json`` adds stop tokens (see
      ``sampler.stop_token_ids``); None: the tokenizer's EOS only.
    mesh: optional mesh the batches run under (``static_round.make_round_fn``); the batch is then
      rounded up to a multiple of its batch shards (padded with repeats, dropped).
    scorer: the run's ``scoring.Scorer`` (its rewards and success signal); None: the task's
      own verifier.

  Returns:
    ``group_metrics`` of the successes, plus mean_score and truncated_fraction.
  """
  # Each batch holds whole groups of k copies of a prompt: prefilled once per prompt.
  config = sampler_lib.sampling_config_for(tokenizer, completion_len, temperature=temperature,
                                           model_path=model_path, prompt_group=k)
  sample = static_round.cached_round_fn(graphdef, config, mesh)
  render = render or task.prompt
  prompts = [render(p) for p in problems for _ in range(k)]
  # len(prompts) is a multiple of k, so every batch holds whole groups.
  rows_per_batch = max(k, min(rows_per_batch // k * k, len(prompts)))
  # Under a mesh: whole groups that also split evenly over the batch shards.
  multiple = math.lcm(k, sharding.batch_shards(mesh))
  rows_per_batch = -(-rows_per_batch // multiple) * multiple
  owners = [p for p in problems for _ in range(k)]
  scorer = scorer if scorer is not None else scoring.Scorer(task)
  scores, success, lengths, truncated = [], [], [], []
  for start in range(0, len(prompts), rows_per_batch):
    chunk = prompts[start:start + rows_per_batch]
    real = len(chunk)
    chunk = chunk + [chunk[-1]] * (rows_per_batch - real)
    ids, mask = tokenization.encode_prompts(tokenizer, chunk, prompt_len)
    out = sample(params, ids, mask, random_keys.evaluation_batch(seed, start))
    out = jax.device_get(out)
    ids_RxT, mask_RxT = out.completion_ids[:real], out.completion_mask[:real]
    texts = tokenization.decode_completions(tokenizer, ids_RxT, mask_RxT)
    # Reward functions get the token ids, as in training (rounds.py): a function reading them
    # must score the same text the same way in both.
    ids = [row[m].tolist() for row, m in zip(ids_RxT, mask_RxT)] if scorer.functions else None
    got, ok, _ = scorer.score(owners[start:start + real], texts, ids, record=False)
    scores += got.tolist()
    success += ok.tolist()
    lengths += out.lengths[:real].tolist()
    truncated += out.truncated[:real].tolist()
  scores_NxK = np.asarray(scores, np.float64).reshape(len(problems), k)
  success_NxK = np.asarray(success, bool).reshape(len(problems), k)
  metrics = group_metrics(success_NxK, np.asarray(lengths).reshape(len(problems), k))
  metrics["mean_score"] = float(scores_NxK.mean())
  metrics["truncated_fraction"] = float(np.mean(truncated))
  return metrics
