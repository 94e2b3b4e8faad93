"""Accuracy curves of a run on its budget's axis, read from its metrics: rollouts or completion
tokens generated, the first evaluation past a mark, and the budget at which a target is reached.

Shared by the sample-efficiency benchmark (``bench/efficiency.py``) and the sweep runner
(``bench/sweep.py``); no flags, so either can import it.
"""

from __future__ import annotations

from grpo_jax.run import metrics as metrics_lib
from grpo_jax.run import report_writer


# The x axes of a budget: a curve's (step, x, mean@k) key -> its label in the tables.
AXES = {"rollouts": "rollouts", "completion_tokens": "completion tokens"}


def token_curve(workdir: str, k: int = 8) -> list[tuple[int, int, float]]:
  """(step, completion tokens, mean@k) of every evaluation of a run, like ``report_writer.curve``
  with completion tokens for rollouts.

  An evaluation record has no token count: it is the cumulative ``completion_tokens`` of the
  last step record of the same step written before it (the loop writes a step's record just
  before its evaluation's), 0 for the evaluation before the first step.

  Raises:
    ValueError: an evaluation after step 0 has no step record before it (a run with
      ``log_every`` > 1).
  """
  key = f"eval/mean_at_{k}"
  tokens, out = {0: 0}, []
  for r in metrics_lib.read_metrics(workdir):
    if key in r:
      t = r.get("completion_tokens", tokens.get(r["step"]))
      if t is None:
        raise ValueError(f"{workdir}: the evaluation at step {r['step']} has no step record "
                         "before it to read its completion tokens from (log_every > 1?)")
      out.append((r["step"], t, r[key]))
    elif "completion_tokens" in r:
      tokens[r["step"]] = r["completion_tokens"]
  return out


def budget_curve(workdir: str, k: int, axis: str) -> list[tuple[int, int, float]]:
  """(step, x, mean@k) of every evaluation, x on ``axis``: "rollouts" or "completion_tokens"."""
  return token_curve(workdir, k) if axis == "completion_tokens" else report_writer.curve(workdir, k)


def at_marks(curve, marks) -> list[tuple[int, float]]:
  """(x, mean@k) of the first evaluation at or past each mark on the curve's x axis (its
  rollouts or tokens; None when the run never got there)."""
  out = []
  for m in marks:
    hit = next(((r, a) for _, r, a in curve if r >= m), None)
    out.append(hit)
  return out


def to_target(curve, target: float) -> float | None:
  """The x (rollouts or tokens, the curve's axis) at which the run first reaches ``target``,
  interpolated linearly between the evaluations on either side; None if it never does."""
  prev = None
  for _, r, a in curve:
    if a >= target:
      if prev is None or prev[1] >= target:
        return float(r)
      (r0, a0) = prev
      return r0 + (target - a0) / (a - a0) * (r - r0)
    prev = (r, a)
  return None
