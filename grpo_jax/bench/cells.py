"""A sweep cell's record from its run's metrics, and the sweep's tidy table and summary.

The record (``<out>/cells/<cell id>.json``) is what a sweep keeps of a run: every held-out
evaluation (step, rollouts and completion tokens generated, mean@k with its standard error over
prompts, pass@k, greedy accuracy, length, constant and truncated fractions), the mechanism
metrics of its training steps, and its cost (wall and CPU seconds, the median step time).
Summaries compare the methods of one setting at equal generated rollouts (the budget's end)
and at equal generated completion tokens (the most every run of the setting reached), paired
by seed against the baseline.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from grpo_jax.bench import curves
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.run import report_writer

# Per-step metrics averaged over a run (those of replayed rows over the steps that replayed,
# report_writer.PER_REPLAYED): what says how far off-policy a method trained and what it did to the
# policy (clipping, length, truncation: runaway length is the symptom of uncorrected stale data).
MECHANISM = ("ineffective_fraction", "effective_fraction", "completion_length_mean",
             "truncated_fraction", "clip_frac_low", "clip_frac_high", "drift", "is_weight_mean",
             "is_capped_frac", "approx_kl_behaviour", "grad_norm", "loss_rows",
             "alloc/effective_per_1k_rollouts") + report_writer.REPLAY_STATS
# Also averaged over the last tenth of the steps: where a run ends up, not where it went.
AT_END = ("completion_length_mean", "truncated_fraction", "clip_frac_low", "clip_frac_high")


def record(workdir: str, k: int) -> dict[str, Any]:
  """The evaluations, mechanism means and step times of a finished run's ``metrics.jsonl``.

  Returns:
    {"evals": [{step, rollouts, completion_tokens, mean_at_k, mean_at_k_se, pass_at_k,
    greedy_accuracy, mean_length, constant_fraction, truncated_fraction}, ...],
    "train": {key: mean, "end_<key>": mean over the last tenth}, "steps": n,
    "loop_wall_s", "step_s_median", "generation_s_median", "update_s_median"}.
  """
  rows = metrics_lib.read_metrics(workdir)
  steps = [r for r in rows if "loss" in r]
  evals = []
  # Each evaluation's tokens: the step record just before it (curves.token_curve).
  for r, (_, tokens, _) in zip((r for r in rows if f"eval/mean_at_{k}" in r),
                               curves.token_curve(workdir, k)):
    e = {"step": r["step"], "rollouts": r["rollouts"], "completion_tokens": tokens,
         "mean_at_k": r[f"eval/mean_at_{k}"],
         "mean_at_k_se": r.get(f"eval/mean_at_{k}_se", float("nan"))}
    for key, name in (("pass_at_k", f"pass_at_{k}"), ("greedy_accuracy",) * 2,
                      ("mean_length",) * 2, ("constant_fraction",) * 2,
                      ("truncated_fraction",) * 2):
      e[key] = r.get(f"eval/{name}", float("nan"))
    evals.append(e)
  train = report_writer.step_means(steps, MECHANISM)
  tail = steps[-max(1, len(steps) // 10):]
  for key in AT_END:
    vals = [r[key] for r in tail if key in r]
    if vals:
      train[f"end_{key}"] = float(np.mean(vals))

  def median(key):  # the first step compiles: left out
    vals = [r[key] for r in steps[1:] if key in r]
    return float(np.median(vals)) if vals else float("nan")

  return {"evals": evals, "train": train, "steps": len(steps),
          "loop_wall_s": float(steps[-1]["wall_s"]) if steps else float("nan"),
          "step_s_median": median("time/step_s"),
          "generation_s_median": median("time/generation_s"),
          "update_s_median": median("time/update_s")}


def tidy_rows(records: Sequence[dict], axes: Sequence[str]) -> list[dict]:
  """One row per (cell, evaluation): the cell's grid values, the evaluation, and the cell's
  cost and mechanism means (repeated on each of its rows, as a tidy table does)."""
  out = []
  for rec in records:
    cell = {"grid": rec["grid"], "cell": rec["id"], "method": rec["method"],
            "spec": rec["spec"], **{a: rec["setting"].get(a) for a in axes},
            "seed": rec["seed"], "config_hash": rec["config_hash"]}
    cost = {key: rec.get(key) for key in ("wall_s", "cpu_s", "other_cpu_s", "contended",
                                          "loop_wall_s", "step_s_median")}
    train = {f"train/{key}": v for key, v in rec["train"].items()}
    for i, e in enumerate(rec["evals"]):
      out.append({**cell, "evaluation": i, **e, "final": i == len(rec["evals"]) - 1, **cost,
                  **train})
  return out


def interpolate(curve: Sequence[tuple[float, float]], x: float) -> float:
  """The curve's y at x, linear between the evaluations around it ((x, y) pairs, x rising);
  NaN outside the curve."""
  xs = [p[0] for p in curve]
  if not curve or x < xs[0] or x > xs[-1]:
    return float("nan")
  return float(np.interp(x, xs, [p[1] for p in curve]))


def summarise(records: Sequence[dict], baseline: str,
              targets: Sequence[str] = ()) -> list[dict]:
  """One summary per (setting, method): the seeds' final mean@k, the gain over ``baseline`` at
  equal rollouts and at equal tokens (paired by seed), rollouts to the baseline's final
  accuracy, mechanism and cost means.

  ``targets``: more methods whose final accuracy every method's rollouts are measured to
  (``rollouts_to[m]``: the mean over the seeds that reached it, how many did, and that mean as
  a share of the rollouts ``m`` itself generated), e.g. "POPO reaches DAPO's accuracy with
  30% of DAPO's rollouts".

  Gains: each seed's difference to the baseline's run of the same setting and seed.
  ``gain_se`` is the standard error of the mean gain: the paired seeds' sample std over
  sqrt(n) with two or more seeds; with one seed the two evaluations' standard errors combined,
  sqrt(se_a^2 + se_b^2) (evaluation noise only: it leaves out how much two runs of one method
  differ, which at high learning rates is larger). ``gain_p`` is the two-sided paired t-test's
  p-value over the seeds (n - 1 degrees of freedom; NaN with one seed) and ``resolved`` is
  ``gain_p < 0.05``: |gain| above t(0.975, n - 1) gain_se, i.e. 12.7, 4.30, 3.18 and 2.78 SEs
  with 2, 3, 4 and 5 seeds, not a flat 2 (with 3 seeds a false-alarm rate of
  1 - 2 / sqrt(6) = 18%). One seed never resolves a gain.
  At equal tokens every run of the setting is read at the most completion tokens all of them
  reached (``tokens_common``), interpolated between its evaluations.
  """
  by_setting: dict[str, dict[str, dict[int, dict]]] = {}
  for rec in records:
    by_setting.setdefault(rec["setting_key"], {}).setdefault(rec["method"], {})[rec["seed"]] = rec
  out = []
  for setting, methods in by_setting.items():
    runs = [r for seeds in methods.values() for r in seeds.values()]
    common = min(r["evals"][-1]["completion_tokens"] for r in runs)
    at_tokens = lambda r: interpolate(
        [(e["completion_tokens"], e["mean_at_k"]) for e in r["evals"]], common)
    base = methods.get(baseline, {})
    final_of = lambda m: float(np.mean([r["evals"][-1]["mean_at_k"]
                                        for r in methods[m].values()]))
    target = final_of(baseline) if base else float("nan")
    # each target method's final accuracy and the rollouts it generated, once per setting
    goals = {m: (final_of(m), float(np.mean([r["evals"][-1]["rollouts"]
                                             for r in methods[m].values()])))
             for m in targets if m in methods}
    for method, seeds in methods.items():
      final = {s: r["evals"][-1]["mean_at_k"] for s, r in seeds.items()}
      se = {s: r["evals"][-1]["mean_at_k_se"] for s, r in seeds.items()}
      paired = [s for s in seeds if s in base]
      gains = [final[s] - base[s]["evals"][-1]["mean_at_k"] for s in paired]
      gains_tok = [at_tokens(seeds[s]) - at_tokens(base[s]) for s in paired]
      if len(paired) > 1:
        gain_se = float(np.std(gains, ddof=1) / math.sqrt(len(paired)))
      elif paired:
        s = paired[0]
        gain_se = math.sqrt(se[s] ** 2 + base[s]["evals"][-1]["mean_at_k_se"] ** 2)
      else:
        gain_se = float("nan")
      reached = _rollouts_to(seeds.values(), target)
      to = {}
      for m, (goal, spent) in goals.items():
        hit = _rollouts_to(seeds.values(), goal)
        mean = float(np.mean(hit)) if hit else float("nan")
        to[m] = {"rollouts": mean, "reached": f"{len(hit)}/{len(seeds)}", "share": mean / spent}
      first = next(iter(seeds.values()))
      summary = {
          "setting": setting, "setting_values": first["setting"], "method": method,
          "seeds": sorted(seeds), "final": [final[s] for s in sorted(seeds)],
          "mean": float(np.mean(list(final.values()))),
          "std": float(np.std(list(final.values()))),  # population std, as the other tables
          "eval_se": float(np.mean(list(se.values()))),
          "rollouts": float(np.mean([r["evals"][-1]["rollouts"] for r in seeds.values()])),
          "gain": float(np.mean(gains)) if gains else float("nan"), "gain_se": gain_se,
          "gain_tokens": float(np.mean(gains_tok)) if gains_tok else float("nan"),
          "tokens_common": common,
          "rollouts_to_baseline": float(np.mean(reached)) if reached else float("nan"),
          "reached": f"{len(reached)}/{len(seeds)}", "rollouts_to": to,
          "wall_s": float(np.mean([r["wall_s"] for r in seeds.values()])),
          "contended": any(r.get("contended", False) for r in seeds.values()),
          "step_s_median": float(np.mean([r["step_s_median"] for r in seeds.values()])),
      }
      summary["gain_p"] = _paired_p(summary["gain"], gain_se, len(gains))
      summary["resolved"] = bool(summary["gain_p"] < 0.05)
      keys = {key for r in seeds.values() for key in r["train"]}
      for key in sorted(keys):
        vals = [r["train"][key] for r in seeds.values() if key in r["train"]]
        summary[f"train/{key}"] = float(np.mean(vals))
      out.append(summary)
  return out


def _rollouts_to(runs, target: float) -> list[float]:
  """Each run's rollouts at ``target`` accuracy (interpolated), for the runs that reach it."""
  hits = [curves.to_target([(e["step"], e["rollouts"], e["mean_at_k"]) for e in r["evals"]],
                           target) for r in runs]
  return [x for x in hits if x is not None]


