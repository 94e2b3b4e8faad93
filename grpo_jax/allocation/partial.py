"""Partial rollouts as the step's allocator: B complete groups from a slot pool whose
unfinished rows continue under the next parameters (``rollout.partial``).

The selector's prompts enter a ``generate.producer.Producer`` one group at a time as slots
free up; each step takes the first B groups to complete (Kimi k1.5, arXiv 2501.12599; APRIL,
arXiv 2509.18521), scores them on the host and hands them to the train step with the version
of every token (``Rollout.version`` [N, T]). A group whose oldest token would be more than
``rollout.max_staleness`` updates old when trained is discarded (counted as generated). The
rows' importance correction is the train step's: ``prox.rows=all`` gives every row the
decoupled objective (ratio to pi_prox, behaviour weight pi_prox / mu: Hilton et al., arXiv
2110.00641); ``replayed`` (the default) clips pi_theta / mu, the naive baseline.

The rule over the pool (``allocation.method``, the same ``rule.Rule`` the rounds run, its
verdicts taken as each group's admitted rows end: ``PoolVerdicts``): uniform (G rows a group,
admitted at once); dynamic_sampling (DAPO: a group whose rewards all agree is dropped when it
completes, and the step waits for B effective ones); sara (K probe rows, then commit, one more
rollout or abandon).
Their groups persist across steps on the same pool: a group committed or completed after its
step ended trains in the next one. Rows are scored as their group's admitted rows end (the
rule decides from their rewards), each row once. DAPO and SARA admit at most
``allocation.max_rounds`` x B x G rows a step (the static rules' cap); a step that reaches it
with fewer than B groups trains on those, the rest empty groups.

Counted (the run's budgets): a rollout once, when it is handed to the update, discarded or
dropped by the rule; completion tokens when they are decoded. A step's counts cover
everything the producer did since the previous step's were taken: its ``collect`` and, with
generation on its own devices, the ``overlap`` while its update ran (decoded tokens, SARA's
and DAPO's drops, staleness discards), whose stats then carry the counting fields
(``rollouts``, ``completion_tokens``, ``alloc/rollouts_generated``, ``alloc/groups_*``,
``alloc/decode_steps``, the rule's ``alloc/`` counts); the loop adds a step's counters after
both. Rows in flight at the end of a run (unfinished, waiting for their group or complete
and not yet taken) are in the checkpoint and reported (``alloc/rows_in_flight``), not
counted.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from grpo_jax import random_keys
from grpo_jax.allocation import rounds as rounds_lib
from grpo_jax.allocation import rule as rule_lib
from grpo_jax.allocation.allocator import Allocator
from grpo_jax.generate import asynchronous
from grpo_jax.generate import producer as producer_lib
from grpo_jax.generate import tokenization
from grpo_jax.types import Rollout


class PoolVerdicts:
  """A rule's verdicts as the producer takes them (``generate.producer.Rule``'s numbers): the
  rows to add, 0 for a complete group, or ``producer.DROP``. A committed group gets the rest of
  its G rows and is complete when they end, without a second verdict (the committed groups are
  in the checkpoint, so a resumed run does not decide one twice).

  Args:
    rule: the allocation rule (``rule.Rule``).
  """

  def __init__(self, rule: rule_lib.Rule):
    self.rule, self.first_rows = rule, rule.first_rows
    self._committed: set = set()  # tags committed whose group is not complete yet
    self._counts = rule_lib.Counts()

  def verdict(self, tag, rows: rounds_lib.Rows, group_size: int) -> int:
    n = len(rows)
    if tag in self._committed:  # the rest of a committed group has ended: complete
      self._committed.discard(tag)
      return 0
    verdict = self.rule.verdict(rows, group_size)
    if verdict.kind == "drop":
      self._counts.dropped += 1
      return producer_lib.DROP
    if verdict.kind == "commit":
      self._counts.committed += 1
      if n == group_size:
        return 0
      self._committed.add(tag)
      return group_size - n
    return verdict.rows

  def forget(self, tag) -> None:
    """The group left the pool without a verdict (discarded for staleness)."""
    self._committed.discard(tag)

  def take_stats(self) -> dict:
    """The rule's ``alloc/`` metrics since the last call."""
    out, self._counts = self.rule.metrics(self._counts), rule_lib.Counts()
    return out

  def state_dict(self) -> dict:
    return {"committed": sorted(self._committed)}

  def load_state_dict(self, state: dict) -> None:
    self._committed = set(state.get("committed", []))


