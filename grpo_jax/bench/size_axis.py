"""The regime map's size axis: each method's gain over the baseline at several model sizes, and
whether the gain moves with size.

    python -m grpo_jax.bench.size_axis --out=docs/results/regime/size \
        --sizes=1M=docs/results/regime/difficulty,3.4M=docs/results/regime/difficulty_x4

The claim under test is the rollout-replay paper's (Yoo et al., arXiv 2606.04560): the replay
gain over GRPO grows with model size (+4.35 points at 4B, less at the smaller scales). Each
size is a sweep folder (``grpo_jax.bench.sweep`` writes its ``summary.json``) over the same
settings and seeds, the smallest size first.

For a method, a setting and two sizes (every pair), each seed ``s`` present in all four runs
(the method and the baseline at both sizes) gives one difference of gains,

    d_s = (method_large[s] - baseline_large[s]) - (method_small[s] - baseline_small[s]),

in points of final mean@k at equal generated rollouts. The row reports the mean of ``d_s``, its
standard error (sample std over sqrt(n)), the two-sided paired t-test p-value (n - 1 degrees
of freedom) and ``resolved`` (p < 0.05). ``resolvable`` is the smallest |mean d| these seeds
call resolved at this spread, t(0.975, n - 1) SE; ``detectable`` the difference they would
resolve with 80% power, (t(0.975, n - 1) + t(0.8, n - 1)) SE. The "all settings" row pools
every (setting, seed) pair of the method (each a separate pair of runs).

Writes ``<out>/size.md`` and, with matplotlib, ``<out>/size.png``.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

from absl import app, flags
import numpy as np

from grpo_jax.bench import regime_map
from grpo_jax.run import report_writer

ALL = "all settings"


def define_flags():
  """The CLI flags; defined only when run as a program, so tests can import this module."""
  flags.DEFINE_list("sizes", [], "LABEL=FOLDER pairs, smallest model first, each folder a "
                    "sweep's output with its summary.json")
  flags.DEFINE_string("out", "docs/results/regime/size", "folder for size.md and size.png")
  flags.DEFINE_string("baseline", "grpo", "the sweeps' baseline")


def parse_sizes(specs: Sequence[str]) -> list[tuple[str, str]]:
  """``["1M=a", "3.4M=b"]`` -> ``[("1M", "a"), ("3.4M", "b")]``.

  Raises:
    ValueError: a spec without ``=``, a repeated label, or fewer than two sizes.
  """
  out = []
  for spec in specs:
    label, sep, folder = spec.partition("=")
    if not sep or not label or not folder:
      raise ValueError(f"--sizes: {spec!r} is not LABEL=FOLDER")
    out.append((label, folder))
  labels = [label for label, _ in out]
  if len(set(labels)) != len(labels):
    raise ValueError(f"--sizes: a label named twice in {labels}")
  if len(out) < 2:
    raise ValueError("--sizes: two or more sizes (LABEL=FOLDER,LABEL=FOLDER)")
  return out


def finals(folder: str) -> dict[tuple[str, str], dict[int, float]]:
  """``{(method, setting label): {seed: final mean@k}}`` from a sweep folder's summary.json.

  Raises:
    FileNotFoundError: no summary.json (with the command that writes it).
  """
  return {(s["method"], regime_map.setting_label(s["setting_values"])):
          dict(zip(s["seeds"], s["final"])) for s in regime_map.read_summaries(folder)}


def _gains(runs: dict, method: str, setting: str, baseline: str) -> dict[int, float]:
  """Per seed, the method's final minus the baseline's (seeds both ran)."""
  mine, base = runs.get((method, setting), {}), runs.get((baseline, setting), {})
  return {s: mine[s] - base[s] for s in mine if s in base}


def difference(pairs: Sequence[float]) -> dict:
  """The mean of paired differences ``pairs`` with its SE, p, and what n pairs can resolve.

  With fewer than two pairs the spread is unknown: SE, p and the thresholds are NaN and the
  difference is never resolved.
  """
  from scipy import stats  # pylint: disable=g-import-not-at-top
  n = len(pairs)
  mean = float(np.mean(pairs)) if n else float("nan")
  if n < 2:
    nan = float("nan")
    return dict(n=n, diff=mean, diff_se=nan, p=nan, resolved=False, resolvable=nan,
                detectable=nan)
  se = float(np.std(pairs, ddof=1) / math.sqrt(n))
  if se == 0.0:
    p = 1.0 if mean == 0.0 else 0.0
  else:
    p = float(2.0 * stats.t.sf(abs(mean) / se, n - 1))
  t_alpha, t_power = stats.t.ppf(0.975, n - 1), stats.t.ppf(0.8, n - 1)
  return dict(n=n, diff=mean, diff_se=se, p=p, resolved=bool(p < 0.05),
              resolvable=float(t_alpha * se), detectable=float((t_alpha + t_power) * se))


def compare(sizes: Sequence[tuple[str, dict]], baseline: str = "grpo") -> list[dict]:
  """One row per (method, setting, pair of sizes): the gains at both and their difference.

  Args:
    sizes: ``[(label, finals(folder)), ...]``, the smallest model first; every pair of them
      is compared (with three sizes: 1-2, 1-3, 2-3), the smaller as ``small``.
    baseline: the method the gains are measured against.

  Returns:
    Rows with ``method``, ``setting`` (or ``ALL``), ``small``/``large`` (size labels),
    ``gain_small``/``gain_large`` (mean over the paired seeds), ``base_small``/``base_large``
    (the baseline's mean final over them), ``seeds`` and ``difference``'s keys. Methods and
    settings in the smallest size's order; a (method, setting) missing at a size is left out
    of that size's pairs.
  """
  methods = list(dict.fromkeys(m for m, _ in sizes[0][1] if m != baseline))
  settings = list(dict.fromkeys(s for _, s in sizes[0][1]))
  rows = []
  pairs = [(a, b) for i, a in enumerate(sizes) for b in sizes[i + 1:]]
  for (small, first), (large, runs) in pairs:
    for method in methods:
      pooled = {k: [] for k in ("d", "gs", "gl", "bs", "bl")}
      for setting in settings + [ALL]:
        if setting == ALL:
          if len({r["setting"] for r in rows if r["method"] == method
                  and (r["small"], r["large"]) == (small, large)}) < 2:
            continue  # one setting: the pooled row would repeat it
          seeds, parts = None, pooled
        else:
          gs = _gains(first, method, setting, baseline)
          gl = _gains(runs, method, setting, baseline)
          seeds = sorted(s for s in gs if s in gl)
          if not seeds:
            continue
          parts = {"d": [gl[s] - gs[s] for s in seeds], "gs": [gs[s] for s in seeds],
                   "gl": [gl[s] for s in seeds],
                   "bs": [first[(baseline, setting)][s] for s in seeds],
                   "bl": [runs[(baseline, setting)][s] for s in seeds]}
          for k, v in parts.items():
            pooled[k].extend(v)
        rows.append(dict(
            method=method, setting=setting, small=small, large=large, seeds=seeds,
            gain_small=float(np.mean(parts["gs"])), gain_large=float(np.mean(parts["gl"])),
            base_small=float(np.mean(parts["bs"])), base_large=float(np.mean(parts["bl"])),
            **difference(parts["d"])))
  return rows


def table(rows: Sequence[dict], baseline: str = "grpo") -> str:
  """Markdown: per method and setting, the baseline's accuracy and the gain at each size, the
  difference of gains (bold when resolved) with its p and what these seeds could resolve."""
  head = (f"| method | setting | {baseline} (small → large) | gain small | gain large | "
          "difference of gains | p | n | resolvable | detectable (80%) |")
  lines = [head, "|---" * 10 + "|"]
  for r in rows:
    diff = f"{100 * r['diff']:+.1f} ± {_points(r['diff_se'])}"
    p = "—" if math.isnan(r["p"]) else f"{r['p']:.3f}"
    lines.append(
        f"| {r['method']} | {r['setting']} ({r['small']} → {r['large']}) | "
        f"{r['base_small']:.3f} → {r['base_large']:.3f} | {100 * r['gain_small']:+.1f} | "
        f"{100 * r['gain_large']:+.1f} | {f'**{diff}**' if r['resolved'] else diff} | "
        f"{p} | {r['n']} | "
        f"{_points(r['resolvable'])} | {_points(r['detectable'])} |")
  return ("Points of final mean@k at equal generated rollouts; difference of gains = gain at "
          "the larger size − gain at the smaller, paired by seed; resolvable: the smallest "
          "|difference| these seeds call resolved (p < 0.05) at this spread; detectable: the "
          "difference they resolve with 80% power.\n\n" + "\n".join(lines) + "\n")


def _points(x: float) -> str:
  """A fraction as points with one decimal; a dash where it is unknown (one pair)."""
  return "—" if math.isnan(x) else f"{100 * x:.1f}"


def plot(sizes: Sequence[tuple[str, dict]], path: str, baseline: str = "grpo") -> bool:
  """size.png: one panel per setting, the gain over the baseline (points, mean ± SE over the
  seeds every size ran) against model size, a line per method run at two sizes or more.
  False when matplotlib is not installed."""
  plt = report_writer._pyplot()  # pylint: disable=protected-access
  if plt is None:
    return False
  first = sizes[0][1]
  # the methods run at two sizes or more
  methods = [m for m in dict.fromkeys(m for m, _ in first if m != baseline)
             if sum(any(k[0] == m for k in runs) for _, runs in sizes) > 1]
  settings = list(dict.fromkeys(s for _, s in first))
  fig, axes = plt.subplots(1, len(settings), figsize=(3.2 * len(settings), 3.0),
                           sharey=True, squeeze=False)
  for ax, setting in zip(axes[0], settings):
    for j, method in enumerate(methods):
      gains = [_gains(runs, method, setting, baseline) for _, runs in sizes]
      # the seeds every size ran, so a line's rise is the table's difference of gains
      ran = [g for g in gains if g]
      seeds = set.intersection(*map(set, ran)) if ran else set()
      xs, ys, es = [], [], []
      for i, g in enumerate(gains):
        if g and seeds:
          v = [g[s] for s in sorted(seeds)]
          xs.append(i + 0.04 * (j - (len(methods) - 1) / 2))  # side by side, not on top
          ys.append(100 * np.mean(v))
          es.append(100 * np.std(v, ddof=1) / math.sqrt(len(v)) if len(v) > 1 else 0.0)
      ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, label=method)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(sizes)), [label for label, _ in sizes])
    ax.set_title(setting, fontsize=9)
    ax.set_xlabel("model size (parameters)", fontsize=8)
  axes[0][0].set_ylabel(f"gain over {baseline}, points of mean@k", fontsize=8)
  axes[0][-1].legend(fontsize=7)
  fig.suptitle(f"the size axis: gain over {baseline} at equal generated rollouts", fontsize=9)
  fig.savefig(path, dpi=130, bbox_inches="tight")
  plt.close(fig)
  return True


def write(specs: Sequence[tuple[str, str]], out: str, baseline: str = "grpo") -> list[str]:
  """Writes size.md (and size.png with matplotlib) for ``[(label, folder), ...]``; the paths."""
  sizes = [(label, finals(folder)) for label, folder in specs]
  os.makedirs(out, exist_ok=True)
  paths = [os.path.join(out, "size.md")]
  sources = ", ".join(f"{label}: `{folder}`" for label, folder in specs)
  with open(paths[0], "w") as f:
    f.write(f"# The size axis\n\n({sources})\n\n" + table(compare(sizes, baseline), baseline))
  if plot(sizes, os.path.join(out, "size.png"), baseline):
    paths.append(os.path.join(out, "size.png"))
  return paths


def main(argv):
  del argv
  f = flags.FLAGS
  try:
    paths = write(parse_sizes(f.sizes), f.out, f.baseline)
  except (ValueError, FileNotFoundError) as e:
    print(f"grpo_jax.bench.size_axis: {e}")
    return 1
  print("\n".join(paths))
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
