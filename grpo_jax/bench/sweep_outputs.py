"""What ``bench.sweep`` writes from its finished cells: the tidy table (``sweep.csv``,
``sweep.parquet``), the summary (``summary.md``, ``summary.json``) and the figures
(``accuracy.png``, ``mechanism.png``, and the knobs' figure for a grid with method axes).
``bench/sweep.py`` runs the cells and reads their records; the numbers are ``bench.cells``'.
"""

from __future__ import annotations

import csv
import json
import os

from grpo_jax.bench import cells as cells_lib
from grpo_jax.bench import grid as grid_lib
from grpo_jax.run import report_writer


def write(grid: grid_lib.Grid, out: str, recs: list[dict], figures: bool = True) -> list[str]:
  """The tidy table, the summary and (with ``figures``) the plots of the finished cells'
  records ``recs`` (``sweep.records``), in ``out``; the paths written."""
  if not recs:
    return []
  axes = list(dict.fromkeys(list(grid.axes) + [p for a in grid.method_axes.values() for p in a]))
  rows = cells_lib.tidy_rows(recs, axes)
  written = [os.path.join(out, "sweep.csv"), os.path.join(out, "sweep.parquet"),
             os.path.join(out, "summary.md"), os.path.join(out, "summary.json")]
  _write_csv(written[0], rows)
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  pq.write_table(pa.Table.from_pylist(rows), written[1])
  # a method's own-axis cells are compared with the baseline at the same shared setting
  compared = [dict(r, **dict(zip(("setting_key", "method"),
                                 grid.compared_as(r["method"], r["setting"])))) for r in recs]
  summaries = cells_lib.summarise(compared, grid.baseline, grid.targets)
  k = recs[0]["k"]
  kind, amount = grid.budget
  md = (f"# Sweep {grid.name}\n\n{len(recs)} of {len(grid.cells())} cells done; budget "
        f"{amount:,} {kind}; baseline {grid.baseline}; mean@{k} on the held-out set at the "
        "budget's end; gains paired by seed.\n\n"
        + cells_lib.summary_markdown(summaries, grid.baseline, k, grid.targets) + "\n")
  with open(written[2], "w") as f:
    f.write(md)
  write_json(written[3], summaries)
  if figures:
    # Without shared axes a knobs grid's every point would sit at x = 0: knobs.png alone.
    if grid.axes or not grid.method_axes:
      written += _figures(grid, summaries, out, k)
    if grid.method_axes:
      written += _knobs_figure(grid, summaries, out)
  return written


def _figures(grid, summaries, out, k) -> list[str]:
  """accuracy.png (final mean@k, gain over the baseline, rollouts to the baseline's final
  accuracy; a run that never reaches it leaves a gap) and mechanism.png (drift, weight,
  clipping, length, truncation) against the grid's x axis, one panel per panel-axis value."""
  x, panels, measured = grid.plot["x"], grid.plot["panels"], grid.plot["x_measured"]
  base = {s["setting"]: s for s in summaries if s["method"] == grid.baseline}
  points = []
  for s in summaries:
    values = s["setting_values"]
    if measured:
      xv = base.get(s["setting"], {}).get(f"train/{measured}", float("nan"))
    else:
      xv = values.get(x, 0.0) if x else 0.0
    points.append({"x": xv, "series": s["method"],
                   "panel": f"{panels}={values.get(panels)}" if panels else "",
                   f"mean@{k}": s["mean"], f"mean@{k} std": s["std"],
                   f"gain over {grid.baseline}": s["gain"],
                   f"gain over {grid.baseline} std": s["gain_se"],
                   f"rollouts to {grid.baseline}'s final": s["rollouts_to_baseline"],
                   **{key: s.get(f"train/{key}", float("nan"))
                      for key in ("replay_drift", "replay_is_weight_mean", "clip_frac_high",
                                  "end_completion_length_mean", "end_truncated_fraction")}})
  xlabel = measured or x or ""
  xlog = bool(x and not measured and all(isinstance(v, float) for v in grid.axes.get(x, ())))
  paths = []
  for name, ys in (("accuracy.png", [f"mean@{k}", f"gain over {grid.baseline}",
                                     f"rollouts to {grid.baseline}'s final"]),
                   ("mechanism.png", ["replay_drift", "replay_is_weight_mean", "clip_frac_high",
                                      "end_completion_length_mean",
                                      "end_truncated_fraction"])):
    path = os.path.join(out, name)
    if report_writer.plot_grid(points, path, ys=ys, xlabel=xlabel, xlog=xlog,
                        title=f"sweep {grid.name}"):
      paths.append(path)
  return paths


def _knobs_figure(grid, summaries, out) -> list[str]:
  """knobs.png, for a grid with ``method_axes``: one panel per such method, its first own
  axis's values along x (in grid order, evenly spaced), a line per value of its other own
  axes; rows: the gain over the baseline, replayed rows a step and their drift."""
  points, ticks = [], {}
  for s in summaries:
    method = s["method"].split(" [")[0]
    own = list(grid.method_axes.get(method, {}))
    if not own:
      continue
    first = own[0]
    panel = f"{method}: {first.rsplit('.', 1)[-1]}"
    values = grid.method_axes[method][first]
    v = s["setting_values"][first]
    ticks[panel] = [(i, grid_lib.value_text(x)) for i, x in enumerate(values)]
    rest = ",".join(f"{p.rsplit('.', 1)[-1]}={grid_lib.value_text(s['setting_values'][p])}"
                    for p in own[1:])
    points.append({"x": float(values.index(v)), "series": rest or method, "panel": panel,
                   f"gain over {grid.baseline}": s["gain"],
                   f"gain over {grid.baseline} std": s["gain_se"],
                   "replayed rows": s.get("train/replay_rows", float("nan")),
                   "replay drift": s.get("train/replay_drift", float("nan"))})
  path = os.path.join(out, "knobs.png")
  if not points or not report_writer.plot_grid(
      points, path, ys=[f"gain over {grid.baseline}", "replayed rows", "replay drift"],
      xlabel="knob value", title=f"sweep {grid.name}: each knob against {grid.baseline}",
      xticks=ticks):
    return []
  return [path]


def _write_csv(path: str, rows: list[dict]) -> None:
  columns = list(dict.fromkeys(key for row in rows for key in row))
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)


def write_json(path: str, obj) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)  # a record is whole or absent, never half written
