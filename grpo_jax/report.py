"""The report of one or several runs, from the command line.

    python -m grpo_jax.report runs/popo [runs/grpo ...] [--out=DIR] [--k=8]

The figures and tables are ``grpo_jax.run.report_writer``'s (what each file holds is said there).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from grpo_jax.run import report_writer


def main(argv: Sequence[str]) -> int:
  """``RUN_DIR [RUN_DIR ...] [--out=DIR] [--k=8]``; ``label=RUN_DIR`` groups runs by label."""
  out, k, dirs, labels = None, 8, [], []
  for arg in argv:
    if arg.startswith("--out="):
      out = arg.split("=", 1)[1]
    elif arg.startswith("--k="):
      k = int(arg.split("=", 1)[1])
    else:
      label, _, path = arg.rpartition("=") if "=" in arg else ("", "", arg)
      dirs.append(path)
      labels.append(label or os.path.basename(os.path.normpath(path)))
  if not dirs:
    print("usage: python -m grpo_jax.report RUN_DIR [RUN_DIR ...] [--out=DIR]", file=sys.stderr)
    return 2
  missing = [d for d in dirs if not os.path.exists(os.path.join(d, "metrics.jsonl"))]
  if missing:
    print(f"grpo_jax.report: no metrics.jsonl in {', '.join(missing)}", file=sys.stderr)
    return 1
  paths = report_writer.write_report(dirs, out or os.path.join(dirs[0], "report"), labels, k)
  print(report_writer.summary_table(dirs, labels, k))
  sets = report_writer.sets_table(dirs, labels, k)
  if sets:
    print(sets)
  print("wrote " + ", ".join(paths))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
