"""The step's pi_prox plan (grpo_jax/rl/prox_plan.py): every branch of the decision table, by
hand. The train step's values under each plan are the other files' (test_continued, test_step,
test_popo, test_headroom, test_prox)."""

import itertools

import pytest

from grpo_jax.rl import prox_plan
from grpo_jax.rl.replay import headroom, popo
from grpo_jax.rl.step_config import StepConfig

DECOUPLED = popo.Popo()  # objective "decoupled": uses pi_prox
ALIGN_MU = headroom.HeadroomDrift(slots=1, candidates=2)  # objective "align_mu": does not


def _plan(replaying=True, measured=False, bounded=True, method=DECOUPLED, **step):
  config = StepConfig(num_minibatches=1, group_size=2, replay=method, **step)
  return prox_plan.plan(config, replaying, measured=measured, bounded=bounded)


@pytest.mark.parametrize("case,expected", [
    # prox_pass="all": every row, whatever else holds; the method's values are not merged.
    (dict(prox_pass="all", continued=True, measured=True), ("every", False, False)),
    (dict(prox_pass="all", replaying=False), ("every", False, False)),
    # No off-policy row: no pass.
    (dict(replaying=False), ("none", False, False)),
    # An objective without pi_prox: no pass, nothing interpolated.
    (dict(method=ALIGN_MU, prox_estimate="interpolate"), ("none", False, False)),
    # Interpolated: no pass; a measuring method's rows keep its values (without continued rows
    # every off-policy row is one it measured: nothing left to interpolate).
    (dict(prox_estimate="interpolate"), ("none", False, True)),
    (dict(prox_estimate="interpolate", measured=True), ("none", False, False)),
    (dict(prox_estimate="interpolate", measured=True, continued=True), ("none", False, True)),
    # Continued rows: the rows that need it in chunks, or the batch; merged with a measuring
    # method's values.
    (dict(continued=True, prox_chunks=2), ("needed", False, False)),
    (dict(continued=True, prox_chunks=2, measured=True), ("needed", True, False)),
    (dict(continued=True, measured=True), ("batch", True, False)),
    (dict(continued=True, replaying=False), ("batch", False, False)),
    # Replay only: the method's own values, its bound in chunks, or the batch.
    (dict(measured=True, prox_chunks=2), ("none", False, False)),
    (dict(prox_chunks=2), ("method", False, False)),
    (dict(prox_chunks=2, bounded=False), ("batch", False, False)),
    (dict(), ("batch", False, False)),
])
def test_the_decision_table(case, expected):
  plan = _plan(**case)
  assert (plan.rows, plan.merge, plan.interpolate) == expected


def test_denominators_and_where_their_prox_comes_from():
  # The decoupled objective: from the pass when one runs, else from the method's own values.
  assert (_plan().denominators, _plan().prox_from) == (True, "pass")
  measured = _plan(measured=True)
  assert (measured.rows, measured.denominators, measured.prox_from) == ("none", True, "method")
  # Interpolated without the method's values: nothing known when the batch is built.
  assert not _plan(prox_estimate="interpolate").denominators
  # align_mu needs no pi_prox: its denominators (mu, pi_gen) always apply to off-policy rows.
  align = _plan(method=ALIGN_MU)
  assert (align.rows, align.denominators, align.prox_from) == ("none", True, None)
  # Nothing off-policy: nothing to correct.
  assert not _plan(replaying=False).corrects and not _plan(replaying=False).denominators


def test_every_plan_is_consistent():
  """Over every combination of the static facts: a merge only with a pass over continued
  rows; interpolation only without a pass; chunks only where the pass is gathered."""
  for pp, est, chunks, continued, replaying, measured, bounded, method in itertools.product(
      ("replayed", "all"), ("exact", "interpolate"), (0, 2), (False, True), (False, True),
      (False, True), (False, True), (DECOUPLED, ALIGN_MU)):
    plan = _plan(replaying=replaying, measured=measured, bounded=bounded, method=method,
                 prox_pass=pp, prox_estimate=est, prox_chunks=chunks, continued=continued)
    assert plan.rows in prox_plan.ROWS
    assert not plan.merge or (continued and measured and plan.rows in ("batch", "needed"))
    assert not plan.interpolate or plan.rows == "none"
    assert plan.rows not in ("method", "needed") or chunks
    assert plan.corrects == (replaying or continued)
    assert plan.every_row == (pp == "all")
