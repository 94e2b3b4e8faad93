"""A rule's rollouts in fixed-shape rounds: the allocator of every static (non-partial) run.

Each round is one call of exactly S = B * G rows (``rounds.RoundSampler``: the sampler compiles
once however the rule splits its rollouts). A round is filled in this order: the rows still
owed to committed groups (in commit order; a group gets what fits, the rest next round), the
rows the rule asked for undecided groups (in order, while they fit; the rest wait a round),
then ``rule.first_rows`` for each of ``rule.new_groups(...)`` new prompts while they fit. After
the round every group that received rows is decided (``rule.verdict``): committed within B,
*surplus* beyond it (not completed), dropped, or asked for more rows. Once B groups are
committed the undecided ones stop (they could only become surplus), and the last round
(``max_rounds``) admits no more rows for undecided groups. The step ends when B groups are
committed and complete (and ``rule.may_stop``), at the round cap, or when nothing is left to
sample; committed groups short of G then (*incomplete*) are not trained on, and every missing
group is an empty group (``rounds.py``). The round's spare slots (requests that do not fill
it) complete a random sample of the step's dropped, incomplete groups outside the budget: a
*wrong drop* is one whose completed group would have been effective (SARA's audit of its
abandonments, arXiv 2607.26253).

The rules (``rule.py``): uniform (one round of B whole groups), DAPO's dynamic sampling (whole
groups round after round until B are effective), SARA (probe, commit or abandon) and any rule
registered beside them.
"""

from __future__ import annotations

import numpy as np

from grpo_jax.allocation import allocator as allocator_lib
from grpo_jax.allocation import rounds as rounds_lib
from grpo_jax.allocation import rule as rule_lib


class _Group:
  """One prompt's rollouts within a step, and the rows it asked for next."""

  def __init__(self, prompt: rounds_lib.Prompt):
    self.prompt, self.parts, self.ask = prompt, [], 0

  @property
  def rows(self) -> rounds_lib.Rows:
    return rounds_lib.Rows.concat(self.parts)

  @property
  def n(self) -> int:
    return sum(len(p) for p in self.parts)


