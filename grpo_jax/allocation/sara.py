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

On the slot pool of partial rollouts (``rollout.partial``) the same rule runs as ``PoolSara``:
a new prompt admits its K probe rows into free slots; when every row admitted to it has ended
it commits (the rest of its group is admitted, ahead of any new prompt), abandons (its slots
already went to the next prompts) or asks for one more rollout. Nothing is surplus or
undecided at a step's end: a group committed late, or still being decided, stays in the pool
and trains in a later step (within ``rollout.max_staleness``); every slot freed goes at once to
the next request, so there is no spare slot to audit abandonments with (not measured there).
At most ``max_rounds`` x B x G rows are admitted a step, the static rule's rollouts.
"""

from __future__ import annotations

import dataclasses

import math

import numpy as np

from grpo_jax import errors, registry
from grpo_jax.allocation import allocator as allocator_lib
from grpo_jax.allocation import rounds as rounds_lib
from grpo_jax.generate import producer as producer_lib


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


class _Prompt:
  """One prompt's rollouts within a step."""

  def __init__(self, prompt):
    self.prompt, self.parts = prompt, []

  @property
  def rows(self) -> rounds_lib.Rows:
    return rounds_lib.Rows.concat(self.parts)

  @property
  def n(self) -> int:
    return sum(len(p) for p in self.parts)

  @property
  def successes(self) -> int:
    return int(sum(np.sum(p.rollout.success) for p in self.parts))


