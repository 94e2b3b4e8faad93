"""Completion-length workloads of the rollout benchmark, and what a static batch wastes on them.

Reasoning RL's completion lengths are heavy-tailed: most rows end early, a few run to the limit
T (APRIL, arXiv 2509.18521: generation is most of a step, and its long tail idles the batch).
``lognormal`` draws lengths from a log-normal whose median is ``median`` x T and of which a
fraction ``at_limit`` reaches T (defaults 0.25 and 0.04, a typical reasoning distribution);
``uniform`` and ``from_file`` (measured lengths, resampled) are the alternatives. A static batch
decodes every row until its longest row ends, so of rows x max(L) decoded row-steps only
sum(L) produce a token: ``static_useful_fraction`` (about 0.32 for 256 rows of the default
log-normal: every batch runs to T, and the mean length is 0.32 T).

They are for a benchmark of rollout pipelines against the static batch, where the lengths must
be the workload rather than what the model happens to write.
"""

from __future__ import annotations

import json
import math
import statistics

import numpy as np


def lognormal_sigma(median: float = 0.25, at_limit: float = 0.04) -> float:
  """sigma of the log-normal whose median is ``median`` x T and of which ``at_limit`` reaches T:
  P(X >= T) = 1 - Phi(ln(1 / median) / sigma) = at_limit."""
  if not 0 < median < 1 or not 0 < at_limit < 0.5:
    raise ValueError(f"median must be in (0, 1) and at_limit in (0, 0.5), got {median}, "
                     f"{at_limit}")
  return math.log(1 / median) / statistics.NormalDist().inv_cdf(1 - at_limit)


def lognormal(rng: np.random.Generator, shape, completion_len: int, median: float = 0.25,
              at_limit: float = 0.04) -> np.ndarray:
  """int32 lengths in [1, T] of the given shape: ceil of a log-normal draw, capped at T."""
  sigma = lognormal_sigma(median, at_limit)
  x = np.exp(math.log(median * completion_len) + sigma * rng.standard_normal(shape))
  return np.clip(np.ceil(x), 1, completion_len).astype(np.int32)


def uniform(rng: np.random.Generator, shape, completion_len: int) -> np.ndarray:
  """int32 lengths drawn uniformly from [1, T]."""
  return rng.integers(1, completion_len + 1, size=shape, dtype=np.int32)


def read_lengths(path: str) -> np.ndarray:
  """Measured lengths from a file: a JSON list of integers, or one integer per line.

  Raises:
    ValueError: one line naming the file and what in it is not a positive integer.
  """
  with open(path, encoding="utf-8") as f:
    text = f.read()
  stripped = text.strip()
  if stripped.startswith("["):
    try:
      values = json.loads(stripped)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not a JSON list of lengths ({e})") from None
    items = [(i + 1, v) for i, v in enumerate(values)]
    where = "item"
  else:
    items = [(i + 1, line.strip()) for i, line in enumerate(text.splitlines()) if line.strip()]
    where = "line"
  lengths = []
  for n, v in items:
    ok = isinstance(v, int) and not isinstance(v, bool) or (isinstance(v, str) and v.isdigit())
    if not ok or int(v) < 1:
      raise ValueError(f"{path}: {where} {n} is {v!r}, not a positive integer length")
    lengths.append(int(v))
  if not lengths:
    raise ValueError(f"{path}: no lengths")
  return np.asarray(lengths, np.int32)


def from_file(rng: np.random.Generator, shape, completion_len: int,
              measured: np.ndarray) -> np.ndarray:
  """Lengths resampled (with replacement) from ``measured`` (``read_lengths``), capped at T."""
  return np.minimum(rng.choice(measured, size=shape), completion_len).astype(np.int32)


def static_useful_fraction(lengths_SxN: np.ndarray) -> float:
  """Tokens produced over decoded row-steps when each of S batches of N rows decodes until its
  longest row ends: sum(L) / sum_s (N max_n L[s, n])."""
  lengths = np.asarray(lengths_SxN, np.float64)
  return float(lengths.sum() / (lengths.shape[-1] * lengths.max(axis=-1)).sum())


def expected_capped_mean(completion_len: int, median: float = 0.25,
                         at_limit: float = 0.04) -> float:
  """E[min(X, T)] / T for the (continuous) log-normal of ``lognormal``:
  E[X; X < T] + T P(X >= T), with E[X; X < T] = exp(mu + sigma^2 / 2) Phi((ln T - mu - sigma^2)
  / sigma). The drawn lengths are its ceiling, about half a token longer."""
  sigma, mu = lognormal_sigma(median, at_limit), math.log(median * completion_len)
  phi = statistics.NormalDist().cdf
  log_t = math.log(completion_len)
  below = math.exp(mu + sigma ** 2 / 2) * phi((log_t - mu - sigma ** 2) / sigma)
  return (below + completion_len * at_limit) / completion_len
