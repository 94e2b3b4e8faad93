"""Prompt selectors: which training prompts a step spends rollouts on.

A selector hands prompts to an allocator (``draw``) and learns from what their rollouts showed
(``observe``, once per train step, with every prompt the step touched). Three of them:

* ``StreamSelector``: data order, as plain GRPO reads its data (the default).
* ``MoppsSelector``: MoPPS (Qu et al., arXiv 2507.04632). A Beta posterior on each prompt's
  success rate, discounted toward the prior Beta(1, 1) whenever the prompt is observed:
  ``a <- lam a + (1 - lam) + successes``, ``b <- lam b + (1 - lam) + failures`` (lam = 0.5 on
  Countdown); prompts not observed keep theirs. ``draw`` takes ``ratio * n`` random candidates,
  draws one Thompson sample p ~ Beta(a, b) for each and keeps the n with p closest to 0.5.
* ``DpsSelector``: Dynamics-Predictive Sampling (Mao et al., arXiv 2603.10887). Each prompt is a
  Markov chain over {unsolved, partial, solved} (the state a group's success rate shows: 0,
  between, 1) with Dirichlet counts ``A[next, prev]`` (prior 1, decay lam = 0.5), a predicted
  state distribution ``pi`` and the last state ``prev``. Observing state o adds the soft count
  ``outer(e_o, prev) * P / sum(outer(e_o, prev) * P)`` to ``lam A + (1 - lam) prior`` (P is A
  with columns normalised), sets ``prev = e_o`` and ``pi = P' e_o``; every prompt not observed
  that step decays its counts the same way without the count, and moves ``prev = pi``,
  ``pi = P' pi``. ``draw`` keeps the n of ``ratio * n`` random candidates with the largest
  predicted P(partial).

MoPPS and DPS need prompts that come back: they select from a finite pool (``pool_size``: the
data file, the TFDS split, or ``task.train_size`` problems of the generator). Every selector's
state — stream position, posteriors, counts, its numpy generator — is a JSON-able dict that
the checkpoint saves and restores exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from grpo_jax import registry
from grpo_jax.allocation.rounds import Prompt

# Prompt selectors by config.allocation.selector; each registers a spec whose fields are its own
# group config.allocation.<name>.
SELECTORS = registry.Registry("prompt selector", package="grpo_jax.allocation")
UNSOLVED, PARTIAL, SOLVED = 0, 1, 2


class Selector(Protocol):
  """What an allocator uses of a selector (every state is JSON-able and checkpointed)."""

  def draw(self, n: int, exclude=()) -> list[Prompt]:
    """Up to ``n`` prompts, none of whose data positions is in ``exclude`` (fewer when the
    source runs dry)."""

  def observe(self, results) -> None:
    """Learns from this step's (Prompt, Rows) of every prompt it touched."""

  def state_dict(self) -> dict: ...

  def load_state_dict(self, state: dict) -> None: ...

  @property
  def skipped(self) -> int:
    """Prompts skipped for length so far."""


def pool_size(task, train_size: int) -> int:
  """Number of distinct training prompts: ``train_size`` when > 0, else the task's
  (``Task.num_train_problems``: 0 for an unbounded generator)."""
  return train_size or task.num_train_problems()


def observed_state(successes: int, trials: int) -> int:
  """The DPS state a group shows: UNSOLVED (no success), SOLVED (all) or PARTIAL."""
  return UNSOLVED if successes == 0 else SOLVED if successes == trials else PARTIAL


class StreamSelector:
  """Prompts in data order from a ``rollouts.PromptStream`` (learns nothing)."""

  name = "stream"

  def __init__(self, stream):
    self.stream = stream

  def draw(self, n: int, exclude=()) -> list[Prompt]:
    del exclude  # the stream never repeats a position
    return [Prompt(pos, problem, text) for pos, problem, text in self.stream.next_batch(n)]

  def observe(self, results) -> None:
    del results

  def state_dict(self) -> dict:
    return {"position": self.stream.position, "skipped": self.stream.skipped}

  def load_state_dict(self, state: dict) -> None:
    self.stream.position, self.stream.skipped = state["position"], state["skipped"]

  @property
  def skipped(self) -> int:
    return self.stream.skipped