class Sara(allocator_lib.Allocator):
  """SARA's probe / commit / abandon rule over fixed-shape rounds.

  Args:
    selector, sampler, num_groups, group_size, effective_signal: see ``Allocator``.
    probes: K, rollouts before the first decision.
    tau_lo, tau_hi: abandon / commit thresholds on P_eff.
    alpha0, beta0: the Beta prior of every draw.
    max_rounds: generation rounds per step at most; the last one only completes committed
      groups (no new prompt, no more rollouts for undecided ones).
    seed: seed of the audit sample.
  """

  name = "sara"

  def __init__(self, selector, sampler, *, num_groups: int, group_size: int,
               effective_signal: str = "success", probes: int = 4, tau_lo: float = 0.45,
               tau_hi: float = 0.9, alpha0: float = 1.0, beta0: float = 1.0,
               max_rounds: int = 10, seed: int = 0):
    super().__init__(selector, sampler, num_groups=num_groups, group_size=group_size,
                     effective_signal=effective_signal)
    if not 1 <= probes <= group_size:
      raise ValueError(f"probes must be in [1, group_size={group_size}], got {probes}")
    if not 0.0 <= tau_lo < tau_hi <= 1.0:
      raise ValueError(f"need 0 <= tau_lo < tau_hi <= 1, got {tau_lo}, {tau_hi}")
    if max_rounds < 2:
      raise ValueError(f"max_rounds must be >= 2 (probe, then complete), got {max_rounds}")
    self.probes, self.tau_lo, self.tau_hi = probes, tau_lo, tau_hi
    self.alpha0, self.beta0, self.max_rounds = alpha0, beta0, max_rounds
    self.commit_rate = 0.5  # running share of decided prompts that commit (sizes new draws)
    self.rng = np.random.default_rng([seed, 0x5A4A])

  def state_dict(self) -> dict:
    return {**super().state_dict(), "commit_rate": self.commit_rate,
            "rng": self.rng.bit_generator.state}

  def load_state_dict(self, state: dict) -> None:
    super().load_state_dict(state)
    self.commit_rate = state["commit_rate"]
    self.rng.bit_generator.state = state["rng"]

  def _new_prompts(self, needed: int, undecided: int, free: int) -> int:
    """How many prompts to start: enough that, at the running commit rate, the undecided ones
    and the new ones commit the groups still needed; at most what the free slots hold."""
    rate = max(self.commit_rate, 0.05)
    want = math.ceil(max(needed - undecided * rate, 0.0) / rate)
    return max(0, min(want, free // self.probes))

  def _requests(self, committed, undecided) -> list:
    """This round's (prompt, count) requests before new probes, at most S rows: completions
    of committed groups first (a group gets what fits, the rest next round), then one rollout
    for each undecided prompt while they fit (the rest wait a round)."""
    room, requests = self.sampler.slots, []
    for c in committed:
      # Cannot bind while at most B groups are committed (B * (G - K) < S); it keeps the cap
      # true by construction.
      count = min(self.group_size - c.n, room)
      if count:
        requests.append((c, count))
        room -= count
    requests += [(u, 1) for u in undecided[:room]]
    return requests

  def collect(self, params, step: int, rng):
    b, g, k = self.num_groups, self.group_size, self.probes
    committed, undecided, abandoned, dropped, touched = [], [], [], [], []
    audits = []  # (abandoned prompt, its audit rows)
    surplus = 0
    taken = set()
    r = 0
    while r < self.max_rounds:
      if len(committed) >= b and all(c.n == g for c in committed):
        break
      # The last round completes groups only: one more rollout for an undecided prompt could
      # at best commit a group that no round is left to complete.
      last = r == self.max_rounds - 1
      requests = self._requests(committed, [] if last else undecided)
      free = self.sampler.slots - sum(n for _, n in requests)
      new = 0
      if not last and len(committed) < b:
        new = self._new_prompts(b - len(committed), len(undecided), free)
      fresh = [_Prompt(p) for p in self._draw(new, taken)] if new else []
      taken.update(f.prompt.index for f in fresh)
      touched += fresh
      requests += [(f, k) for f in fresh]
      if not requests:
        break  # nothing left to sample (the pool ran dry)
      # An abandoned group already complete (n = G) is surely ineffective: nothing to audit.
      unaudited = [a for a in abandoned if a.n < g and all(a is not x for x, _ in audits)]
      order = self.rng.permutation(len(unaudited)) if unaudited else []
      spare = [(unaudited[i], g - unaudited[i].n) for i in order]
      per_request, spare_out = self.sampler.run(
          params, [(x.prompt, n) for x, n in requests], self.round_key(rng, r),
          spare=[(a.prompt, n) for a, n in spare])
      r += 1
      for (x, _), rows in zip(requests, per_request):
        x.parts.append(rows)
      audits += [(spare[i][0], rows) for i, rows in spare_out]
      # Decide every prompt that is neither committed nor abandoned (one left waiting for a
      # slot decides as before: its counts did not move).
      still = []
      for x in undecided + fresh:
        verdict = decide(x.n, x.successes, g, self.tau_lo, self.tau_hi, self.alpha0,
                         self.beta0)
        if verdict == "commit" and len(committed) < b:
          committed.append(x)
        elif verdict == "commit":
          surplus += 1  # B groups are committed already: not completed
        elif verdict == "abandon":
          abandoned.append(x)
        else:
          still.append(x)
      if len(committed) >= b:
        dropped += still  # with B commits they could only become surplus: stop sampling them
        still = []
      undecided = still
    decided = len(committed) + len(abandoned) + surplus
    if decided:
      self.commit_rate = 0.5 * self.commit_rate + 0.5 * (len(committed) + surplus) / decided
    wrong = sum(rounds_lib.is_effective(rounds_lib.Rows.concat([a.rows, rows]),
                                        self.effective_signal) for a, rows in audits)
    # A commit the round cap left short of G is not trained on (its rows are still counted).
    groups = [(c.prompt, c.rows) for c in committed if c.n == g]
    return self._finish(
        groups, [x.rows for x in touched], [(x.prompt, x.rows) for x in touched], step,
        rounds=r, extra={"alloc/committed": float(len(committed)),
                         "alloc/abandoned": float(len(abandoned)),
                         "alloc/surplus": float(surplus),
                         "alloc/undecided": float(len(dropped) + len(undecided)),
                         "alloc/incomplete": float(len(committed) - len(groups)),
                         "alloc/abandon_rate": len(abandoned) / max(decided, 1),
                         "alloc/audited": float(len(audits)),
                         "alloc/wrong_abandoned": float(wrong),
                         **({"alloc/wrong_abandon_rate": wrong / len(audits)} if audits else {})})


class PoolSara:
  """SARA on the slot pool (``allocation.partial.PoolPolicy``; module doc): K probe rows, then
  commit (the rest of the group), one more rollout, or abandon, each time every row admitted
  to a prompt has ended.

  Args:
    probes: K.
    tau_lo, tau_hi: abandon / commit thresholds on P_eff.
    alpha0, beta0: the Beta prior of every prompt.
  """

  def __init__(self, *, probes: int, tau_lo: float, tau_hi: float, alpha0: float = 1.0,
               beta0: float = 1.0):
    self.first_rows, self.tau_lo, self.tau_hi = probes, tau_lo, tau_hi
    self.alpha0, self.beta0 = alpha0, beta0
    self._committed: set = set()  # tags committed whose group is not complete yet
    self._counts = {"committed": 0, "abandoned": 0}

  def verdict(self, tag, rows: rounds_lib.Rows, group_size: int) -> int:
    n, g = len(rows), group_size
    if tag in self._committed:  # the rest of a committed group has ended: complete
      self._committed.discard(tag)
      return 0
    verdict = decide(n, int(np.sum(rows.rollout.success)), g, self.tau_lo, self.tau_hi,
                     self.alpha0, self.beta0)
    if verdict == "abandon":
      self._counts["abandoned"] += 1
      return producer_lib.DROP
    if verdict == "commit":
      self._counts["committed"] += 1
      if n == g:
        return 0
      self._committed.add(tag)
      return g - n
    return 1

  def forget(self, tag) -> None:
    self._committed.discard(tag)

  def take_stats(self) -> dict:
    c, a = self._counts["committed"], self._counts["abandoned"]
    self._counts = {"committed": 0, "abandoned": 0}
    return {"alloc/committed": float(c), "alloc/abandoned": float(a),
            "alloc/abandon_rate": a / max(a + c, 1)}

  def state_dict(self) -> dict:
    return {"committed": sorted(self._committed)}

  def load_state_dict(self, state: dict) -> None:
    self._committed = set(state["committed"])


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

  def build(self, selector, sampler, *, max_rounds: int, seed: int, **shape) -> Sara:
    return Sara(selector, sampler, probes=self.probes, tau_lo=self.tau_lo, tau_hi=self.tau_hi,
                alpha0=self.alpha0, beta0=self.beta0, max_rounds=max_rounds, seed=seed, **shape)

  def pool_policy(self, **unused) -> PoolSara:
    """The rule on the pool of partial rollouts."""
    del unused
    return PoolSara(probes=self.probes, tau_lo=self.tau_lo, tau_hi=self.tau_hi,
                    alpha0=self.alpha0, beta0=self.beta0)
