"""Plots and a summary table from the metrics of one or several runs.

``python -m grpo_jax.report runs/popo [runs/grpo ...] [--out=DIR]`` (the command line is
``grpo_jax/report.py``) reads each run's ``metrics.jsonl`` and writes, into ``--out`` (default:
``<first run>/report``):

* ``accuracy.png``: held-out mean@k against rollouts generated and against wall-clock time;
* ``training.png``: training success, ineffective-group fraction, learning rate and the replay
  statistics the methods log (replayed rows, Headroom-Drift's acceptance rate), by step;
* ``summary.md``: one row per run (accuracy start -> end, rollouts, tokens, wall time), and
  for runs with named held-out sets (``task.eval_paths``) one row per run and set.

Several runs overlay on the same axes; runs given the same label (``label=dir`` arguments, or
the efficiency benchmark's seeds) are drawn thin with their mean thick.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

from grpo_jax import console
from grpo_jax.run import metrics as metrics_lib


def curve(workdir: str, k: int = 8) -> list[tuple[int, int, float]]:
  """(step, rollouts, mean@k) of every evaluation of a run."""
  key = f"eval/mean_at_{k}"
  return [(r["step"], r["rollouts"], r[key]) for r in metrics_lib.read_metrics(workdir)
          if key in r]


def wall_at_evals(workdir: str, k: int = 8) -> list[float]:
  """Seconds of the run's loop (evaluations included) at each evaluation of ``curve``.

  From the step record logged just before each evaluation: ``wall_s`` when recorded, else
  completion tokens / tokens_per_s (the same clock); 0 at step 0.
  """
  seconds = {0: 0.0}
  for r in metrics_lib.read_metrics(workdir):
    if "tokens_per_s" in r:
      seconds[r["step"]] = float(r.get("wall_s", r["completion_tokens"] /
                                       max(r["tokens_per_s"], 1e-9)))
  return [seconds.get(step, float("nan")) for step, _, _ in curve(workdir, k)]


def lengths_at_evals(workdir: str, k: int = 8) -> list[float]:
  """Held-out mean completion length at each evaluation of ``curve``."""
  key = f"eval/mean_at_{k}"
  return [r["eval/mean_length"] for r in metrics_lib.read_metrics(workdir) if key in r]


def step_series(workdir: str, key: str) -> tuple[list[int], list[float]]:
  """(steps, values) of a per-step metric (records that have it)."""
  rows = [(r["step"], r[key]) for r in metrics_lib.read_metrics(workdir) if key in r]
  return [s for s, _ in rows], [v for _, v in rows]


def run_summary(workdir: str, k: int = 8) -> dict:
  """Start and end of a run from its metrics: accuracy, rollouts, tokens, wall time."""
  records = metrics_lib.read_metrics(workdir)
  evals = [r for r in records if f"eval/mean_at_{k}" in r]
  steps = [r for r in records if "loss" in r]
  out = {"workdir": workdir, "steps": steps[-1]["step"] if steps else 0}
  if evals:
    out.update(start=evals[0][f"eval/mean_at_{k}"], end=evals[-1][f"eval/mean_at_{k}"],
               end_pass=evals[-1].get(f"eval/pass_at_{k}", float("nan")),
               end_greedy=evals[-1].get("eval/greedy_accuracy", float("nan")))
  if steps:
    last = steps[-1]
    wall = last.get("wall_s")
    if wall is None and last.get("tokens_per_s"):
      wall = last["completion_tokens"] / last["tokens_per_s"]  # runs logged before wall_s
    out.update(rollouts=last.get("rollouts", 0), tokens=last.get("completion_tokens", 0),
               wall_s=float(wall if wall is not None else float("nan")))
    means = step_means(steps, ("ineffective_fraction", "learning_rate") + REPLAY_STATS)
    out.update({f"mean_{key}": v for key, v in means.items()})
  return out


def step_means(steps: Sequence[dict], keys: Sequence[str]) -> dict:
  """{key: mean over the step records that have it} for each of ``keys`` some step logged.

  Statistics of the replayed rows (their age, drift, weights) exist only in steps that replayed
  something (``PER_REPLAYED``): averaged over those, not diluted by warm-up or empty-buffer
  steps.
  """
  out = {}
  for key in keys:
    when = PER_REPLAYED.get(key)
    vals = [r[key] for r in steps if key in r and (when is None or r.get(when, 0) > 0)]
    if vals:
      out[key] = float(np.mean(vals))
  return out


# Per-step replay statistics averaged over a run by ``replay_table`` (whichever the method logs).
REPLAY_STATS = ("replay_slots_filled", "replay_slots_unfilled", "replay_rows", "replay_age_mean",
                "replay_age_max", "replay_drift", "replay_is_weight_mean",
                "replay_is_capped_frac", "replay_priority_entropy", "headroom_accept_rate",
                "headroom_admitted", "headroom_candidate_drift", "loss_rows")
# Statistics averaged only over the steps where the named count is > 0.
PER_REPLAYED = {**dict.fromkeys(("replay_age_mean", "replay_age_max", "replay_drift",
                                  "replay_is_weight_mean", "replay_is_capped_frac"),
                                 "replay_rows"),
                 "headroom_accept_rate": "headroom_candidates",
                 "headroom_candidate_drift": "headroom_candidates"}


def replay_table(workdirs: Sequence[str], labels: Sequence[str] | None = None) -> str | None:
  """Markdown: the mean over the steps of every replay statistic a run logged (those of the
  replayed rows over the steps that replayed; ``PER_REPLAYED``); None when no run replays."""
  labels = labels or [os.path.basename(os.path.normpath(w)) for w in workdirs]
  summaries = [run_summary(w) for w in workdirs]
  keys = [key for key in REPLAY_STATS if any(f"mean_{key}" in s for s in summaries)]
  if not keys:
    return None
  lines = ["| run | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
  for label, s in zip(labels, summaries):
    lines.append(f"| {label} | " + " | ".join(
        f"{s[f'mean_{key}']:.4g}" if f"mean_{key}" in s else "" for key in keys) + " |")
  return "\n".join(lines)


def summary_table(workdirs: Sequence[str], labels: Sequence[str] | None = None,
                  k: int = 8) -> str:
  """Markdown: one row per run."""
  labels = labels or [os.path.basename(os.path.normpath(w)) for w in workdirs]
  lines = [f"| run | steps | mean@{k} start → end | pass@{k} | greedy | rollouts | "
           "completion tokens | wall s | ineffective |", "|---|---|---|---|---|---|---|---|---|"]
  for label, w in zip(labels, workdirs):
    s = run_summary(w, k)
    lines.append(
        f"| {label} | {s['steps']} | {s.get('start', float('nan')):.3f} → "
        f"{s.get('end', float('nan')):.3f} | {s.get('end_pass', float('nan')):.3f} | "
        f"{s.get('end_greedy', float('nan')):.3f} | {s.get('rollouts', 0):,} | "
        f"{s.get('tokens', 0):,} | {s.get('wall_s', float('nan')):.0f} | "
        f"{s.get('mean_ineffective_fraction', float('nan')):.2f} |")
  return "\n".join(lines)


def _pyplot():
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    return plt
  except ImportError:
    return None


def plot_accuracy(groups: dict[str, list[str]], path: str, k: int = 8,
                  title: str = "held-out accuracy") -> bool:
  """mean@k against rollouts (left) and wall seconds (right); each label's runs thin, their
  mean thick. Returns False when matplotlib is not installed."""
  plt = _pyplot()
  if plt is None:
    return False
  fig, (ax, ax_t) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for i, (label, runs) in enumerate(groups.items()):
    color = f"C{i % 10}"
    curves = [curve(w, k) for w in runs]
    walls = [wall_at_evals(w, k) for w in runs]
    for c, wt in zip(curves, walls):
      ax.plot([r for _, r, _ in c], [a for _, _, a in c], color=color, alpha=0.3, lw=1)
      ax_t.plot(wt, [a for _, _, a in c], color=color, alpha=0.3, lw=1)
    n = min(len(c) for c in curves)
    acc = np.mean([[a for _, _, a in c[:n]] for c in curves], axis=0)
    name = f"{label} (mean of {len(runs)})" if len(runs) > 1 else label
    ax.plot([r for _, r, _ in curves[0][:n]], acc, color=color, lw=2.5, label=name)
    ax_t.plot(np.mean([w[:n] for w in walls], axis=0), acc, color=color, lw=2.5, label=name)
  ax.set_xlabel("rollouts generated")
  ax_t.set_xlabel("wall-clock seconds (evaluations included)")
  ax.set_ylabel(f"held-out mean@{k}")
  fig.suptitle(title)
  for a in (ax, ax_t):
    a.grid(alpha=0.3)
  ax.legend(fontsize=8)
  # Fixed margins, not tight_layout: its extra layout pass was 40% of a plot's time (0.23 s
  # to 0.13 s a figure), and every run writes two.
  fig.subplots_adjust(left=0.06, right=0.99, bottom=0.13, top=0.89, wspace=0.05)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


_TRAINING_PANELS = (("success_mean", "training success"),
                    ("ineffective_fraction", "ineffective-group fraction"),
                    ("learning_rate", "learning rate"),
                    (("replay_rows", "headroom_accept_rate"), "replay: rows / acceptance"))


def plot_training(groups: dict[str, list[str]], path: str) -> bool:
  """Per-step training statistics of every run, one panel each."""
  plt = _pyplot()
  if plt is None:
    return False
  fig, axes = plt.subplots(2, 2, figsize=(11, 7))
  for ax, (keys, title) in zip(axes.ravel(), _TRAINING_PANELS):
    keys = keys if isinstance(keys, tuple) else (keys,)
    for i, (label, runs) in enumerate(groups.items()):
      for j, w in enumerate(runs):
        for key, style in zip(keys, ("-", "--")):
          steps, vals = step_series(w, key)
          if steps:
            ax.plot(steps, vals, style, color=f"C{i % 10}", lw=1,
                    label=f"{label} {key}" if j == 0 and len(keys) > 1 else
                    (label if j == 0 else None))
    ax.set_title(title)
    ax.set_xlabel("train step")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
  fig.subplots_adjust(left=0.07, right=0.99, bottom=0.08, top=0.95, hspace=0.38, wspace=0.18)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def _legend_entries(axes, series: Sequence[str]) -> tuple[list, list]:
  """One legend entry per series drawn in any panel, in the series' order: a series with no
  value in the first panel (GRPO has no replay drift) is still named."""
  found = {}
  for ax in np.ravel(axes):
    for handle, label in zip(*ax.get_legend_handles_labels()):
      found.setdefault(label, handle)
  names = [name for name in series if name in found]
  return [found[name] for name in names], names


def plot_grid(points: Sequence[dict], path: str, ys: Sequence[str], xlabel: str = "",
              xlog: bool = False, title: str = "",
              xticks: dict[str, Sequence[tuple[float, str]]] | None = None) -> bool:
  """A sweep's summary as small multiples: one row of panels per metric in ``ys``, one column
  per distinct ``point["panel"]``, one line per ``point["series"]`` (a method) through its
  points ordered by ``point["x"]``, with error bars ``point[f"{y} std"]`` where given.

  Args:
    points: one dict per (panel, series, x): "x", "series", "panel" and the metrics.
    path: the PNG to write.
    ys: the metrics to draw, a row each; a metric no point has (all NaN) is left empty.
    xlabel, xlog, title: the x axis's label and scale, the figure's title.
    xticks: {panel: [(x, label), ...]}: each panel's own ticks (its x axis then not shared
      with the others), e.g. a method's knob values drawn at positions 0, 1, 2.

  Returns:
    False when matplotlib is not installed (nothing written), else True.
  """
  plt = _pyplot()
  if plt is None:
    return False
  panels = list(dict.fromkeys(p["panel"] for p in points))
  series = list(dict.fromkeys(p["series"] for p in points))
  legend_in = 1.8  # the legend's column to the right of the panels, in inches
  width = 3.6 * len(panels) + legend_in
  fig, axes = plt.subplots(len(ys), len(panels), figsize=(width, 2.6 * len(ys)),
                           squeeze=False, sharex=xticks is None, sharey="row")
  xs_all = sorted({p["x"] for p in points if not np.isnan(p["x"])})
  for row, y in enumerate(ys):
    for col, panel in enumerate(panels):
      ax = axes[row][col]
      for i, name in enumerate(series):
        mine = sorted((p for p in points if p["panel"] == panel and p["series"] == name),
                      key=lambda p: p["x"])
        xs = [p["x"] for p in mine]
        vals = [p.get(y, float("nan")) for p in mine]
        if not mine or all(np.isnan(vals)):
          continue
        err = [p.get(f"{y} std", 0.0) for p in mine]
        # past ten series the colours repeat: a dashed line and another marker tell them apart
        ax.errorbar(xs, vals, yerr=np.nan_to_num(err), color=f"C{i % 10}",
                    ls="-" if i < 10 else "--", marker="o" if i < 10 else "s", ms=3,
                    lw=1.5, capsize=2, label=name)
      if xlog and len(xs_all) > 1:  # a log axis of one value has no width
        ax.set_xscale("log")
        # ticks at the grid's values only, written plainly: the log axis's own minor labels
        # (3e-5, 4e-5, 6e-5 as powers of ten) overlap at this width
        ax.set_xticks(xs_all, [f"{v:g}" for v in xs_all], fontsize=7)
        ax.xaxis.set_minor_formatter(plt.NullFormatter())
      if xticks and panel in xticks:
        ticks = list(xticks[panel])
        ax.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], fontsize=7)
        ax.set_xlim(min(t[0] for t in ticks) - 0.5, max(t[0] for t in ticks) + 0.5)
      ax.grid(alpha=0.3)
      if row == 0 and panel:
        ax.set_title(panel, fontsize=9)
      if col == 0:
        ax.set_ylabel(y, fontsize=8)
      if row == len(ys) - 1:
        ax.set_xlabel(xlabel, fontsize=8)
  handles, labels = _legend_entries(axes, series)
  if handles:
    fig.legend(handles, labels, loc="center right", fontsize=7)
  fig.suptitle(title)
  fig.tight_layout(rect=(0, 0, 1 - legend_in / width, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def sets_table(workdirs: Sequence[str], labels: Sequence[str] | None = None,
               k: int = 8) -> str | None:
  """Markdown: one row per run and named held-out set (mean@k start -> end, pass@k, greedy,
  mean length at the end); None when no run has named sets."""
  labels = labels or [os.path.basename(os.path.normpath(w)) for w in workdirs]
  lines = []
  for label, w in zip(labels, workdirs):
    evals = [r for r in metrics_lib.read_metrics(w) if f"eval/mean_at_{k}" in r]
    for name in console.eval_set_names(evals[-1], k) if evals else []:
      key = lambda m, name=name: f"eval/{name}/{m}"
      first = next((r for r in evals if key(f"mean_at_{k}") in r), evals[-1])
      end = evals[-1]
      lines.append(f"| {label} | {name} | {first[key(f'mean_at_{k}')]:.3f} → "
                   f"{end[key(f'mean_at_{k}')]:.3f} | {end[key(f'pass_at_{k}')]:.3f} | "
                   f"{end.get(key('greedy_accuracy'), float('nan')):.3f} | "
                   f"{end[key('mean_length')]:.1f} |")
  if not lines:
    return None
  return "\n".join([f"| run | held-out set | mean@{k} start → end | pass@{k} | greedy | "
                    "mean length |", "|---|---|---|---|---|---|"] + lines)


def write_report(workdirs: Sequence[str], out: str, labels: Sequence[str] | None = None,
                 k: int = 8) -> list[str]:
  """Writes summary.md (always) and the PNGs (when matplotlib is installed); returns paths."""
  os.makedirs(out, exist_ok=True)
  labels = list(labels or [os.path.basename(os.path.normpath(w)) for w in workdirs])
  groups: dict[str, list[str]] = {}
  for label, w in zip(labels, workdirs):
    groups.setdefault(label, []).append(w)
  written = [os.path.join(out, "summary.md")]
  with open(written[0], "w", encoding="utf-8") as f:
    f.write(summary_table(workdirs, labels, k) + "\n")
    sets = sets_table(workdirs, labels, k)
    if sets:
      f.write("\nHeld-out sets:\n\n" + sets + "\n")
    replay = replay_table(workdirs, labels)
    if replay:
      f.write("\nReplay statistics (means over steps):\n\n" + replay + "\n")
  if plot_accuracy(groups, os.path.join(out, "accuracy.png"), k):
    written.append(os.path.join(out, "accuracy.png"))
  if plot_training(groups, os.path.join(out, "training.png")):
    written.append(os.path.join(out, "training.png"))
  return written