class RoundGroups(allocator_lib.Allocator):
  """A rule's B groups a step, in fixed-shape rounds (module doc).

  Args:
    selector, sampler, num_groups, group_size, effective_signal: see ``Allocator``.
    rule: the allocation rule (``rule.Rule``).
    max_rounds: rounds per step at most.
    seed: seed of the audit sample.
  """

  def __init__(self, selector, sampler: rounds_lib.RoundSampler, *, rule: rule_lib.Rule,
               num_groups: int, group_size: int, effective_signal: str = "success",
               max_rounds: int = 10, seed: int = 0):
    super().__init__(selector, sampler, num_groups=num_groups, group_size=group_size,
                     effective_signal=effective_signal)
    if max_rounds < (1 if rule.first_rows == group_size else 2):
      raise ValueError(f"max_rounds must be >= 2 (start groups, then complete them) for a rule "
                       f"whose groups start with {rule.first_rows} < {group_size} rows; got "
                       f"{max_rounds}" if rule.first_rows < group_size else
                       f"max_rounds must be >= 1, got {max_rounds}")
    self.rule, self.max_rounds = rule, max_rounds
    self.name = rule.name
    self.rng = np.random.default_rng([seed, 0x5A4A])

  def state_dict(self) -> dict:
    return {**super().state_dict(), **self.rule.state_dict(),
            "rng": self.rng.bit_generator.state}

  def load_state_dict(self, state: dict) -> None:
    super().load_state_dict(state)
    self.rule.load_state_dict(state)
    if "rng" in state:  # saved before uniform and DAPO kept one
      self.rng.bit_generator.state = state["rng"]

  def _requests(self, committed, undecided) -> list:
    """The round's (group, rows) before new prompts, at most S rows (module doc)."""
    room, requests = self.sampler.slots, []
    for c in committed:
      # Cannot bind while at most B groups are committed (B * (G - first_rows) < S); it keeps
      # the cap true by construction.
      count = min(self.group_size - c.n, room)
      if count:
        requests.append((c, count))
        room -= count
    for u in undecided:
      if u.ask > room:
        break
      requests.append((u, u.ask))
      room -= u.ask
    return requests

  def collect(self, params, step: int, rng):
    b, g, rule = self.num_groups, self.group_size, self.rule
    committed, undecided, dropped, stopped, touched = [], [], [], [], []
    audits = []  # (dropped group, its audit rows)
    surplus = r = 0
    taken, dry = set(), False
    while r < self.max_rounds:
      if (len(committed) >= b and all(c.n == g for c in committed) and rule.may_stop(r)):
        break
      last = r == self.max_rounds - 1
      requests = self._requests(committed, [] if last else undecided)
      free = self.sampler.slots - sum(n for _, n in requests)
      new = 0 if dry else min(rule.new_groups(needed=b - len(committed),
                                              undecided=len(undecided), free=free, last=last),
                              free // rule.first_rows)
      fresh = [_Group(p) for p in self._draw(new, taken)] if new > 0 else []
      dry = len(fresh) < new  # a selector that gives fewer has no more for this step
      taken.update(f.prompt.index for f in fresh)
      touched += fresh
      requests += [(f, rule.first_rows) for f in fresh]
      if not requests:
        break  # nothing left to sample
      # A dropped group already complete (n = G) is surely what it was: nothing to audit.
      unaudited = [a for a in dropped if a.n < g and all(a is not x for x, _ in audits)]
      order = self.rng.permutation(len(unaudited)) if unaudited else []
      spare = [(unaudited[i], g - unaudited[i].n) for i in order]
      per_request, spare_out = self.sampler.run(
          params, [(x.prompt, n) for x, n in requests], self.round_key(rng, r),
          spare=[(a.prompt, n) for a, n in spare])
      r += 1
      grew = set()
      for (x, _), rows in zip(requests, per_request):
        x.parts.append(rows)
        grew.add(id(x))
      audits += [(spare[i][0], rows) for i, rows in spare_out]
      still = []
      for x in undecided + fresh:
        if id(x) not in grew:  # waited for a slot: its rows, and so its verdict, are as before
          still.append(x)
          continue
        verdict = rule.verdict(x.rows, g)
        if verdict.kind == "commit":
          if len(committed) < b:
            committed.append(x)
          else:
            surplus += 1  # B groups are committed already: not completed
        elif verdict.kind == "drop":
          dropped.append(x)
        else:
          if x.n + verdict.rows > g:
            raise ValueError(f"rule {rule.name!r} asked for {verdict.rows} more rows of a "
                             f"group of {x.n} / {g}")
          x.ask = verdict.rows
          still.append(x)
      if len(committed) >= b:
        stopped += still  # with B commits they could only become surplus: stop sampling them
        still = []
      undecided = still
    if not touched:
      raise ValueError("the selector had no prompt for this step")
    wrong = sum(rounds_lib.is_effective(rounds_lib.Rows.concat([a.rows, rows]),
                                        self.effective_signal) for a, rows in audits)
    # A commit the round cap left short of G is not trained on (its rows are still counted).
    groups = [(c.prompt, c.rows) for c in committed if c.n == g]
    counts = rule_lib.Counts(
        committed=len(committed), dropped=len(dropped), surplus=surplus, num_groups=b,
        trained=len(groups), undecided=len(stopped) + len(undecided),
        incomplete=len(committed) - len(groups), audited=len(audits), wrong=int(wrong),
        rounds=r)
    rule.end_step(counts)
    return self._finish(groups, [x.rows for x in touched],
                        [(x.prompt, x.rows) for x in touched], step, rounds=r,
                        extra=rule.metrics(counts))
