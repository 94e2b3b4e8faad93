"""Sample efficiency: held-out accuracy against rollouts or tokens generated, per method and seed.

    python -m grpo_jax.bench.efficiency --methods=grpo,popo --seeds=3 --steps=100
    python -m grpo_jax.bench.efficiency --methods=grpo,popo,popo:filter,popo:pi_old --seeds=3
    python -m grpo_jax.bench.efficiency --methods=grpo,dapo,sara,sara:dps,grpo:mopps,grpo:dps,popo \
        --seeds=3 --rollouts=25600 --presets=pool=1024
    python -m grpo_jax.bench.efficiency --methods=grpo,dapo --seeds=3 --tokens=400000

Every method trains from the embedded checkpoint with its config file (configs/<method>.py,
optionally with presets after a colon: ``popo:filter``, ``popo:stale=10``, several joined by
``+`` since ``--methods`` is comma-separated: ``rollout_replay:paper+minibatches=4``) and the
same batch (B prompts x G rollouts per step), so equal steps mean equal rollouts, unless the
method allocates rollouts (DAPO's dynamic sampling, SARA), which spends a different number per
step. Three budgets, one per invocation:

* ``--steps=S`` (the default): every run makes S optimiser steps and is evaluated every
  ``--eval_every`` steps; the table has one row per evaluation.
* ``--rollouts=R``: every run stops once it has *generated* R rollouts
  (``config.total_rollouts``) and is evaluated each time another ``--eval_every_rollouts`` were
  generated (default: ``--eval_every`` steps of B x G).
* ``--tokens=N``: every run stops once it has generated N completion tokens
  (``config.total_tokens``) and is evaluated each time another ``--eval_every_tokens`` were
  generated (``config.eval.every_tokens``; default N / 4, rounded). This compares methods whose
  completion lengths differ at equal generation cost; a step's tokens are read from the step
  record written just before its evaluation, so these runs log every step.

With a budget (``--rollouts`` or ``--tokens``, not both) the table has one row per mark
0, M, 2M, ..., budget (M the evaluation interval): each seed's mean@k at its first evaluation
at or past the mark, then the seeds' mean and population std; then the rollouts (or tokens)
each method needed to reach a target accuracy (``--target``; by default the accuracy GRPO
ends with, mean over its seeds; else the first method's), interpolated between evaluations.
Run folders are ``<out>/<method>[-<presets>][-tokensN]_seed<s>``: a finished run is reused
when it is complete for the requested budget; token-budget runs have their own folders, so a
run of another budget is never continued or reused.

Writes ``<out>/efficiency.md`` (the markdown table, mean@k of the config: 8, or 2 under
``:smoke``), ``<out>/efficiency.json`` and ``<out>/efficiency.png`` (accuracy against rollouts
and wall seconds; needs matplotlib), and prints the table.
"""

from __future__ import annotations

import json
import os

import numpy as np
from absl import app, flags

from grpo_jax import console
from grpo_jax import train
from grpo_jax.bench.curves import AXES, at_marks, budget_curve, to_target
from grpo_jax.run import evaluate as evaluate_lib
from grpo_jax.run import report_writer
from grpo_jax.schema import files

_METHODS = flags.DEFINE_list("methods", ["grpo", "popo"],
                             "config files under configs/, with optional presets: popo:filter "
                             "(several joined by +: rollout_replay:paper+minibatches=4)")
_PRESETS = flags.DEFINE_string("presets", "", "presets added to every method's config, "
                               "e.g. countdown_hard")
_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds 0..n-1 per method")
_STEPS = flags.DEFINE_integer("steps", 100, "optimiser steps per run")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "steps between evaluations")
_OUT = flags.DEFINE_string("out", "runs/efficiency", "output folder")
_ROLLOUTS = flags.DEFINE_integer("rollouts", 0, "rollout budget per run (0: --steps steps)")
_EVAL_ROLLOUTS = flags.DEFINE_integer("eval_every_rollouts", 0, "with --rollouts: rollouts "
                                      "between evaluations (0: eval_every steps of B x G)")
_TOKENS = flags.DEFINE_integer("tokens", 0, "completion-token budget per run (0: none; not with "
                               "--rollouts)")
_EVAL_TOKENS = flags.DEFINE_integer("eval_every_tokens", 0, "with --tokens: completion tokens "
                                    "between evaluations (0: tokens / 4, rounded)")
_TARGET = flags.DEFINE_float("target", 0.0, "accuracy to reach (0: GRPO's final mean)")


def run_name(method: str) -> str:
  """A folder name for a method with presets: "popo:stale=10" -> "popo-stale10"."""
  return method.replace(":", "-").replace(",", "-").replace("+", "-").replace("=", "")