class PartialGroups(Allocator):
  """B complete groups a step from a pool of rows that outlive their step.

  Args:
    selector: which prompts (``selectors.py``); drawn one group at a time.
    sampler: the RoundSampler whose scorer, tokenizer and timer the rows use (its sampler is
      not called: the producer generates).
    make_producer: ``make_producer(prompts=..., rule=..., admit_cap=...) ->
      generate.producer.Producer``.
    num_groups, group_size: B, G.
    effective_signal: as every allocator.
    seed: the run's seed (rows' keys: ``random_keys.partial_rows``).
    policy: the rule's verdicts (``PoolVerdicts``; None: G rows a group, admitted at once).
    max_rounds: with a policy, at most max_rounds x B x G rows are admitted a step.
    make_generator: ``make_generator(producer) -> generate.asynchronous.Generator`` for
      generation on its own devices (``rollout.devices``), None to generate on the training
      devices between updates.
  """

  name = "partial"

  def __init__(self, selector, sampler: rounds_lib.RoundSampler, *, make_producer,
               num_groups: int, group_size: int, effective_signal: str = "success",
               seed: int = 0, policy: PoolVerdicts | None = None, max_rounds: int = 10,
               make_generator=None):
    super().__init__(selector, sampler, num_groups=num_groups, group_size=group_size,
                     effective_signal=effective_signal)
    self._key = random_keys.partial_rows(seed)
    self._prompts: dict[int, rounds_lib.Prompt] = {}  # group serial -> its prompt
    self._serial = 0
    self.policy = policy
    self._scored: dict[int, rounds_lib.Rows] = {}  # a group's rows scored so far (policy)
    self._dropped: list[tuple[rounds_lib.Prompt, rounds_lib.Rows]] = []  # since the last step
    cap = max_rounds * num_groups * group_size if policy is not None else 0
    self.producer = make_producer(prompts=self._next_prompt,
                                  rule=None if policy is None else self, admit_cap=cap)
    self.generator = None if make_generator is None else make_generator(self.producer)
    self._counted = producer_lib.Counts()  # the producer's counts when a step last took them
    self._effective = 0.0  # effective groups of the step whose counts are still to be taken

  def _next_prompt(self) -> producer_lib.Prompt:
    """The next group's prompt (a ``generate.producer.Prompt``); its rows' keys fold the
    group's serial number into the run's key, so a resumed pool draws the same tokens."""
    prompt = self._draw(1, set())[0]
    with self.timer.phase("prompts"):
      ids, mask = tokenization.encode_prompts(self.sampler.tokenizer, [prompt.text],
                                              self.sampler.prompt_len)
    serial = self._serial
    self._serial += 1
    self._prompts[serial] = prompt
    key = producer_lib.key_data(jax.random.fold_in(self._key, serial), self.group_size)
    return producer_lib.Prompt(serial, np.asarray(ids[0]), np.asarray(mask[0]), None, key)

  # -- the producer's rule (``generate.producer.Rule``), with a policy -------------------------
  def first_rows(self) -> int:
    return self.policy.first_rows

  def decide(self, prompt: producer_lib.Prompt, rows: list) -> int:
    """Scores the group's rows not scored yet and asks the policy; a dropped group's prompt
    and rows are kept for the step's selector and stats."""
    tag = prompt.tag
    scored = self._scored.get(tag)
    done = 0 if scored is None else len(scored)
    if done < len(rows):
      new = self._score_rows(prompt, rows[done:])
      scored = new if scored is None else rounds_lib.Rows.concat([scored, new])
      self._scored[tag] = scored
    verdict = self.policy.verdict(tag, scored, self.group_size)
    if verdict == producer_lib.DROP:
      self._dropped.append((self._prompts.pop(tag), self._scored.pop(tag)))
    return verdict

  def forget(self, tag) -> None:
    self._scored.pop(tag, None)
    self.policy.forget(tag)

  # -- a step ---------------------------------------------------------------------------------
  def collect(self, params, step: int, rng):
    del rng  # each row has its own key (``_next_prompt``)
    p = self.producer
    with self.timer.phase("generation"):
      if self.generator is not None:  # on its own devices, fed parameters by ``overlap``
        groups = self.generator.take(step)
      else:
        while p.version < step:  # the updates since the last step (one, or none on step 0)
          p.advance(params)
        groups = p.take(params, self.num_groups)
    prompts = [self._prompts.pop(g.tag) for g in groups]
    for serial in list(self._prompts):  # discarded groups' prompts
      if serial not in p.tags_in_flight():
        del self._prompts[serial]
    rows = self._score(groups, prompts)
    pairs = list(zip(prompts, rows))
    dropped, self._dropped = self._dropped, []
    touched = pairs + dropped
    if groups:
      rollout, stats = self._finish(pairs, [r for _, r in touched], touched, None, rounds=1)
    else:  # the budget or the cap ended the step before any group completed: all empty
      rollout, stats = self._empty_batch(step, touched)
    trained = np.concatenate([g.versions[g.tokens_mask()] for g in groups]) if groups else (
        np.zeros(0, np.int32))
    self._effective = stats["alloc/effective_groups"]
    stats.update(asynchronous.staleness_stats(step, trained, p.max_staleness))
    if self.policy is not None:
      stats["alloc/capped"] = float(len(groups) < self.num_groups)
    if self.generator is None:  # nothing more is generated before the next step
      stats.update(self._counts_stats())
    return rollout, stats

  def _counts_stats(self) -> dict:
    """The counting fields (module doc) of everything the producer did since they were last
    taken."""
    p = self.producer
    done = p.counts.minus(self._counted)
    self._counted = dataclasses.replace(p.counts)
    spent = done.rows_trained + done.rows_discarded + done.rows_dropped
    stats = {
        "rollouts": spent,
        "completion_tokens": done.tokens_generated,
        "alloc/rollouts_generated": float(spent),
        "alloc/effective_per_1k_rollouts": 1000.0 * self._effective / max(spent, 1),
        "alloc/groups_discarded": float(done.groups_discarded),
        "alloc/rows_in_flight": float(p.in_flight()),
        # Since the run started: a step's own ratio exceeds 1 when it trains tokens decoded
        # in earlier steps.
        "alloc/useful_fraction": p.counts.useful_fraction,
        "alloc/decode_steps": float(done.decode_steps)}
    if self.policy is not None:
      stats.update({"alloc/groups_dropped": float(done.groups_dropped),
                    **self.policy.take_stats()})
    return stats

  def overlap(self, params, step: int) -> dict:
    """Update ``step`` was dispatched (its parameters ``params``): the generator works while it
    runs and then holds its parameters (``generate.asynchronous.Generator.overlap``); returns
    the step's ``rollout/`` busy, idle and transfer seconds and its counting fields (module
    doc: ``collect`` left them to this call). Nothing ({}) when generation shares the training
    devices."""
    if self.generator is None:
      return {}
    with self.timer.phase("generation"):
      self.generator.overlap(params, step)
    return {**self.generator.take_stats(), **self._counts_stats()}

  def start_generator(self, params) -> None:
    """The generator's first parameters (the run's, fresh or restored; a no-op without
    one)."""
    if self.generator is not None:
      self.generator.start(params)

  def _score(self, groups: list[producer_lib.Group], prompts) -> list[rounds_lib.Rows]:
    """Each complete group's host Rows: a policy's scored rows, or scored now (one call for
    the step's groups)."""
    out, todo = [None] * len(groups), []
    for i, (group, prompt) in enumerate(zip(groups, prompts)):
      scored = self._scored.pop(group.tag, None)
      if scored is not None and len(scored) == self.group_size:
        out[i] = scored
      else:  # uniform, or a group restored ready from a checkpoint
        todo.append(i)
    if todo:
      parts = [(prompts[i], groups[i].prompt_ids, groups[i].prompt_mask,
                (groups[i].tokens, groups[i].logp, groups[i].versions, groups[i].lengths,
                 groups[i].ended)) for i in todo]
      for i, rows in zip(todo, self._host_rows(parts)):
        out[i] = rows
    return out

  def _score_rows(self, prompt: producer_lib.Prompt, rows: list) -> rounds_lib.Rows:
    """Host Rows of one group's harvested rows (``generate.producer.Row``)."""
    arrays = tuple(np.stack(c) for c in zip(*rows))
    return self._host_rows([(self._prompts[prompt.tag], prompt.ids, prompt.mask, arrays)])[0]

  def _host_rows(self, parts) -> list[rounds_lib.Rows]:
    """Scored host Rows of each part, decoded and scored in one call.

    Args:
      parts: (rounds.Prompt, prompt ids [P], mask [P], (tokens [R, T], logp [R, T],
        versions [R, T], lengths [R], ended [R])) each.
    """
    cat = lambda i: np.concatenate([x[3][i] for x in parts])
    rep = lambda j: np.concatenate([np.repeat(x[j][None], len(x[3][3]), axis=0) for x in parts])
    tokens, logp, versions, lengths, ended = (cat(i) for i in range(5))
    mask = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    n = len(lengths)
    rollout = Rollout(prompt_ids=rep(1), prompt_mask=rep(2), completion_ids=tokens,
                      completion_mask=mask,
                      behaviour_logp=np.where(mask, logp, 0.0).astype(np.float32),
                      truncated=~ended, scores=np.zeros(n, np.float32),
                      success=np.zeros(n, bool), prompt_id=np.full(n, -1, np.int32),
                      version=versions)
    problems = [x[0].problem for x in parts for _ in range(len(x[3][3]))]
    rows = self.sampler.score(rollout, problems)
    bounds = np.cumsum([0] + [len(x[3][3]) for x in parts])
    return [rows.take(np.arange(bounds[i], bounds[i + 1])) for i in range(len(parts))]

  def _empty_batch(self, step: int, touched):
    """B empty groups (no rollout spent) shaped like the pool's rows; the selector still
    sees the ``touched`` groups (a policy's drops)."""
    if touched:
      self.selector.observe([(pr.index, int(np.sum(r.rollout.success)), len(r))
                             for pr, r in touched])
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
    stats = rounds_lib.row_stats(rounds_lib.Rows.concat([r for _, r in touched])
                                 if touched else blank.take([]))
    stats.update({"alloc/rollouts_in_update": 0.0, "alloc/effective_groups": 0.0,
                  "alloc/effective_per_1k_rollouts": 0.0, "alloc/rounds": 1.0,
                  "alloc/prompts_touched": float(len(touched)),
                  "alloc/empty_groups": float(self.num_groups)})
    scorer = getattr(self.sampler, "scorer", None)
    if scorer is not None:
      stats.update(scorer.take_stats())
    return rollout, stats

  def state_dict(self) -> dict:
    """The selector, the groups' prompts and the producer; a policy's state. A group's rows
    scored so far are not saved: they are scored again when its group is next decided."""
    return {"selector": self.selector.state_dict(), "serial": self._serial,
            "prompts": {str(k): p.index for k, p in self._prompts.items()},
            "producer": self.producer.state_dict(),
            **({"policy": self.policy.state_dict()} if self.policy is not None else {})}

  def load_state_dict(self, state: dict) -> None:
    self.selector.load_state_dict(state["selector"])
    self._serial = int(state["serial"])
    stream = self.selector.stream
    self._prompts = {}
    for serial, index in state["prompts"].items():
      problem = stream.problem(int(index))
      self._prompts[int(serial)] = rounds_lib.Prompt(int(index), problem, stream.render(problem))
    self.producer.load_state_dict(state["producer"])
    # Saved after the step's counts were taken (after ``overlap``, with its own devices).
    self._counted = dataclasses.replace(self.producer.counts)
    self._scored, self._dropped = {}, []
    if self.policy is not None and "policy" in state:
      self.policy.load_state_dict(state["policy"])
