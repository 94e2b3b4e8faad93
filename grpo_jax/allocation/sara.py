"""SARA: Sequential Adaptive Rollout Allocation (arXiv 2607.26253).

Collecting a step's rollouts is an optimal-stopping problem under a budget. Each prompt's
success rate p has a Beta(alpha0, beta0) prior; after n rollouts with s successes the posterior
is Beta(a, b), a = alpha0 + s, b = beta0 + n - s, and the probability that the completed group
of G will be *effective* (not all equal) is, with m = G - n rollouts still to come,

    0 < s < n:  P_eff = 1                                   (already mixed)
    s = n:      P_eff = 1 - E[p^m]     = 1 - prod_{j<m} (a + j) / (a + b + j)
    s = 0:      P_eff = 1 - E[(1-p)^m] = 1 - prod_{j<m} (b + j) / (a + b + j)

(before any rollout, both ways of agreeing count). A prompt gets K probe rollouts, then, round
by round: **commit** (sample the rest of its group) when P_eff >= tau_hi, **abandon** when
P_eff <= tau_lo, else one more rollout. With Beta(1, 1), n agreeing rollouts give
P_eff = 1 - (n + 1) / (G + 1), so tau_lo abandons after n >= (1 - tau_lo)(G + 1) - 1 of them.
For G = 8 that is 0.67, 0.56, 0.44 after 2, 3, 4: tau_lo = 0.45 abandons a prompt after K = 4
agreeing probes and commits it as soon as they disagree. The same tau_lo means more rollouts
for a larger group: for G = 16, P_eff = 1 - 9/17 = 0.47 after 8 agreeing and 1 - 10/17 = 0.41
after 9, so it abandons after 9 (K = 4 probes, then 5 more rounds of one rollout; abandoning
after K = 4 needs tau_lo >= 1 - 5/17 = 0.706); for G = 4 after 2 (1 - 3/5 = 0.4).

Abandoning frees budget for new prompts, drawn from the selector (data order, or DPS for
``sara:dps``) until B groups are committed and complete or ``max_rounds`` rounds have run.
A round holds S = B * G rows, filled in this order: the completions of committed groups (a
group gets what fits, the rest next round), one more rollout for each undecided prompt while
they fit (the rest wait a round), then K probes for as many new prompts as the running commit
rate says are needed and as whole probe sets fit. Commits beyond B are not completed
(``surplus``), and once B groups are committed the prompts still undecided are no longer
sampled (they could only become surplus). Every rollout of every prompt is counted, and the
step's prompts add up: ``committed + abandoned + surplus + undecided = prompts_touched``, where
``undecided`` counts the prompts the step left without a decision, dropped after B commits or
still undecided when ``max_rounds`` ran out. They are neither committed nor abandoned: the
abandon rate and the running commit rate count decided prompts only. A group committed but not
complete when the round cap ends the step (``incomplete``) is not trained on; its slot, like
every missing group, is an empty group.

Posteriors do not carry over between the times a prompt is drawn: each draw starts from
Beta(alpha0, beta0). The paper's thresholds are set for that prior (the K = 4 arithmetic
above), and the policy moves between draws, so an old posterior would be stale evidence;
prompt history belongs to the selector (``sara:dps`` chooses prompts by their dynamics,
SARA decides when to stop each one).

Wrong abandonments are measured outside the budget: the slots a round leaves free (its shape is
fixed) complete a random sample of the step's abandoned prompts, which counts as wrong when the
completed group would have been effective. Those rows are neither counted nor trained on.

The rule is ``SaraRule`` (``rule.py``): its rounds are ``round_groups.RoundGroups``'s, which
fill, stop and audit as above for any rule. On the slot pool of partial rollouts
(``rollout.partial``) the same rule runs on ``partial.PartialGroups``: a new prompt admits its
K probe rows into free slots; when every row admitted to it has ended it commits (the rest
of its group is admitted, ahead of any new prompt), abandons (its slots already went to the
next prompts) or asks for one more rollout. Nothing is surplus or
undecided at a step's end: a group committed late, or still being decided, stays in the pool
and trains in a later step (within ``rollout.max_staleness``); every slot freed goes at once to
the next request, so there is no spare slot to audit abandonments with (not measured there).
At most ``max_rounds`` x B x G rows are admitted a step, the static rule's rollouts.
"""

from __future__ import annotations

import dataclasses
import math

from grpo_jax import errors, registry
from grpo_jax.allocation import allocator as allocator_lib
from grpo_jax.allocation import rounds as rounds_lib
from grpo_jax.allocation import rule as rule_lib


def p_effective(num_probes: int, num_successes: int, group_size: int, alpha0: float = 1.0,
                beta0: float = 1.0) -> float:
  """Probability that a group of ``group_size`` will be effective (see the module docstring).

  Args:
    num_probes: n rollouts seen so far (0 <= n <= G).
    num_successes: s successes among them.
    group_size: G.
    alpha0, beta0: the Beta prior on the success rate.

  Returns:
    P_eff in [0, 1]; 1 once the probes disagree, 0 for a complete group that agrees.
  """
  n, s, g = int(num_probes), int(num_successes), int(group_size)
  if not 0 <= s <= n <= g:
    raise ValueError(f"need 0 <= successes <= probes <= group_size, got {s}, {n}, {g}")
  if 0 < s < n:
    return 1.0
  a, b, m = alpha0 + s, beta0 + n - s, g - n
  all_success = math.prod((a + j) / (a + b + j) for j in range(m))
  all_failure = math.prod((b + j) / (a + b + j) for j in range(m))
  if n == 0:
    return 1.0 - all_success - all_failure
  return 1.0 - (all_success if s == n else all_failure)


