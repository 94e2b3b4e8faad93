"""The regime map: every method's gain over the baseline in every setting of several sweeps,
as one heat map and one table per sweep.

    python -m grpo_jax.bench.regime_map --out=docs/results/regime/map \
        --sweeps=docs/results/regime/movement,docs/results/regime/difficulty

Reads each sweep folder's ``summary.json`` (``grpo_jax.bench.sweep`` writes it). A column is a
(sweep, setting), named by the folder and the setting's axis values; a row is a method. A cell
is the method's gain over the sweep's baseline in points of mean@k at equal generated rollouts,
paired by seed (``cells.summarise``), with its standard error; **resolved** (paired t-test
p < 0.05) is bold in the table and framed in the figure. The baseline's row (``--baseline``,
GRPO in the shipped grids) holds its own final mean@k, for scale. Methods with own-axis
values (``popo [max_uses=4]``) are rows of their own.

Writes ``<out>/map.md`` and, with matplotlib, ``<out>/map.png``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from absl import app, flags

from grpo_jax.bench import grid as grid_lib
from grpo_jax.run import report_writer

# Short names of the axes the shipped grids vary; any other path is named by its last part.
AXIS_NAMES = {"opt.learning_rate": "lr", "rl.num_minibatches": "updates",
              "task.countdown.max_number": "numbers to"}


def define_flags():
  """The CLI flags; defined only when run as a program, so tests can import this module."""
  flags.DEFINE_list("sweeps", [], "sweep output folders, each with its summary.json")
  flags.DEFINE_string("out", "docs/results/regime/map", "folder for map.md and map.png")
  flags.DEFINE_list("methods", [], "rows to show, in this order (default: every method, in "
                    "the order the sweeps name them)")
  flags.DEFINE_string("baseline", "grpo", "the sweeps' baseline (its row: its own mean@k)")


def setting_label(values: dict[str, Any]) -> str:
  """``{"opt.learning_rate": 1e-4, "rl.num_minibatches": 4}`` -> ``"lr 1e-4, updates 4"``."""
  parts = [f"{AXIS_NAMES.get(p, p.rsplit('.', 1)[-1])} {_short(v)}" for p, v in values.items()]
  return ", ".join(parts) or "defaults"


def _short(value: Any) -> str:
  """A small float as ``3e-5`` (not ``3e-05``), anything else as in the cell ids."""
  if isinstance(value, float) and value and abs(value) < 1e-2:
    mantissa, exponent = f"{value:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"
  return grid_lib.value_text(value)


def read_summaries(folder: str) -> list[dict]:
  """A sweep folder's summary.json rows.

  Raises:
    FileNotFoundError: no summary.json (with the command that writes it).
  """
  path = os.path.join(folder, "summary.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path}: no sweep summary (python -m grpo_jax.bench.sweep "
                            f"--grid=... --out={folder} --report writes it)")
  with open(path) as f:
    return json.load(f)


def load(folders: Sequence[str]) -> list[dict]:
  """Every summary row of the folders, each with ``sweep`` (the folder's name) and ``column``.

  Raises:
    FileNotFoundError: a folder without summary.json (with the command that writes it).
  """
  rows = []
  for folder in folders:
    summaries = read_summaries(folder)
    sweep = os.path.basename(os.path.normpath(folder))
    for s in summaries:
      # A method's own-axis values are in its label already ("popo [max_uses=4]"): the
      # column is the shared setting alone.
      own = s["method"].partition(" [")[2]
      shared = {p: v for p, v in s["setting_values"].items()
                if f"{p.rsplit('.', 1)[-1]}=" not in own and f"{p}=" not in own}
      rows.append(dict(s, sweep=sweep, column=f"{sweep}: {setting_label(shared)}"))
  return rows


def table(rows: Sequence[dict], baseline: str = "grpo",
          methods: Sequence[str] | None = None) -> str:
  """One markdown table per sweep: a row per method, a column per setting; the baseline's
  cells are its final mean@k, the others ``gain ± SE`` in points (bold when resolved; the
  number of paired seeds after it where it differs from the baseline's, whose row gives its
  own ``n``)."""
  out = []
  for sweep in dict.fromkeys(r["sweep"] for r in rows):
    mine = [r for r in rows if r["sweep"] == sweep]
    columns = list(dict.fromkeys(r["column"] for r in mine))
    names = [m for m in (methods or dict.fromkeys(r["method"] for r in mine))
             if any(r["method"] == m for r in mine)]
    cell = {(r["method"], r["column"]): r for r in mine}
    n_base = {c: len(cell[(baseline, c)]["seeds"]) for c in columns if (baseline, c) in cell}
    head = "| method | " + " | ".join(c.split(": ", 1)[1] for c in columns) + " |"
    lines = [f"**{sweep}** (points of held-out mean@k over {baseline}; its own row: mean@k)",
             "", head, "|---" * (len(columns) + 1) + "|"]
    for m in names:
      texts = []
      for c in columns:
        r = cell.get((m, c))
        if r is None:
          texts.append("")
        elif m == baseline:
          texts.append(f"{r['mean']:.3f} (n={len(r['seeds'])})")
        else:
          text = f"{100 * r['gain']:+.1f} ± {100 * r['gain_se']:.1f}"
          text = f"**{text}**" if r.get("resolved") else text
          n = len(r["seeds"])
          texts.append(text + (f" (n={n})" if c in n_base and n != n_base[c] else ""))
      lines.append(f"| {m} | " + " | ".join(texts) + " |")
    out.append("\n".join(lines))
  return "\n\n".join(out) + "\n"


def plot(rows: Sequence[dict], path: str, baseline: str = "grpo",
         methods: Sequence[str] | None = None, limit: float = 3.0) -> bool:
  """map.png: methods down, (sweep, setting) across (with the baseline's seeds and share of
  ineffective groups), each cell coloured by the gain in points (clipped at +-``limit``), its
  value written in it and a frame where it is resolved. Returns False when matplotlib is not
  installed."""
  plt = report_writer._pyplot()  # pylint: disable=protected-access
  if plt is None:
    return False
  import numpy as np  # pylint: disable=g-import-not-at-top
  columns = list(dict.fromkeys(r["column"] for r in rows))
  names = [m for m in (methods or dict.fromkeys(r["method"] for r in rows))
           if m != baseline and any(r["method"] == m for r in rows)]
  cell = {(r["method"], r["column"]): r for r in rows}
  gain = np.full((len(names), len(columns)), np.nan)
  for i, m in enumerate(names):
    for j, c in enumerate(columns):
      if (m, c) in cell:
        gain[i, j] = 100 * cell[(m, c)]["gain"]
  fig, ax = plt.subplots(figsize=(1.2 + 0.62 * len(columns), 1.0 + 0.42 * len(names)))
  image = ax.imshow(np.clip(gain, -limit, limit), cmap="RdBu", vmin=-limit, vmax=limit,
                    aspect="auto")
  for i, m in enumerate(names):
    for j, c in enumerate(columns):
      r = cell.get((m, c))
      if r is None:
        continue
      ax.text(j, i, f"{gain[i, j]:+.1f}", ha="center", va="center", fontsize=7,
              fontweight="bold" if r.get("resolved") else "normal")
      if r.get("resolved"):
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=1.5))
  ax.set_xticks(range(len(columns)), [_column_label(c, cell.get((baseline, c)))
                                       for c in columns], rotation=60, ha="right", fontsize=7)
  ax.set_yticks(range(len(names)), names, fontsize=8)
  for j in range(1, len(columns)):  # a line between sweeps
    if columns[j].split(": ")[0] != columns[j - 1].split(": ")[0]:
      ax.axvline(j - 0.5, color="black", lw=1)
  bar = fig.colorbar(image, ax=ax, fraction=0.03, pad=0.01)
  bar.set_label("gain over the baseline, points of mean@k (framed: p < 0.05)", fontsize=7)
  ax.set_title(f"the regime map: gain over {baseline} at equal generated rollouts", fontsize=9)
  fig.savefig(path, dpi=130, bbox_inches="tight")  # the long column labels included
  plt.close(fig)
  return True


def _column_label(column: str, base: dict | None) -> str:
  """The column with the baseline's seeds and its share of ineffective groups, if known."""
  if base is None:
    return column
  extra = [f"n={len(base['seeds'])}"]
  if "train/ineffective_fraction" in base:
    extra.append(f"{100 * base['train/ineffective_fraction']:.0f}% ineffective")
  return f"{column} ({', '.join(extra)})"


def write(folders: Sequence[str], out: str, baseline: str = "grpo",
          methods: Sequence[str] | None = None) -> list[str]:
  """Writes map.md (and map.png with matplotlib) for the sweeps in ``folders``; the paths."""
  rows = load(folders)
  os.makedirs(out, exist_ok=True)
  paths = [os.path.join(out, "map.md")]
  with open(paths[0], "w") as f:
    f.write("# The regime map\n\n" + table(rows, baseline, methods))
  if plot(rows, os.path.join(out, "map.png"), baseline, methods):
    paths.append(os.path.join(out, "map.png"))
  return paths


def main(argv):
  del argv
  f = flags.FLAGS
  if not f.sweeps:
    raise app.UsageError("--sweeps=FOLDER[,FOLDER...]: the sweeps' output folders")
  try:
    paths = write(f.sweeps, f.out, f.baseline, f.methods or None)
  except FileNotFoundError as e:
    print(f"grpo_jax.bench.regime_map: {e}")
    return 1
  print("\n".join(paths))
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
