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

from grpo_jax import advantages as advantages_lib
from grpo_jax import metrics as metrics_lib
from grpo_jax import rewards as rewards_lib
from grpo_jax import tokenization
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
  """Host copies of sampled rows (numpy), any number of rows R.

  Attributes:
    prompt_ids_RxP, prompt_mask_RxP: the left-padded prompt of each row.
    tokens_RxT, mask_RxT, logp_RxT: completion tokens, mask and behaviour log-probs.
    scores_R: float32 task score plus the overlong penalty.
    success_R: bool accuracy signal.
    lengths_R, truncated_R: completion lengths and truncation flags.
    errors_R: bool, the verifier raised for this row (scored 0).
    texts: decoded completions.
  """

  prompt_ids_RxP: np.ndarray
  prompt_mask_RxP: np.ndarray
  tokens_RxT: np.ndarray
  mask_RxT: np.ndarray
  logp_RxT: np.ndarray
  scores_R: np.ndarray
  success_R: np.ndarray
  lengths_R: np.ndarray
  truncated_R: np.ndarray
  errors_R: np.ndarray
  texts: list

  def take(self, idx) -> "Rows":
    idx = np.asarray(idx, np.int64)
    return Rows(**{f.name: (np.asarray(getattr(self, f.name))[idx] if f.name != "texts"
                            else [self.texts[i] for i in idx])
                   for f in dataclasses.fields(self)})

  @staticmethod
  def concat(parts: list["Rows"]) -> "Rows":
    return Rows(**{f.name: (np.concatenate([getattr(p, f.name) for p in parts])
                            if f.name != "texts" else sum((p.texts for p in parts), []))
                   for f in dataclasses.fields(Rows)})

  def __len__(self) -> int:
    return len(self.scores_R)


SCORE_BASES = rewards_lib.REWARDS  # by config.rl.score_base


class RoundSampler:
  """Runs rounds of exactly ``slots`` sampled rows and scores them on the host.

  Args:
    sample_fn: jitted ``fn(params, ids_SxP, mask_SxP, rng) -> Completions``.
    tokenizer: transformers tokenizer.
    task: the task (``score``, ``is_success``).
    slots: S, rows per round (B * G).
    prompt_len: P.
    overlong_buffer, overlong_factor: DAPO's soft overlong penalty (0 disables).
    score_base: the reward function a row's score starts from before the penalty is added
      (registered in ``rewards.REWARDS``): "task" (the task's graded score, e.g. Countdown's
      0.1 for a well-formed wrong answer) or "accuracy" (+1 for a success, -1 otherwise:
      DAPO's rule-based reward, arXiv 2503.14476).
    timer: ``metrics.PhaseTimer`` the round's phases are timed on: "prompts" (tokenising),
      "generation" (the sampler call and the wait for its output), "scoring" (decoding, the
      verifier, the host rows); a private one when None.
  """

  def __init__(self, sample_fn, tokenizer, task, *, slots: int, prompt_len: int,
               overlong_buffer: int = 0, overlong_factor: float = 1.0,
               score_base: str = "task", timer=None):
    if score_base not in SCORE_BASES:
      raise ValueError(f"score_base must be one of {SCORE_BASES.names()}, got {score_base!r}")
    self.sample_fn, self.tokenizer, self.task = sample_fn, tokenizer, task
    self.slots, self.prompt_len = slots, prompt_len
    self.overlong_buffer, self.overlong_factor = overlong_buffer, overlong_factor
    self.score_base = score_base
    self.reward_fn = SCORE_BASES.get(score_base)
    self.timer = timer if timer is not None else metrics_lib.PhaseTimer()
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
      out = self.sample_fn(params, ids, mask, rng)
      tokens, comp_mask, logp, lengths, truncated = jax.device_get(
          (out.tokens_NxT, out.mask_NxT, out.logp_NxT, out.lengths_N, out.truncated_N))
    self.rounds += 1
    with self.timer.phase("scoring"):
      n = len(layout)  # the free tail is sampled but never decoded or scored
      tokens, comp_mask, logp = tokens[:n], comp_mask[:n], logp[:n]
      lengths, truncated = lengths[:n], truncated[:n]
      completions = tokenization.decode_completions(self.tokenizer, tokens, comp_mask)
      scores, success, errors = self.reward_fn(self.task, completions, problems)
      scores = scores + rewards_lib.overlong_penalty(
          lengths, truncated, tokens.shape[1], self.overlong_buffer,
          self.overlong_factor).astype(np.float32)
      rows = Rows(prompt_ids_RxP=ids[:n], prompt_mask_RxP=mask[:n], tokens_RxT=tokens,
                  mask_RxT=comp_mask, logp_RxT=logp, scores_R=scores, success_R=success,
                  lengths_R=lengths, truncated_R=truncated, errors_R=errors, texts=completions)
      bounds = np.cumsum([0] + counts + [c for _, c in extra])
      parts = [rows.take(np.arange(bounds[i], bounds[i + 1])) for i in range(len(bounds) - 1)]
    return parts[:len(counts)], list(zip(fitted, parts[len(counts):]))


