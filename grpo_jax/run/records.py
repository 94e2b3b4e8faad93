"""The training loop's host records: the run's counters, each step's record and time window."""

from __future__ import annotations

import dataclasses
from typing import Any

from grpo_jax import timing as timing_lib


@dataclasses.dataclass(frozen=True)
class Counters:
  """The run's host counters, restarts included (kept in the checkpoint's host record).

  Attributes:
    rollouts: rollouts generated.
    completion_tokens: their completion tokens.
    reward_errors: completions whose scoring failed.
  """

  rollouts: int = 0
  completion_tokens: int = 0
  reward_errors: int = 0

  @classmethod
  def from_host(cls, host: dict) -> Counters:
    """The counters of a checkpoint's host record."""
    return cls(**{f.name: host[f.name] for f in dataclasses.fields(cls)})

  def add(self, stats: dict) -> Counters:
    """These counters plus a step's (``stats``: the allocator's statistics of its rollouts)."""
    return Counters(**{name: value + stats[name]
                       for name, value in dataclasses.asdict(self).items()})


@dataclasses.dataclass
class StepRecord:
  """One step's record. Its device metrics are fetched one step late (once the next step's
  update is dispatched, so the host never waits for them), and its time window closes after
  its evaluation and checkpoint.

  Attributes:
    step: the steps done after it (1 for the first).
    metrics: the train step's device metrics (float32 scalars, not fetched).
    stats: the allocator's statistics of its rollouts (``truncated_fraction``, ``alloc/*``,
      ``rollout/*``).
    counters: the run's Counters after it.
    wall_s: seconds since this process's loop started, at the end of its update (earlier
      evaluations included; not resumed).
    values: ``metrics`` as floats, once fetched.
    timing: its time window (``time/step_s``, ``time/<phase>_s``), once closed.
    cumulative: the run's seconds per phase, restarts included, when the window closed.
  """

  step: int
  metrics: Any
  stats: dict
  counters: Counters
  wall_s: float
  values: dict | None = None
  timing: dict | None = None
  cumulative: dict | None = None

  def fields(self, tokens_at_start: int) -> dict:
    """What metrics.jsonl records of the step; ``tokens_at_start``: the completion tokens
    when this process's loop started (for ``tokens_per_s``)."""
    c = self.counters
    return {**self.values, "rollouts": c.rollouts, "completion_tokens": c.completion_tokens,
            "reward_errors": c.reward_errors,
            "truncated_fraction": self.stats["truncated_fraction"],
            **{k: v for k, v in self.stats.items()
               if k.startswith(("alloc/", "reward/", "rollout/"))},
            "tokens_per_s": (c.completion_tokens - tokens_at_start) / self.wall_s,
            "wall_s": self.wall_s,
            # This step's time window (timing_lib.PHASES; time/step_s is its wall time)...
            **self.timing,
            # ... and the run's cumulative seconds per phase, restarts included.
            **{f"time_{name}_s": v for name, v in self.cumulative.items()}}


def window(seconds: dict, step_s: float) -> tuple[dict, dict]:
  """A step's time window from its phases' seconds (``PhaseTimer.take``) and its wall time.

  Returns:
    (the record's ``time/step_s`` and ``time/<phase>_s`` for every phase of timing_lib.PHASES,
    the seconds per phase with "other": whatever no phase timed).
  """
  seconds = {**seconds, "other": max(step_s - sum(seconds.values()), 0.0)}
  return ({"time/step_s": step_s,
           **{f"time/{name}_s": seconds.get(name, 0.0) for name in timing_lib.PHASES}},
          seconds)


def accumulate(timers: dict, seconds: dict) -> None:
  """Adds ``seconds`` per phase to the cumulative ``timers``."""
  for name, v in seconds.items():
    timers[name] = timers.get(name, 0.0) + v