def _paired_p(mean: float, se: float, n: int) -> float:
  """Two-sided p-value of a paired t-test: mean difference ``mean`` with standard error ``se``
  over ``n`` pairs (Student's t, n - 1 degrees of freedom); NaN below two pairs."""
  if n < 2 or math.isnan(mean):
    return float("nan")
  if se == 0.0:
    return 1.0 if mean == 0.0 else 0.0
  from scipy import stats  # pylint: disable=g-import-not-at-top
  return float(2.0 * stats.t.sf(abs(mean) / se, n - 1))


# The summary table's mechanism columns: (summary key, header, format).
_COLUMNS = (("train/replay_drift", "drift", ".4f"), ("train/replay_is_weight_mean", "weight",
                                                      ".3f"),
            ("train/replay_rows", "replayed rows", ".0f"),
            ("train/clip_frac_high", "clipped hi", ".4f"),
            ("train/end_completion_length_mean", "length (end)", ".2f"),
            ("train/end_truncated_fraction", "truncated (end)", ".3f"),
            ("train/ineffective_fraction", "ineffective", ".3f"))


def summary_markdown(summaries: Sequence[dict], baseline: str, k: int,
                     targets: Sequence[str] = ()) -> str:
  """Markdown: one row per (setting, method), settings in grid order, the baseline first;
  a "rollouts to m's final" column per ``targets`` method (with the share of m's own)."""
  head = (f"| setting | method | mean@{k}: seeds / mean ± std | eval SE | gain vs {baseline} "
          f"(± SE) | gain at equal tokens | rollouts to {baseline}'s final | "
          + "".join(f"rollouts to {m}'s final (share of its) | " for m in targets)
          + " | ".join(h for _, h, _ in _COLUMNS) + " | wall s |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  fmt = lambda v, f: "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, f)
  for s in summaries:
    gain = ("" if s["method"] == baseline or math.isnan(s["gain"]) else
            f"{s['gain']:+.3f} ± {s['gain_se']:.3f}"
            + (f" (p {s['gain_p']:.2g})" if not math.isnan(s.get("gain_p", math.nan)) else "")
            + (" **resolved**" if s["resolved"] else "")
            + (" ¹" if len(s["seeds"]) == 1 else ""))
    gain_tok = "" if s["method"] == baseline else fmt(s["gain_tokens"], "+.3f")
    to_base = (f"{s['rollouts_to_baseline']:,.0f} ({s['reached']})"
               if not math.isnan(s["rollouts_to_baseline"]) else f"never ({s['reached']})")
    cells = [s["setting"], s["method"],
             " ".join(f"{v:.3f}" for v in s["final"]) + f" / **{s['mean']:.3f}** ± {s['std']:.3f}",
             fmt(s["eval_se"], ".4f"), gain, gain_tok, to_base]
    for m in targets:
      t = s.get("rollouts_to", {}).get(m)
      if t is None:  # the target did not run at this setting
        cells.append("")
      elif math.isnan(t["rollouts"]):
        cells.append(f"never ({t['reached']})")
      else:
        cells.append(f"{t['rollouts']:,.0f} ({t['reached']}; {t['share']:.0%})")
    cells += [fmt(s.get(key), f) for key, _, f in _COLUMNS]
    cells.append(fmt(s["wall_s"], ".0f") + (" †" if s["contended"] else ""))
    lines.append("| " + " | ".join(cells) + " |")
  if any(len(s["seeds"]) == 1 and s["method"] != baseline for s in summaries):
    lines.append("\n¹ one seed: the SE is the two evaluations' alone (the run-to-run spread is "
                 "not in it), so the gain is not marked resolved.")
  if any(s["contended"] for s in summaries):
    lines.append("\n† other processes used more than 10% of a seed's wall time in CPU: its "
                 "time does not compare with the others'.")
  return "\n".join(lines)