def decide(num_probes: int, num_successes: int, group_size: int, tau_lo: float,
           tau_hi: float, alpha0: float = 1.0, beta0: float = 1.0) -> str:
  """"commit", "abandon" or "continue" for a prompt after n rollouts with s successes."""
  p = p_effective(num_probes, num_successes, group_size, alpha0, beta0)
  return "commit" if p >= tau_hi else "abandon" if p <= tau_lo else "continue"


class SaraRule(rule_lib.Rule):
  """SARA's probe / commit / abandon rule (module doc), on rounds and on the pool.

  Args:
    group_size: G.
    effective_signal: as every rule (SARA decides on successes).
    probes: K, rollouts before the first decision.
    tau_lo, tau_hi: abandon / commit thresholds on P_eff.
    alpha0, beta0: the Beta prior of every draw.
  """

  name = "sara"

  def __init__(self, group_size: int, effective_signal: str = "success", *, probes: int = 4,
               tau_lo: float = 0.45, tau_hi: float = 0.9, alpha0: float = 1.0,
               beta0: float = 1.0):
    if not 1 <= probes <= group_size:
      raise ValueError(f"probes must be in [1, group_size={group_size}], got {probes}")
    if not 0.0 <= tau_lo < tau_hi <= 1.0:
      raise ValueError(f"need 0 <= tau_lo < tau_hi <= 1, got {tau_lo}, {tau_hi}")
    super().__init__(group_size, effective_signal, first_rows=probes)
    self.probes, self.tau_lo, self.tau_hi = probes, tau_lo, tau_hi
    self.alpha0, self.beta0 = alpha0, beta0
    self.commit_rate = 0.5  # running share of decided prompts that commit (sizes new draws)

  def verdict(self, rows: rounds_lib.Rows, group_size: int) -> rule_lib.Verdict:
    verdict = decide(len(rows), rule_lib.successes(rows), group_size, self.tau_lo, self.tau_hi,
                     self.alpha0, self.beta0)
    return {"commit": rule_lib.COMMIT, "abandon": rule_lib.DROP}.get(verdict,
                                                                     rule_lib.Verdict.more(1))

  def new_groups(self, *, needed: int, undecided: int, free: int, last: bool) -> int:
    """Enough new prompts that, at the running commit rate, the undecided ones and the new
    ones commit the groups still needed; at most what the free slots hold; none in the last
    round (a probe could at best commit a group that no round is left to complete)."""
    if last or needed <= 0:
      return 0
    rate = max(self.commit_rate, 0.05)
    want = math.ceil(max(needed - undecided * rate, 0.0) / rate)
    return max(0, min(want, free // self.probes))

  def end_step(self, counts: rule_lib.Counts) -> None:
    decided = counts.committed + counts.dropped + counts.surplus
    if decided:
      self.commit_rate = (0.5 * self.commit_rate
                          + 0.5 * (counts.committed + counts.surplus) / decided)

  def metrics(self, counts: rule_lib.Counts) -> dict:
    c, a = counts.committed, counts.dropped
    out = {"alloc/committed": float(c), "alloc/abandoned": float(a)}
    if counts.on_rounds:
      out.update({"alloc/surplus": float(counts.surplus),
                  "alloc/undecided": float(counts.undecided),
                  "alloc/incomplete": float(counts.incomplete)})
    out["alloc/abandon_rate"] = a / max(c + a + counts.surplus, 1)
    if counts.on_rounds:
      out.update({"alloc/audited": float(counts.audited),
                  "alloc/wrong_abandoned": float(counts.wrong),
                  **({"alloc/wrong_abandon_rate": counts.wrong / counts.audited}
                     if counts.audited else {})})
    return out

  def state_dict(self) -> dict:
    return {"commit_rate": self.commit_rate}

  def load_state_dict(self, state: dict) -> None:
    self.commit_rate = state.get("commit_rate", self.commit_rate)


@allocator_lib.RULES.register("sara")
@dataclasses.dataclass(frozen=True)
class SaraSpec(registry.Configurable):
  """``config.allocation.sara`` (arXiv 2607.26253).

  Attributes:
    probes: K rollouts before the first commit / abandon decision.
    tau_lo: abandon when P(effective group) <= tau_lo.
    tau_hi: commit (complete the group) when P(effective group) >= tau_hi.
    alpha0: Beta prior on a prompt's success rate, each draw.
    beta0: (see alpha0).
  """

  probes: int = 4
  tau_lo: float = 0.45
  tau_hi: float = 0.9
  alpha0: float = 1.0
  beta0: float = 1.0

  def __post_init__(self):
    if self.probes < 1:
      raise ValueError(f"probes={self.probes} must be >= 1")
    if not 0.0 <= self.tau_lo < self.tau_hi <= 1.0:
      raise ValueError(f"need 0 <= tau_lo ({self.tau_lo}) < tau_hi ({self.tau_hi}) <= 1")
    if not (self.alpha0 > 0 and self.beta0 > 0):
      raise ValueError(f"alpha0 ({self.alpha0}) and beta0 ({self.beta0}) must be > 0")

  def check_config(self, config) -> None:
    g = config.rollout.group_size
    errors.check(self.probes <= g, "allocation.sara.probes",
                 f"{self.probes} must be in [1, group_size={g}]")

  def rule(self, *, group_size: int, effective_signal: str = "success") -> SaraRule:
    return SaraRule(group_size, effective_signal, probes=self.probes, tau_lo=self.tau_lo,
                    tau_hi=self.tau_hi, alpha0=self.alpha0, beta0=self.beta0)
