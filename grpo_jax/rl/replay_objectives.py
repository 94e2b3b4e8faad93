"""How replayed rows enter the loss: objective name -> the log-probs of the loss's denominators.

``losses.policy_loss`` weighs each token by the behaviour weight w = pi_prox' / mu' and clips
the trust-region ratio rho = pi_theta / pi_prox'. On fresh rows mu' = mu (the sampler's
log-probs) and pi_prox' = pi_prox (the policy at the start of the step). On replayed rows the
replay method's ``objective`` (replay/method.py) chooses them from what the step knows of the
row: mu, pi_prox and pi_gen (the trainer's log-probs when the row was generated: mu itself in
float32, mu without the sampler/trainer mismatch under bfloat16):

  decoupled  mu' = mu,      pi_prox' = pi_prox   w = pi_prox / mu (capped)   POPO; Hilton et
                                                                             al. 2110.00641
  pi_old     mu' = pi_prox, pi_prox' = pi_prox   w = 1                       replay taken as
                                                                             on-policy
  align_mu   mu' = mu,      pi_prox' = pi_gen    w = pi_gen / mu,            coupled PPO around
                                                 rho = pi_theta / pi_gen     mu (Yoo et al.;
                                                                             Headroom-Drift)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

# (mu, pi_prox, pi_gen) [N + R, T] -> (mu', pi_prox') [N + R, T]; pi_prox is None when the
# objective does not use it.
Denominators = Callable[[jax.Array, jax.Array | None, jax.Array], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Objective:
  """One way for replayed rows to enter the loss.

  Attributes:
    uses_prox: the denominators need pi_prox of the replayed rows (a no-grad pass at the
      start-of-step parameters, unless the replay method made it).
    denominators: (mu, pi_prox, pi_gen) -> (mu', pi_prox'), each [N + R, T] float32 log-probs;
      the step keeps them on the replayed rows only.
  """

  uses_prox: bool
  denominators: Denominators


OBJECTIVES = {
    "decoupled": Objective(uses_prox=True, denominators=lambda mu, prox, gen: (mu, prox)),
    # Replayed rows as if the current policy had sampled them: mu := pi_prox, so w = 1.
    "pi_old": Objective(uses_prox=True, denominators=lambda mu, prox, gen: (prox, prox)),
    # Clipped around the behaviour policy; the behaviour weight keeps mu.
    "align_mu": Objective(uses_prox=False, denominators=lambda mu, prox, gen: (mu, gen)),
}