def empty_rows(like: Rows, n: int) -> Rows:
  """n empty rows (see the module docstring) shaped like ``like``'s: the first row's prompt, a
  pad completion with an all-False mask, score 0, no success."""
  first = like.take(np.zeros((n,), np.int64))
  zeros = lambda a: np.zeros_like(a)
  return dataclasses.replace(
      first, tokens_RxT=first.tokens_RxT, mask_RxT=zeros(first.mask_RxT),
      logp_RxT=zeros(first.logp_RxT), scores_R=zeros(first.scores_R),
      success_R=zeros(first.success_R), lengths_R=zeros(first.lengths_R),
      truncated_R=zeros(first.truncated_R), errors_R=zeros(first.errors_R),
      texts=[""] * n)


def assemble(groups: list[tuple[Prompt, Rows]], num_groups: int, group_size: int,
             version: int) -> tuple[Rollout, int]:
  """The train step's Rollout: ``groups`` (each exactly G rows) then empty groups up to B.

  Returns:
    (Rollout with N = B * G rows on the device, number of empty groups added).
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
  rows = Rows.concat(parts)
  n = len(rows)
  rollout = Rollout(
      prompt_ids_NxP=jnp.asarray(rows.prompt_ids_RxP),
      prompt_mask_NxP=jnp.asarray(rows.prompt_mask_RxP),
      completion_ids_NxT=jnp.asarray(rows.tokens_RxT),
      completion_mask_NxT=jnp.asarray(rows.mask_RxT),
      behaviour_logp_NxT=jnp.asarray(rows.logp_RxT), scores_N=jnp.asarray(rows.scores_R),
      success_N=jnp.asarray(rows.success_R), prompt_id_N=jnp.asarray(np.concatenate(ids)),
      version_N=jnp.full((n,), version, jnp.int32))
  return rollout, empty


def is_effective(rows: Rows, signal: str) -> bool:
  """The group's rewards are not all equal on ``signal`` ("success" or "score"): the train
  step's definition (``advantages.effective_groups``, with its tolerance) on the host."""
  values = rows.success_R if signal == "success" else rows.scores_R
  return bool(advantages_lib.effective_groups(np.asarray(values)[None])[0])


def row_stats(rows: Rows) -> dict:
  """Counts of the rows a step generated (what the run's rollout counters add up)."""
  return {"rollouts": len(rows), "completion_tokens": int(np.sum(rows.lengths_R)),
          "reward_errors": int(np.sum(rows.errors_R)),
          "truncated_fraction": float(np.mean(rows.truncated_R)) if len(rows) else 0.0,
          "sample_text": rows.texts[0] if len(rows) else ""}
