"""Carrying a sweep's records of an older config over to the current one, on evidence.

A record stands for its cell while today's config of the cell is the run it recorded
(``config_match``: a key added at its default changes nothing). Any other change (a value, a
default a cell relied on, a key renamed or removed) makes the cell's records stale, and a stale
record is left out of the tables. The evidence that such a change moves nothing is a re-run: a
stale cell run again on the current config (``sweep --only`` picks it) whose every evaluation
equals its old record's; the sweep stores that verdict in the new record (``previous.identical``,
``same_evaluations``). ``decide`` then carries over a method's other stale records written by
the same code commit (the same code and config change lies between them and now); a re-run
that differed blocks them. Pure functions over record dicts and ``config_match.Current``;
``sweep.carry_over`` reads and writes the files.
"""

from __future__ import annotations

from grpo_jax.bench import config_match

# What a re-run must reproduce exactly, at every evaluation, to carry older records over.
SAME = ("step", "rollouts", "completion_tokens", "mean_at_k", "pass_at_k", "greedy_accuracy")


def stale(rec: dict, now: config_match.Current) -> dict | None:
  """The done record of an older config in ``rec`` (a re-run stopped before its end keeps it
  under ``replaces``), or None when there is none or it stands for the cell's config ``now``."""
  rec = rec.get("replaces", rec)
  if rec.get("status") != "done" or now.stands(rec):
    return None
  return rec


def same_evaluations(a: dict, b: dict) -> bool:
  """Whether two records' evaluations are identical (every ``SAME`` field, bit for bit)."""
  pick = lambda r: [[e.get(k) for k in SAME] for e in r.get("evals", [])]
  return bool(a.get("evals")) and pick(a) == pick(b)


def agreed_until(a: dict, b: dict) -> int | None:
  """The last evaluation step up to which two records agree on every ``SAME`` field, from the
  first evaluation on (None when they differ at the first, or either has none).

  Where a re-run parts from its record hints at what moved: a change on every step's path shows
  at the first evaluation after step 0; a float-rounding difference (another machine, library
  build or summation order) only once it has flipped a sampled token, after which the two runs
  are different draws. A change in a path taken only late reads like the second: a run of the
  old code on today's machine tells them apart.
  """
  last = None
  for ea, eb in zip(a.get("evals", []), b.get("evals", [])):
    if any(ea.get(k) != eb.get(k) for k in SAME):
      break
    last = ea.get("step")
  return last


def decide(recs: dict[str, dict], now: dict[str, config_match.Current]
           ) -> tuple[dict[str, dict], dict[str, str]]:
  """Which stale done records the re-runs vouch for.

  Args:
    recs: cell id -> its record.
    now: cell id -> its config today.

  Returns:
    The records carried over (cell id -> the record with today's config and hash and
    ``carried_over``: the old hash, what changed where the record stored its config, and the
    re-runs that vouch for it), and for each stale record left as it is, why.
  """
  proof: dict[tuple, dict[str, list[str]]] = {}
  for cell_id, r in recs.items():
    p = r.get("previous")
    if r.get("status") == "done" and now[cell_id].stands(r) and p:
      verdict = "same" if p.get("identical") else "differed"
      proof.setdefault((r["method"], p.get("code")), {}).setdefault(verdict, []).append(cell_id)
  carried, left = {}, {}
  for cell_id, r in recs.items():
    if r.get("status") != "done" or now[cell_id].stands(r):
      continue
    code = r.get("code") or "?"
    seen = proof.get((r["method"], r.get("code")), {})
    if seen.get("differed"):
      left[cell_id] = (f"{r['method']} at {code[:12]}: the re-run of {seen['differed'][0]} "
                       "differs from its record")
    elif not seen.get("same"):
      left[cell_id] = (f"{r['method']} at {code[:12]}: no re-run of its cells yet (run one "
                       "with --only)")
    else:
      changed = now[cell_id].changes(r)
      carried[cell_id] = dict(r, config=now[cell_id].config, config_hash=now[cell_id].hash,
                              carried_over={"from": r["config_hash"],
                                            **({"changed": changed} if changed else {}),
                                            "verified_by": seen["same"]})
  return carried, left