class _PoolSelector:
  """Shared part of MoPPS and DPS: a finite pool, random candidates, prompt rendering with the
  length check (a prompt longer than P is skipped, counted and never offered again)."""

  name = "pool"

  def __init__(self, stream, size: int, ratio: int, seed: int):
    if size < 1:
      raise ValueError(f"the {self.name} selector needs a finite training set; set "
                       "task.train_size (e.g. 1024) or train from a data file")
    self.stream, self.size, self.ratio = stream, size, ratio
    self.rng = np.random.default_rng([seed, 0x5E1EC7])
    self.too_long = np.zeros((size,), bool)

  def scores(self, candidates: np.ndarray) -> np.ndarray:
    """Higher is preferred; drawn with ``self.rng``."""
    raise NotImplementedError

  def draw(self, n: int, exclude=()) -> list[Prompt]:
    """n prompts: the best-scored of ``ratio * n`` random candidates (fewer when the pool is
    nearly exhausted this step), none in ``exclude``."""
    out = []
    excluded = set(exclude)
    while len(out) < n:
      free = np.flatnonzero(~self.too_long)
      free = free[~np.isin(free, list(excluded))] if excluded else free
      if not len(free):
        if out:
          return out
        raise ValueError("every prompt of the training pool is taken or longer than "
                         "rollout.prompt_len")
      want = n - len(out)
      candidates = self.rng.choice(free, size=min(self.ratio * want, len(free)), replace=False)
      order = np.argsort(-self.scores(candidates), kind="stable")
      for i in candidates[order]:
        if len(out) == n:
          break
        problem = self.stream.problem(int(i))
        text = self.stream.render(problem)
        excluded.add(int(i))
        if self.stream.fits(text):
          out.append(Prompt(int(i), problem, text))
        else:
          self.too_long[i] = True
          self.stream.skipped += 1
    return out

  @property
  def skipped(self) -> int:
    return self.stream.skipped

  def _base_state(self) -> dict:
    return {"rng": self.rng.bit_generator.state, "too_long": np.flatnonzero(self.too_long).tolist(),
            "skipped": self.stream.skipped}

  def _load_base(self, state: dict) -> None:
    self.rng.bit_generator.state = state["rng"]
    self.too_long[:] = False
    self.too_long[np.asarray(state["too_long"], np.int64)] = True
    self.stream.skipped = state["skipped"]


class MoppsSelector(_PoolSelector):
  """MoPPS: discounted Beta posteriors, Thompson samples, the n closest to 0.5."""

  name = "mopps"

  def __init__(self, stream, size: int, *, ratio: int = 8, decay: float = 0.5, seed: int = 0):
    super().__init__(stream, size, ratio, seed)
    self.decay = decay
    self.alpha = np.ones((size,))
    self.beta = np.ones((size,))

  def scores(self, candidates):
    p = self.rng.beta(self.alpha[candidates], self.beta[candidates])
    return -np.square(p - 0.5)

  def observe(self, results) -> None:
    """results: (pool index, successes, trials) of every prompt observed this step."""
    lam = self.decay
    for i, s, k in results:
      self.alpha[i] = lam * self.alpha[i] + (1 - lam) + s
      self.beta[i] = lam * self.beta[i] + (1 - lam) + (k - s)

  def state_dict(self) -> dict:
    return {**self._base_state(), "alpha": self.alpha.tolist(), "beta": self.beta.tolist()}

  def load_state_dict(self, state: dict) -> None:
    self._load_base(state)
    self.alpha[:], self.beta[:] = state["alpha"], state["beta"]


