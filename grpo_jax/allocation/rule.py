"""An allocation rule: how many rollouts each prompt gets, decided from its scored rows.

One rule object is read by both engines that spend rollouts: the fixed-shape rounds
(``round_groups.RoundGroups``: every rollout of a step in calls of exactly S = B * G rows) and
the slot pool of partial rollouts (``partial.PartialGroups``: rows that outlive their step). A
rule is written once and runs on both; what it says is

* ``first_rows``: the rows a new prompt (a *group*) starts with: G for whole groups, K for
  SARA's probes;
* ``verdict(rows, G)``: once every row admitted to a group has ended and been scored, what the
  group gets next: ``COMMIT`` (the group is kept: the engine completes it to G rows and trains
  on it), ``DROP`` (never trained; its rows still count as generated) or ``more(n)`` (n more
  rows, then decide again);
* ``new_groups(...)``: on rounds, how many new prompts a round starts (the pool admits one
  whenever the free slots hold its first rows, so it never asks);
* ``may_stop(rounds)``: on rounds, whether the step may end after that many rounds once B
  groups are committed and complete (DAPO checks only after a whole generation batch);
* ``metrics(counts)``: the rule's ``alloc/`` metrics from the engine's counts;
* ``end_step`` / ``state_dict``: what the rule learns across steps (SARA's commit rate).

What the engines do alike, so no rule writes it: the completion of committed groups ahead of
anything else; commits beyond B on rounds are *surplus* (not completed); once B groups are
committed the undecided ones stop; the last round only completes (no new prompt, no more rows
for an undecided one, unless a whole group fits: a group that could not complete is never
started); a dropped group that is not complete is audited with a round's spare slots (its group
completed outside the budget, counted as a wrong drop when it would have been effective); and
every rollout is counted.

A rule is registered by its spec (``allocator.RULES``; a ``registry.Configurable`` whose fields
are ``config.allocation.<name>``): ``RuleSpec.rule(group_size=..., effective_signal=...)``
builds it. docs/design.md's "A new allocation rule" is a worked example under test.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from grpo_jax.allocation import rounds as rounds_lib


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What a group gets next: ``COMMIT``, ``DROP`` or ``more(n)`` (module doc)."""

  kind: str  # "commit" | "drop" | "more"
  rows: int = 0  # rows to add ("more")

  @staticmethod
  def more(n: int) -> Verdict:
    if n < 1:
      raise ValueError(f"a rule asks for at least one more row, got {n}")
    return Verdict("more", int(n))


COMMIT = Verdict("commit")
DROP = Verdict("drop")


@dataclasses.dataclass
class Counts:
  """What an engine counted of a rule's verdicts (a step's, or the pool's since they were last
  taken); the round-only fields are None on the pool.

  Attributes:
    committed: groups committed (kept) within B.
    dropped: groups dropped.
    surplus: commits beyond B, not completed (rounds).
    num_groups: B.
    trained: complete groups handed to the update (rounds).
    undecided: groups left without a verdict at the step's end (rounds).
    incomplete: committed groups the round cap left short of G (rounds).
    audited: dropped groups completed with spare slots (rounds).
    wrong: audited groups that would have been effective (rounds).
    rounds: rounds run (rounds).
  """

  committed: int = 0
  dropped: int = 0
  surplus: int = 0
  num_groups: int = 0
  trained: int | None = None
  undecided: int | None = None
  incomplete: int | None = None
  audited: int | None = None
  wrong: int | None = None
  rounds: int | None = None

  @property
  def on_rounds(self) -> bool:
    return self.rounds is not None


class Rule:
  """Base rule: whole groups (G rows, committed at once), as many new ones as are needed.

  Subclasses override what they change; ``first_rows`` and ``verdict`` are the rule proper.

  Attributes:
    group_size: G.
    first_rows: rows a new group starts with (1..G).
    effective_signal: "success" or "score" (``rounds.is_effective``).
  """

  name = "rule"

  def __init__(self, group_size: int, effective_signal: str = "success",
               first_rows: int | None = None):
    self.group_size, self.effective_signal = group_size, effective_signal
    self.first_rows = group_size if first_rows is None else first_rows
    if not 1 <= self.first_rows <= group_size:
      raise ValueError(f"a group starts with 1..{group_size} rows, got {self.first_rows}")

  @property
  def sequential(self) -> bool:
    """Whether the rule ever decides anything: False for whole groups always kept (the pool
    then admits G rows a group and asks nothing)."""
    return True

  def verdict(self, rows: rounds_lib.Rows, group_size: int) -> Verdict:
    """What group of ``rows`` (scored, every admitted row ended) gets next."""
    del rows, group_size
    return COMMIT

  def new_groups(self, *, needed: int, undecided: int, free: int, last: bool) -> int:
    """New prompts this round starts, given the groups still ``needed`` to commit B, the
    ``undecided`` groups and the ``free`` slots after the committed and undecided groups'
    rows; the engine draws at most ``free // first_rows``. Default: as many as are needed
    beyond the undecided ones, none in the ``last`` round unless a whole group fits."""
    if needed <= 0 or (last and self.first_rows < self.group_size):
      return 0
    return min(max(needed - undecided, 0), free // self.first_rows)

  def may_stop(self, rounds: int) -> bool:
    """Whether a step may end after ``rounds`` rounds (once B groups are complete)."""
    del rounds
    return True

  def end_step(self, counts: Counts) -> None:
    """A step on rounds ended with these counts."""
    del counts

  def metrics(self, counts: Counts) -> dict:
    """The rule's own ``alloc/`` metrics."""
    del counts
    return {}

  def state_dict(self) -> dict:
    return {}

  def load_state_dict(self, state: dict) -> None:
    del state


class RuleSpec(Protocol):
  """A registered rule's config group (a ``registry.Configurable``) and the rule it makes."""

  def check_config(self, config) -> None:
    """Checks against other groups (raises errors.ConfigError)."""

  def rule(self, *, group_size: int, effective_signal: str) -> Rule:
    """The rule for groups of ``group_size``."""


def is_effective(rows: rounds_lib.Rows, signal: str) -> bool:
  """Re-exported for rules: the group's rewards are not all equal on ``signal``."""
  return rounds_lib.is_effective(rows, signal)


def successes(rows: rounds_lib.Rows) -> int:
  """Successful rows among ``rows``."""
  return int(np.sum(rows.rollout.success))
