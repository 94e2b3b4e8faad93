"""Partial rollouts as the step's allocator: B complete groups from a slot pool whose
unfinished rows continue under the next parameters (``rollout.partial``).

The selector's prompts enter a ``generate.partial.Producer`` one group at a time as slots
free up; each step takes the first B groups to complete (Kimi k1.5, arXiv 2501.12599; APRIL,
arXiv 2509.18521), scores them on the host and hands them to the train step with the version
of every token (``Rollout.version`` [N, T]). A group whose oldest token would be more than
``rollout.max_staleness`` updates old when trained is discarded (counted as generated). The
rows' importance correction is the train step's: ``rl.prox_pass=all`` gives every row the
decoupled objective (ratio to pi_prox, behaviour weight pi_prox / mu: Hilton et al., arXiv
2110.00641); ``replayed`` (the default) clips pi_theta / mu, the naive baseline.

Counted (the run's budgets): a rollout once, when it is handed to the update or discarded;
completion tokens when they are decoded. Rows in flight at the end of a run are in the
checkpoint and reported (``alloc/rows_in_flight``), not counted.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from grpo_jax import keys
from grpo_jax.allocation import rounds as rounds_lib
from grpo_jax.allocation.allocator import Allocator
from grpo_jax.generate import partial as partial_lib
from grpo_jax.generate import tokenization
from grpo_jax.types import Rollout


class PartialGroups(Allocator):
  """Uniform allocation (G rollouts per prompt) on a pool of rows that outlive their step.

  Args:
    selector: which prompts (``selectors.py``); drawn one group at a time.
    sampler: the RoundSampler whose scorer, tokenizer and timer the rows use (its sampler is
      not called: the producer generates).
    make_producer: ``make_producer(prompts=...) -> generate.partial.Producer``.
    num_groups, group_size: B, G.
    effective_signal: as every allocator.
    seed: the run's seed (rows' keys: ``keys.partial_rows``).
  """

  name = "partial"

  def __init__(self, selector, sampler: rounds_lib.RoundSampler, *, make_producer,
               num_groups: int, group_size: int, effective_signal: str = "success",
               seed: int = 0):
    super().__init__(selector, sampler, num_groups=num_groups, group_size=group_size,
                     effective_signal=effective_signal)
    self._key = keys.partial_rows(seed)
    self._prompts: dict[int, rounds_lib.Prompt] = {}  # group serial -> its prompt
    self._serial = 0
    self.producer = make_producer(prompts=self._next_prompt)

  def _next_prompt(self) -> partial_lib.Prompt:
    """The next group's prompt (a ``generate.partial.Prompt``); its rows' keys fold the
    group's serial number into the run's key, so a resumed pool draws the same tokens."""
    prompt = self._draw(1, set())[0]
    with self.timer.phase("prompts"):
      ids, mask = tokenization.encode_prompts(self.sampler.tokenizer, [prompt.text],
                                              self.sampler.prompt_len)
    serial = self._serial
    self._serial += 1
    self._prompts[serial] = prompt
    key = partial_lib.key_data(jax.random.fold_in(self._key, serial), self.group_size)
    return (serial, np.asarray(ids[0]), np.asarray(mask[0]), None, key)

  def collect(self, params, step: int, rng):
    del rng  # each row has its own key (``_next_prompt``)
    p = self.producer
    before = dataclasses.replace(p.counts)
    with self.timer.phase("generation"):
      while p.version < step:  # the updates since the last step (one, or none on step 0)
        p.advance(params)
      groups = p.take(params, self.num_groups)
    done = p.counts.minus(before)
    prompts = [self._prompts.pop(g.tag) for g in groups]
    for serial in list(self._prompts):  # discarded groups' prompts
      if serial not in p.tags_in_flight():
        del self._prompts[serial]
    rows = self._score(groups, prompts)
    if groups:
      pairs = list(zip(prompts, rows))
      rollout, stats = self._finish(pairs, rows, pairs, None, rounds=1)
    else:  # the decode budget ran out before any group completed: an all-empty batch
      rollout, stats = self._empty_batch(step)
    trained = np.concatenate([g.versions[g.tokens_mask()] for g in groups]) if groups else (
        np.zeros(0, np.int32))
    staleness = step - trained
    stats.update({
        "rollouts": done.rows_trained + done.rows_discarded,
        "completion_tokens": done.tokens_generated,
        "alloc/rollouts_generated": float(done.rows_trained + done.rows_discarded),
        "alloc/groups_discarded": float(done.groups_discarded),
        "alloc/rows_in_flight": float(p.in_flight()),
        # Since the run started: a step's own ratio exceeds 1 when it trains tokens decoded
        # in earlier steps.
        "alloc/useful_fraction": p.counts.useful_fraction,
        "alloc/decode_steps": float(done.decode_steps),
        "alloc/staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
        "alloc/staleness_max": float(staleness.max()) if staleness.size else 0.0})
    return rollout, stats

  def _score(self, groups: list[partial_lib.Group], prompts) -> list[rounds_lib.Rows]:
    """Each group's host Rows (decoded and scored in one call for the step)."""
    if not groups:
      return []
    g = self.group_size
    cat = lambda f: np.concatenate([f(x) for x in groups])
    rep = lambda a: np.repeat(a[None], g, axis=0)
    lengths = cat(lambda x: x.lengths)
    t = groups[0].tokens.shape[1]
    mask = np.arange(t)[None, :] < lengths[:, None]
    n = len(lengths)
    rollout = Rollout(prompt_ids=cat(lambda x: rep(x.prompt_ids)),
                      prompt_mask=cat(lambda x: rep(x.prompt_mask)),
                      completion_ids=cat(lambda x: x.tokens), completion_mask=mask,
                      behaviour_logp=np.where(mask, cat(lambda x: x.logp), 0.0).astype(
                          np.float32),
                      truncated=~cat(lambda x: x.ended), scores=np.zeros(n, np.float32),
                      success=np.zeros(n, bool), prompt_id=np.full(n, -1, np.int32),
                      version=cat(lambda x: x.versions))
    problems = [p.problem for p in prompts for _ in range(g)]
    rows = self.sampler.score(rollout, problems)
    return [rows.take(np.arange(i * g, (i + 1) * g)) for i in range(len(groups))]

  def _empty_batch(self, step: int):
    """B empty groups (no rollout spent) shaped like the pool's rows."""
    pool = self.producer.pool
    g, t = self.group_size, pool.tokens.shape[1]
    p = pool.prompt_ids.shape[1]
    z = lambda *s, d=np.int32: np.zeros(s, d)
    blank = rounds_lib.Rows(rollout=Rollout(
        prompt_ids=z(g, p), prompt_mask=np.ones((g, p), bool), completion_ids=z(g, t),
        completion_mask=z(g, t, d=bool), behaviour_logp=z(g, t, d=np.float32),
        truncated=z(g, d=bool), scores=z(g, d=np.float32), success=z(g, d=bool),
        prompt_id=z(g), version=np.full((g, t), step, np.int32)),
        errors=z(g, d=bool), texts=[""] * g)
    prompt = rounds_lib.Prompt(-1, None, "")
    with self.timer.phase("assembly"):
      rollout, _ = rounds_lib.assemble([(prompt, blank)], self.num_groups, self.group_size,
                                       None)
    stats = rounds_lib.row_stats(blank.take([]))
    stats.update({"alloc/rollouts_in_update": 0.0, "alloc/effective_groups": 0.0,
                  "alloc/effective_per_1k_rollouts": 0.0, "alloc/rounds": 1.0,
                  "alloc/prompts_touched": 0.0, "alloc/empty_groups": float(self.num_groups)})
    scorer = getattr(self.sampler, "scorer", None)
    if scorer is not None:
      stats.update(scorer.take_stats())
    return rollout, stats

  def state_dict(self) -> dict:
    return {"selector": self.selector.state_dict(), "serial": self._serial,
            "prompts": {str(k): p.index for k, p in self._prompts.items()},
            "producer": self.producer.state_dict()}

  def load_state_dict(self, state: dict) -> None:
    self.selector.load_state_dict(state["selector"])
    self._serial = int(state["serial"])
    stream = self.selector.stream
    self._prompts = {}
    for serial, index in state["prompts"].items():
      problem = stream.problem(int(index))
      self._prompts[int(serial)] = rounds_lib.Prompt(int(index), problem, stream.render(problem))
    self.producer.load_state_dict(state["producer"])