def budget_table(results: dict, marks: list[int], axis: str = "rollouts") -> str:
  """Markdown: one row per mark on ``axis`` (a key of AXES), one column per method (seeds,
  mean +- std); each seed's value is its first evaluation at or past the mark (its x overshoots
  the mark by less than one step's rollouts or tokens)."""
  methods = list(results)
  lines = [f"| {AXES[axis]} (mark) | " + " | ".join(f"{m}: seeds / mean ± std" for m in methods)
           + " |", "|---|" + "---|" * len(methods)]
  for i, mark in enumerate(marks):
    cells = []
    for m in methods:
      vals = [at_marks(c, marks)[i] for c in results[m].values()]
      vals = [v[1] for v in vals if v is not None]
      cells.append((" ".join(f"{v:.3f}" for v in vals) +
                    f" / **{np.mean(vals):.3f}** ± {np.std(vals):.3f}") if vals else "—")
    lines.append(f"| {mark:,} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def target_row(results: dict, target: float, axis: str = "rollouts") -> str:
  """Markdown row: the rollouts or tokens (``axis``) to reach ``target`` per method (mean +-
  std over the seeds that reached it, and how many did)."""
  cells = []
  for m in results:
    hits = [to_target(c, target) for c in results[m].values()]
    got = [h for h in hits if h is not None]
    cells.append((f"**{np.mean(got):,.0f}** ± {np.std(got):,.0f} " if got else "never ") +
                 f"({len(got)}/{len(hits)} seeds)")
  return f"| {AXES[axis]} to reach {target:.3f} | " + " | ".join(cells) + " |"


def aes_rows(results: dict, lengths: dict, base: str = "grpo") -> str | None:
  """Markdown rows: each seed's final evaluation scored with AES against its own start (the
  step-0 evaluation of that seed, which every method shares: the same embedded model and the
  same evaluation keys), then the margin over ``base``: AES(method) - AES(base), paired by
  seed. Yoo et al. (arXiv 2606.04560) report "+0.579 over GRPO" with O1-Pruner's AES, which is
  defined against a base model; we read that as AES(method) - AES(GRPO) with both against the
  model they start from [R: the paper's abstract does not say more], and compute it that way.
  Mean +- population std over seeds; None when ``base`` was not run, or when a seed's start
  has accuracy 0 (AES is relative to the start and undefined there, e.g. a ``:smoke`` run)."""
  if base not in results or any(c[0][2] <= 0 for r in results.values() for c in r.values()):
    return None

  def per_seed(m):
    out = {}
    for (seed, c), ls in zip(results[m].items(), lengths[m]):
      out[seed] = evaluate_lib.aes(c[-1][2], ls[-1], c[0][2], ls[0])
    return out

  scores = {m: per_seed(m) for m in results}
  cell = lambda vals: (" ".join(f"{v:+.3f}" for v in vals) +
                       f" / **{np.mean(vals):+.3f}** ± {np.std(vals):.3f}") if vals else "—"
  start = [cell(list(scores[m].values())) for m in results]
  margin = [cell([v - scores[base][s] for s, v in scores[m].items() if s in scores[base]])
            for m in results]
  return "\n".join(["| AES vs the start (end) | | " + " | ".join(start) + " |",
                    f"| AES margin over {base} (end, paired by seed) | | " + " | ".join(margin)
                    + " |"])


def table(results: dict, walls: dict | None = None) -> str:
  """Markdown: one row per evaluation point, one column per method (seeds, mean +- std)."""
  methods = list(results)
  points = [(s, r) for s, r, _ in next(iter(results[methods[0]].values()))]
  lines = ["| step | rollouts | " + " | ".join(
      f"{m}: seeds / mean ± std" for m in methods) + " |",
           "|---|---|" + "---|" * len(methods)]
  for i, (step, rollouts) in enumerate(points):
    cells = []
    for m in methods:
      vals = [c[i][2] for c in results[m].values()]
      cells.append(" ".join(f"{v:.3f}" for v in vals) +
                   f" / **{np.mean(vals):.3f}** ± {np.std(vals):.3f}")
    lines.append(f"| {step} | {rollouts:,} | " + " | ".join(cells) + " |")
  if walls:
    cells = [" ".join(f"{w[-1]:.0f}" for w in walls[m]) +
             f" / **{np.mean([w[-1] for w in walls[m]]):.0f}**" for m in methods]
    lines.append("| wall s at the end | | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv):
  del argv
  axis, budget, every = _budget()
  console.quiet_unless_verbose()
  os.makedirs(_OUT.value, exist_ok=True)
  results, walls, lengths, workdirs, curves = {}, {}, {}, {}, {}
  for method in _METHODS.value:
    name, _, presets = method.partition(":")
    presets = presets.replace("+", ",")
    module = files.module(name)
    results[method] = {}
    for seed in range(_SEEDS.value):
      config = module.get_config(",".join(filter(None, [presets, _PRESETS.value])) or None)
      config.seed = seed
      config.total_steps = _STEPS.value
      config.eval.every = _EVAL_EVERY.value
      config.checkpoint.every = _STEPS.value
      if _ROLLOUTS.value:
        per_step = config.rollout.batch_prompts * config.rollout.group_size
        config.total_rollouts = _ROLLOUTS.value
        config.eval.every_rollouts = _EVAL_ROLLOUTS.value or _EVAL_EVERY.value * per_step
        # Every allocator spends at least B x G rollouts per step; the budget stops the run.
        config.total_steps = -(-_ROLLOUTS.value // per_step)
        config.checkpoint.every = config.total_steps
      if _TOKENS.value:
        per_step = config.rollout.batch_prompts * config.rollout.group_size
        config.total_tokens = _TOKENS.value
        config.eval.every_tokens, config.eval.every_rollouts = every, 0
        # A step generates at least B x G tokens (one per rollout): the budget stops the run.
        config.total_steps = -(-_TOKENS.value // per_step)
        config.checkpoint.every = config.total_steps
        config.log_every = 1  # token_curve reads each evaluation's step record
      # --presets and the token budget are part of the name: a run of another task or budget
      # is never taken for this one.
      suffix = f"-{run_name(_PRESETS.value)}" if _PRESETS.value else ""
      suffix += f"-tokens{_TOKENS.value}" if _TOKENS.value else ""
      workdir = os.path.join(_OUT.value, f"{run_name(method)}{suffix}_seed{seed}")
      k = config.eval.k  # mean@k of the config (8, or 2 under :smoke)
      if not _finished(workdir, _STEPS.value, budget, axis, k):
        train.train_and_evaluate(config, workdir)
      results[method][seed] = report_writer.curve(workdir, k)
      curves.setdefault(method, {})[seed] = budget_curve(workdir, k, axis)
      workdirs.setdefault(method, []).append(workdir)
      walls.setdefault(method, []).append(report_writer.wall_at_evals(workdir, k))
      lengths.setdefault(method, []).append(report_writer.lengths_at_evals(workdir, k))
  if budget:
    marks = list(range(0, budget + 1, every))
    md = budget_table(curves, marks, axis)
    base = curves.get("grpo") or next(iter(curves.values()))
    target = _TARGET.value or float(np.mean([c[-1][2] for c in base.values()]))
    md += "\n" + target_row(curves, target, axis)
    cells = [" ".join(f"{w[-1]:.0f}" for w in walls[m]) +
             f" / **{np.mean([w[-1] for w in walls[m]]):.0f}**" for m in results]
    md += "\n| wall s at the end | " + " | ".join(cells) + " |"
  else:
    md = table(results, walls)
    rows = aes_rows(results, lengths)
    if rows:
      md += "\n" + rows
  with open(os.path.join(_OUT.value, "efficiency.md"), "w") as f:
    f.write(md + "\n")
  with open(os.path.join(_OUT.value, "efficiency.json"), "w") as f:
    json.dump({"mean_at_8": results, "wall_s": walls,
               **({"axis": axis, "budget": budget, "curves": curves} if budget else {})}, f)
  title = "Countdown, embedded 1M-parameter Qwen3" + (
      f" ({_PRESETS.value})" if _PRESETS.value else "")
  drew = report_writer.plot_accuracy(workdirs, os.path.join(_OUT.value, "efficiency.png"), title=title)
  print(md)
  print(f"wrote {_OUT.value}/efficiency.md" + (" and efficiency.png" if drew else ""))


def _budget() -> tuple[str, int, int]:
  """(axis, budget, evaluation interval) of the flags: ("rollouts", 0, 0) without a budget.

  Raises:
    app.UsageError: --rollouts with --tokens, a negative budget, or an interval without its
      budget.
  """
  if _ROLLOUTS.value and _TOKENS.value:
    raise app.UsageError("--rollouts and --tokens are exclusive: give one budget per run")
  for name, value in (("rollouts", _ROLLOUTS.value), ("tokens", _TOKENS.value),
                      ("eval_every_rollouts", _EVAL_ROLLOUTS.value),
                      ("eval_every_tokens", _EVAL_TOKENS.value)):
    if value < 0:
      raise app.UsageError(f"--{name} must be >= 0, got {value}")
  if _EVAL_TOKENS.value and not _TOKENS.value:
    raise app.UsageError("--eval_every_tokens needs --tokens")
  if _EVAL_ROLLOUTS.value and not _ROLLOUTS.value:
    raise app.UsageError("--eval_every_rollouts needs --rollouts")
  if _TOKENS.value:
    every = _EVAL_TOKENS.value or max(round(_TOKENS.value / 4), 1)
    return "completion_tokens", _TOKENS.value, every
  if _ROLLOUTS.value:
    return "rollouts", _ROLLOUTS.value, _EVAL_ROLLOUTS.value or _EVAL_EVERY.value * _per_step()
  return "rollouts", 0, 0


def _per_step() -> int:
  c = files.module("grpo").get_config(_PRESETS.value or None)
  return c.rollout.batch_prompts * c.rollout.group_size


def _finished(workdir: str, steps: int, budget: int, axis: str = "rollouts",
              k: int = 8) -> bool:
  """Whether a run folder already holds a finished run of this benchmark: its last evaluation
  is at or past ``budget`` on ``axis`` (with a budget), else at ``steps`` steps or later."""
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")) or not report_writer.curve(workdir, k):
    return False
  last = budget_curve(workdir, k, axis)[-1]
  return last[1] >= budget if budget else last[0] >= steps


if __name__ == "__main__":
  app.run(main)
