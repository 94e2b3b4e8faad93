"""Generation in fixed-shape rounds, and the assembly of B complete groups for the train step.

Every allocator spends rollouts through ``RoundSampler.run``: a round is one call of the
jitted sampler on exactly S (prompt, sample) slots, S = B * G, so the sampler compiles once
however the allocator splits its rollouts between prompts (4 probes for one prompt, the 4 that
complete another, a whole group for a third). Requests that do not fill the round leave
*spare* slots: they are sampled (the shape is fixed) but belong to nobody and are not counted
as rollouts; an allocator may hand them to measurements outside the budget (SARA's audit of
abandoned prompts).

The train step receives B complete groups of G rows, group-major, as with uniform sampling.
When an allocator ends a step with fewer than B groups it fills the rest with *empty groups*:
rows whose completion mask is all False (zero tokens, score 0, not a success). An empty row
has no token in any loss or KL term and is not counted by the sequence aggregations, a
constant group gets advantage 0, and POPO sees an ineffective slot it may refill from its
buffer. No rollout was spent on them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import timing
from grpo_jax.generate import tokenization
from grpo_jax.rewards import functions as rewards_lib
from grpo_jax.rewards import scoring
from grpo_jax.rl import advantages as advantages_lib
from grpo_jax.types import Rollout


@dataclasses.dataclass(frozen=True)
class Prompt:
  """A training prompt chosen by a selector.

  Attributes:
    index: data index (stream position, or pool index for MoPPS / DPS); the rows' prompt id.
    problem: the task's problem object (what ``task.score`` checks against).
    text: the rendered prompt (chat template applied when configured).
  """

  index: int
  problem: object
  text: str


@dataclasses.dataclass
class Rows:
  """Sampled rows on the host, any number R of them: the Rollout (numpy arrays, the fields the
  train step receives) and what only the host keeps beside it.

  Attributes:
    rollout: types.Rollout of numpy arrays with R rows (prompt_id and version still unset:
      ``assemble`` sets them).
    errors: bool [R], the reward function raised for this row (scored 0).
    texts: the R decoded completions.
  """

  rollout: Rollout
  errors: np.ndarray
  texts: list

  def take(self, idx) -> Rows:
    idx = np.asarray(idx, np.int64)
    return Rows(rollout=jax.tree.map(lambda x: np.asarray(x)[idx], self.rollout),
                errors=np.asarray(self.errors)[idx], texts=[self.texts[i] for i in idx])

  @staticmethod
  def concat(parts: list[Rows]) -> Rows:
    return Rows(rollout=jax.tree.map(lambda *xs: np.concatenate(xs), *[p.rollout for p in parts]),
                errors=np.concatenate([p.errors for p in parts]),
                texts=sum((p.texts for p in parts), []))

  def __len__(self) -> int:
    return len(self.rollout.scores)




class RoundSampler:
  """Runs rounds of exactly ``slots`` sampled rows and scores them on the host.

  Args:
    sample_fn: jitted ``fn(params, ids_SxP, mask_SxP, rng) -> Rollout`` (``sampler``).
    tokenizer: transformers tokenizer.
    task: the task (its problems are what the rewards score against).
    slots: S, rows per round (B * G).
    prompt_len: P.
    overlong_buffer, overlong_factor: DAPO's soft overlong penalty (0 disables), added to the
      score after the scorer's.
    score_base: with no ``scorer``, the task verifier's score ("task") or +1 / -1 from success
      ("accuracy": DAPO's rule-based reward, arXiv 2503.14476); see ``scoring.Scorer``.
    scorer: the ``scoring.Scorer`` of the rows (the task's verifier under ``score_base`` when
      None).
    timer: ``timing.PhaseTimer`` the round's phases are timed on: "prompts" (tokenising),
      "generation" (the sampler call and the wait for its output), "scoring" (decoding, the
      verifier, the host rows); a private one when None.
  """

  def __init__(self, sample_fn, tokenizer, task, *, slots: int, prompt_len: int,
               overlong_buffer: int = 0, overlong_factor: float = 1.0,
               score_base: str = "task", scorer: scoring.Scorer | None = None, timer=None):
    self.sample_fn, self.tokenizer, self.task = sample_fn, tokenizer, task
    self.slots, self.prompt_len = slots, prompt_len
    self.overlong_buffer, self.overlong_factor = overlong_buffer, overlong_factor
    self.scorer = scorer if scorer is not None else scoring.Scorer(task, score_base=score_base)
    self.timer = timer if timer is not None else timing.PhaseTimer()
    self.rounds = 0  # rounds run by this object (for tests and metrics)

  def run(self, params, requests, rng, spare=None) -> tuple[list[Rows], list]:
    """Samples one round.

    Args:
      params: policy parameters.
      requests: (Prompt, count) pairs, counts summing to at most S; rows are laid out in
        request order, so a single request list of B prompts x G is the uniform layout.
      rng: the round's key.
      spare: optional (Prompt, count) pairs that may use the slots the requests leave free
        (taken in order while they fit whole); their rows are returned separately.

    Returns:
      (one ``Rows`` per request, [(position in ``spare``, its Rows)] for the spare requests
      that fitted).
    """
    counts = [c for _, c in requests]
    used = sum(counts)
    if used > self.slots or min(counts, default=1) < 1:
      raise ValueError(f"a round holds {self.slots} rows; asked for counts {counts}")
    extra, fitted = [], []
    free = self.slots - used
    for i, (prompt, c) in enumerate(spare or ()):
      if 1 <= c <= free:
        extra.append((prompt, c))
        fitted.append(i)
        free -= c
    layout = [p for p, c in list(requests) + extra for _ in range(c)]
    filler = layout[0] if layout else None
    if filler is None:
      raise ValueError("a round needs at least one request")
    texts = [p.text for p in layout] + [filler.text] * free
    problems = [p.problem for p in layout]
    with self.timer.phase("prompts"):
      ids, mask = tokenization.encode_prompts(self.tokenizer, texts, self.prompt_len)
    with self.timer.phase("generation"):
      # The prompts are the host's own arrays: only what the sampler made comes back.
      out = jax.device_get(self.sample_fn(params, ids, mask, rng).replace(
          prompt_ids=ids, prompt_mask=mask))
    self.rounds += 1
    n = len(layout)  # the free tail is sampled but never decoded or scored
    rows = self.score(jax.tree.map(lambda x: x[:n], out), problems)
    with self.timer.phase("scoring"):
      bounds = np.cumsum([0] + counts + [c for _, c in extra])
      parts = [rows.take(np.arange(bounds[i], bounds[i + 1])) for i in range(len(bounds) - 1)]
    return parts[:len(counts)], list(zip(fitted, parts[len(counts):]))


  def score(self, rollout: Rollout, problems: list) -> Rows:
    """The host's Rows of R sampled rows (a Rollout of numpy arrays) of the given problems:
    decoded, scored (the scorer, then DAPO's overlong penalty), timed as "scoring"."""
    with self.timer.phase("scoring"):
      completions = tokenization.decode_completions(self.tokenizer, rollout.completion_ids,
                                                    rollout.completion_mask)
      ids = None
      if self.scorer.functions:  # reward functions in TRL's form also get the token ids
        ids = [row[m].tolist() for row, m in zip(rollout.completion_ids, rollout.completion_mask)]
      scores, success, errors = self.scorer.score(problems, completions, ids)
      scores = scores + rewards_lib.overlong_penalty(
          rollout.lengths, rollout.truncated, rollout.completion_ids.shape[1],
          self.overlong_buffer, self.overlong_factor).astype(np.float32)
      return Rows(rollout=rollout.replace(scores=scores, success=success), errors=errors,
                  texts=completions)


def empty_rows(like: Rows, n: int) -> Rows:
  """n empty rows (see the module docstring) shaped like ``like``'s: the first row's prompt, a
  pad completion with an all-False mask, score 0, no success."""
  first = like.take(np.zeros((n,), np.int64))
  r = first.rollout
  zeros = np.zeros_like
  return Rows(rollout=r.replace(completion_mask=zeros(r.completion_mask),
                                behaviour_logp=zeros(r.behaviour_logp),
                                truncated=zeros(r.truncated), scores=zeros(r.scores),
                                success=zeros(r.success)),
              errors=zeros(first.errors), texts=[""] * n)


def assemble(groups: list[tuple[Prompt, Rows]], num_groups: int, group_size: int,
             version: int | None) -> tuple[Rollout, int]:
  """The train step's Rollout: ``groups`` (each exactly G rows) then empty groups up to B.

  Returns:
    (Rollout with N = B * G rows on the device, every token stamped ``version``, or keeping
    the versions the rows carry when it is None (partial rollouts: each token its own), the
    empty groups' at their first group's; number of empty groups added).
  """
  if not groups:
    raise ValueError("assemble needs at least one group (to shape the empty ones)")
  if len(groups) > num_groups or any(len(r) != group_size for _, r in groups):
    raise ValueError(f"need at most {num_groups} groups of {group_size} rows")
  parts = [rows for _, rows in groups]
  ids = [np.full((group_size,), p.index, np.int32) for p, _ in groups]
  empty = num_groups - len(groups)
  if empty:
    parts.append(empty_rows(parts[0], empty * group_size))
    ids.append(np.full((empty * group_size,), groups[0][0].index, np.int32))
  rows = Rows.concat(parts).rollout
  rows = rows.replace(prompt_id=np.concatenate(ids))
  if version is not None:
    rows = rows.replace(version=np.full(rows.completion_ids.shape, version, np.int32))
  rollout = jax.tree.map(jnp.asarray, rows)
  return rollout, empty


def is_effective(rows: Rows, signal: str) -> bool:
  """The group's rewards are not all equal on ``signal`` ("success" or "score"): the train
  step's definition (``advantages.effective_groups``, with its tolerance) on the host."""
  values = rows.rollout.success if signal == "success" else rows.rollout.scores
  return bool(advantages_lib.effective_groups(np.asarray(values)[None])[0])


def row_stats(rows: Rows) -> dict:
  """Counts of the rows a step generated (what the run's rollout counters add up)."""
  return {"rollouts": len(rows), "completion_tokens": int(np.sum(rows.rollout.lengths)),
          "reward_errors": int(np.sum(rows.errors)),
          "truncated_fraction": float(np.mean(rows.rollout.truncated)) if len(rows) else 0.0,
          "sample_text": rows.texts[0] if len(rows) else ""}
