"""Held-out evaluation: mean@k, pass@k, constant-group fraction, completion lengths.

mean@k is the average success over k samples per prompt; pass@k the fraction of prompts with
at least one success (the unbiased estimator of Chen et al., arXiv 2107.03374, with n = k).
The constant-group fraction is the share of prompts whose k samples all succeed or all fail:
the "ineffective groups" of POPO (arXiv 2606.01281) and DAPO (arXiv 2503.14476), for which a
group-relative advantage is zero.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from grpo_jax import sampler as sampler_lib
from grpo_jax import tokenization


def group_metrics(success_NxK: np.ndarray, lengths_NxK: np.ndarray | None = None) -> dict:
  """Summary statistics of k samples for each of n prompts.

  Args:
    success_NxK: bool/0-1 success of sample j on prompt i.
    lengths_NxK: optional completion lengths in tokens.

  Returns:
    dict with mean_at_k, pass_at_k, all_correct_fraction, all_wrong_fraction,
    constant_fraction (their sum) and, when lengths are given, mean_length.
  """
  success = np.asarray(success_NxK, bool)
  per_prompt = success.mean(axis=1)
  out = {
      "mean_at_k": float(per_prompt.mean()),
      "pass_at_k": float(success.any(axis=1).mean()),
      "all_correct_fraction": float(success.all(axis=1).mean()),
      "all_wrong_fraction": float((~success).all(axis=1).mean()),
  }
  out["constant_fraction"] = out["all_correct_fraction"] + out["all_wrong_fraction"]
  if lengths_NxK is not None:
    out["mean_length"] = float(np.mean(lengths_NxK))
  return out


@functools.lru_cache(maxsize=16)
def cached_sampler(graphdef: nnx.GraphDef, config: sampler_lib.SamplingConfig):
  """One jitted sampler per (model structure, sampling config), reused across calls."""
  return sampler_lib.make_sampler(graphdef, config)


def evaluate(graphdef: nnx.GraphDef, params: nnx.State, tokenizer, task,
             problems: Sequence, *, k: int, temperature: float, prompt_len: int,
             completion_len: int, rows_per_batch: int = 512, seed: int = 0,
             render=None) -> dict:
  """Samples k completions per problem, scores them with the task, summarises.

  Batches always have ``rows_per_batch`` rows (the last one padded with repeats), so the
  sampler compiles once.

  Args:
    graphdef, params: the model, split.
    tokenizer: transformers tokenizer.
    task: object with ``prompt(problem)``, ``score(text, problem)``, ``is_success(score)``.
    problems: held-out problems.
    k: samples per problem.
    temperature: sampling temperature (0 = greedy; then k = 1 is enough).
    prompt_len, completion_len: P and T.
    rows_per_batch: sampler batch rows (rounded up to a multiple of k).
    seed: sampling seed.
    render: optional ``problem -> prompt text`` (e.g. with a chat template); default
      ``task.prompt``.

  Returns:
    ``group_metrics`` of the successes, plus mean_score and truncated_fraction.
  """
  config = sampler_lib.sampling_config_for(tokenizer, completion_len, temperature=temperature)
  sample = cached_sampler(graphdef, config)
  rows_per_batch = max(k, rows_per_batch // k * k)
  render = render or task.prompt
  prompts = [render(p) for p in problems for _ in range(k)]
  owners = [p for p in problems for _ in range(k)]
  scores, lengths, truncated = [], [], []
  for start in range(0, len(prompts), rows_per_batch):
    chunk = prompts[start:start + rows_per_batch]
    real = len(chunk)
    chunk = chunk + [chunk[-1]] * (rows_per_batch - real)
    ids, mask = tokenization.encode_prompts(tokenizer, chunk, prompt_len)
    out = sample(params, ids, mask, jax.random.fold_in(jax.random.key(seed), start))
    out = jax.device_get(out)
    texts = tokenization.decode_completions(tokenizer, out.tokens_NxT[:real], out.mask_NxT[:real])
    scores += [task.score(t, p) for t, p in zip(texts, owners[start:start + real])]
    lengths += out.lengths_N[:real].tolist()
    truncated += out.truncated_N[:real].tolist()
  scores_NxK = np.asarray(scores, np.float64).reshape(len(problems), k)
  success = np.vectorize(task.is_success)(scores_NxK)
  metrics = group_metrics(success, np.asarray(lengths).reshape(len(problems), k))
  metrics["mean_score"] = float(scores_NxK.mean())
  metrics["truncated_fraction"] = float(np.mean(truncated))
  return metrics