class DpsSelector(_PoolSelector):
  """DPS: a 3-state Markov chain per prompt; the n most likely to be 'partial' next."""

  name = "dps"

  def __init__(self, stream, size: int, *, ratio: int = 8, decay: float = 0.5,
               prior: float = 1.0, seed: int = 0):
    super().__init__(stream, size, ratio, seed)
    self.decay, self.prior = decay, prior
    self.counts = np.full((size, 3, 3), prior)  # [prompt, next, prev]
    self.pi = np.full((size, 3), 1 / 3)  # predicted state at the next draw
    self.prev = np.full((size, 3), 1 / 3)  # last state (one-hot once observed)

  def scores(self, candidates):
    return self.pi[candidates, PARTIAL]

  def observe(self, results) -> None:
    """results: (pool index, successes, trials) of every prompt observed this step; every
    other prompt of the pool decays and propagates its prediction one step."""
    lam = self.decay
    seen = np.zeros((self.size,), bool)
    now = self.pi.copy()  # unobserved prompts: the state is only predicted
    for i, s, k in results:
      seen[i] = True
      now[i] = np.eye(3)[observed_state(s, k)]
    trans = self.counts / self.counts.sum(axis=1, keepdims=True)  # P[next, prev]
    soft = now[:, :, None] * self.prev[:, None, :] * trans  # [prompt, next, prev]
    soft /= soft.sum(axis=(1, 2), keepdims=True)
    self.counts = lam * self.counts + (1 - lam) * self.prior + seen[:, None, None] * soft
    trans = self.counts / self.counts.sum(axis=1, keepdims=True)
    self.prev = now
    self.pi = np.einsum("inp,ip->in", trans, now)

  def state_dict(self) -> dict:
    return {**self._base_state(), "counts": self.counts.tolist(), "pi": self.pi.tolist(),
            "prev": self.prev.tolist()}

  def load_state_dict(self, state: dict) -> None:
    self._load_base(state)
    self.counts = np.asarray(state["counts"], np.float64)
    self.pi = np.asarray(state["pi"], np.float64)
    self.prev = np.asarray(state["prev"], np.float64)


@SELECTORS.register("stream")
@dataclasses.dataclass(frozen=True)
class StreamSpec(registry.Configurable):
  """``allocation.selector=stream``: data order (no group of its own)."""

  needs_pool = False

  def build(self, stream, *, size: int, seed: int) -> StreamSelector:
    del size, seed
    return StreamSelector(stream)


@dataclasses.dataclass(frozen=True)
class _PoolSpec(registry.Configurable):
  """A selector over a finite pool.

  Attributes:
    candidates_ratio: candidates scored per prompt chosen.
    decay: the posterior discount (MoPPS) / transition-count decay (DPS) lambda.
  """

  candidates_ratio: int = 8
  decay: float = 0.5
  needs_pool = True

  def __post_init__(self):
    if self.candidates_ratio < 1:
      raise ValueError(f"candidates_ratio={self.candidates_ratio} must be >= 1")
    if not 0.0 <= self.decay <= 1.0:
      raise ValueError(f"decay={self.decay} must be in [0, 1]")


@SELECTORS.register("mopps")
@dataclasses.dataclass(frozen=True)
class MoppsSpec(_PoolSpec):
  """``config.allocation.mopps`` (arXiv 2507.04632): see _PoolSpec."""

  def build(self, stream, *, size: int, seed: int) -> MoppsSelector:
    return MoppsSelector(stream, size, ratio=self.candidates_ratio, decay=self.decay, seed=seed)


@SELECTORS.register("dps")
@dataclasses.dataclass(frozen=True)
class DpsSpec(_PoolSpec):
  """``config.allocation.dps`` (arXiv 2603.10887): see _PoolSpec."""

  def build(self, stream, *, size: int, seed: int) -> DpsSelector:
    return DpsSelector(stream, size, ratio=self.candidates_ratio, decay=self.decay, seed=seed)
