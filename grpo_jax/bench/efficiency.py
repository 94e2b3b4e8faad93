"""Sample efficiency: held-out accuracy against rollouts generated, per method and seed.

    python -m grpo_jax.bench.efficiency --methods=grpo,popo --seeds=3 --steps=100
    python -m grpo_jax.bench.efficiency --methods=grpo,popo,popo:filter,popo:pi_old --seeds=3

Every method trains from the embedded checkpoint with its config file (configs/<method>.py,
optionally with presets after a colon: ``popo:filter``, ``popo:stale=10``) and the same batch
(B prompts x G rollouts per step), so equal steps mean equal rollouts.
Writes ``<out>/efficiency.md`` (a markdown table of mean@8 by rollouts, per seed, with the
mean and spread) and ``<out>/efficiency.png`` (needs matplotlib), and prints the table.
"""

from __future__ import annotations

import importlib
import json
import os

import numpy as np
from absl import app, flags

from grpo_jax import evaluate as evaluate_lib
from grpo_jax import report
from grpo_jax import train

_METHODS = flags.DEFINE_list("methods", ["grpo", "popo"],
                             "config files under configs/, with optional presets: popo:filter")
_PRESETS = flags.DEFINE_string("presets", "", "presets added to every method's config, "
                               "e.g. countdown_hard")
_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds 0..n-1 per method")
_STEPS = flags.DEFINE_integer("steps", 100, "optimiser steps per run")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "steps between evaluations")
_OUT = flags.DEFINE_string("out", "runs/efficiency", "output folder")


def run_name(method: str) -> str:
  """A folder name for a method with presets: "popo:stale=10" -> "popo-stale10"."""
  return method.replace(":", "-").replace(",", "-").replace("=", "")


def aes_row(results: dict, lengths: dict, base: str = "grpo") -> str | None:
  """Markdown row: AES of every seed's final evaluation against the base method's seed mean
  at the same step (so at the same rollout count), mean +- std over seeds."""
  if base not in results:
    return None
  base_acc = np.mean([c[-1][2] for c in results[base].values()])
  base_len = np.mean([ls[-1] for ls in lengths[base]])
  cells = []
  for m in results:
    vals = [evaluate_lib.aes(c[-1][2], ls[-1], base_acc, base_len)
            for c, ls in zip(results[m].values(), lengths[m])]
    cells.append(" ".join(f"{v:+.3f}" for v in vals) +
                 f" / **{np.mean(vals):+.3f}** ± {np.std(vals):.3f}")
  return f"| AES vs {base} (end) | | " + " | ".join(cells) + " |"


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
  os.makedirs(_OUT.value, exist_ok=True)
  results, walls, lengths, workdirs = {}, {}, {}, {}
  for method in _METHODS.value:
    name, _, presets = method.partition(":")
    module = importlib.import_module(f"configs.{name}")
    results[method] = {}
    for seed in range(_SEEDS.value):
      config = module.get_config(",".join(filter(None, [presets, _PRESETS.value])) or None)
      config.seed = seed
      config.total_steps = _STEPS.value
      config.eval.every = _EVAL_EVERY.value
      config.checkpoint.every = _STEPS.value
      # --presets are part of the name: a run of another task is never taken for this one.
      suffix = f"-{run_name(_PRESETS.value)}" if _PRESETS.value else ""
      workdir = os.path.join(_OUT.value, f"{run_name(method)}{suffix}_seed{seed}")
      if not os.path.exists(os.path.join(workdir, "metrics.jsonl")) or \
          not report.curve(workdir) or report.curve(workdir)[-1][0] < _STEPS.value:
        train.train_and_evaluate(config, workdir)
      results[method][seed] = report.curve(workdir)
      workdirs.setdefault(method, []).append(workdir)
      walls.setdefault(method, []).append(report.wall_at_evals(workdir))
      lengths.setdefault(method, []).append(report.lengths_at_evals(workdir))
  md = table(results, walls)
  row = aes_row(results, lengths)
  if row:
    md += "\n" + row
  with open(os.path.join(_OUT.value, "efficiency.md"), "w") as f:
    f.write(md + "\n")
  with open(os.path.join(_OUT.value, "efficiency.json"), "w") as f:
    json.dump({"mean_at_8": results, "wall_s": walls}, f)
  title = "Countdown, embedded 1M-parameter Qwen3" + (
      f" ({_PRESETS.value})" if _PRESETS.value else "")
  drew = report.plot_accuracy(workdirs, os.path.join(_OUT.value, "efficiency.png"), title=title)
  print(md)
  print(f"wrote {_OUT.value}/efficiency.md" + (" and efficiency.png" if drew else ""))


if __name__ == "__main__":
  app.run(main)
