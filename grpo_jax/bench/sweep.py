"""Sweeps: every cell of a grid (method x setting x seed), one at a time, resumable, into one
tidy table, a summary and figures.

    python -m grpo_jax.bench.sweep --grid=configs/sweeps/movement.py --out=runs/sweep/movement
    python -m grpo_jax.bench.sweep --grid=... --out=... --detach        # in the background
    python -m grpo_jax.bench.sweep --grid=... --out=... --max_cells=10  # at most 10 cells now
    python -m grpo_jax.bench.sweep --grid=... --out=... --only=seed=1 \
        --only=opt.learning_rate=1e-4,2e-4                              # only these cells now
    python -m grpo_jax.bench.sweep --grid=... --out=... --report        # tables and figures only
    python -m grpo_jax.bench.sweep --grid=... --out=... --carry_over    # after re-runs, below
    python -m grpo_jax.bench.sweep --grid=... --out=... --rekey         # records of before, below

The grid file (``grpo_jax/bench/grid.py`` says what it holds; examples in configs/sweeps/)
names the methods, seeds, budget, axes and overrides; every cell's config is checked before
the first one runs. Cells run one at a time (so their timing columns compare), each as
``grpo_jax.train`` in its own process (a cell that fails is recorded with its last line and
the sweep goes on; memory goes back between cells) in ``<workdirs>/<cell id>`` (default
``<out>/runs``), with JAX's compilation cache in ``<workdirs>/jax_cache`` unless
``JAX_COMPILATION_CACHE_DIR`` is set. When a cell ends its record is written to
``<out>/cells/<cell id>.json`` and its checkpoints are removed (``--keep_checkpoints`` keeps
them; the metrics stay).

Resuming: the same command again runs only what is missing. A record stores the resolved config
its run used (``config``); the cell is done while today's config of the cell is that run
(``config_match``: every key the two share has the same value, a key added to the package since
is at its default, one removed since was unset), so a new knob at its default leaves every
record done. A cell whose config has changed since (the grid, a config file, a default it
relied on) runs again (its old record is kept in the new one: ``previous`` says whether the
re-run reproduced it exactly; ``--carry_over`` then marks that method's other records of the
same code current, so a change that moves nothing costs one cell per method, not the grid).
Records written before records stored their config hold only the hash of the whole config;
``--rekey`` rebuilds each one's config at its code commit and stores it where it reproduces
that hash (``rekey``). A cell interrupted mid-run resumes from its last checkpoint (one per
evaluation), bit for bit as ``grpo_jax.train`` resumes. A second sweep on the same ``--out`` is
refused while the first is alive. SIGTERM or Ctrl-C stops the running cell at its next step (it
checkpoints) and then the sweep.

Written after every cell, from every record under ``<out>/cells`` of this grid:

* ``sweep.csv`` and ``sweep.parquet``: the tidy table, one row per (cell, evaluation) with the
  grid values, the evaluation (mean@k and its standard error over prompts, rollouts and tokens
  generated, ...), the cell's cost and the means of its training metrics (``train/...``);
* ``summary.md`` and ``summary.json``: per setting and method, the seeds' final mean@k, the
  evaluation's standard error, the gain over the baseline at equal rollouts and at equal
  tokens (paired by seed, with its standard error), rollouts to the baseline's final accuracy,
  the off-policy and length metrics, wall time;
* ``accuracy.png`` and ``mechanism.png`` (``grpo_jax.run.report_writer.plot_grid``; with matplotlib).
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

from absl import app, flags

from grpo_jax import console
from grpo_jax.bench import carry_over as carry_lib
from grpo_jax.bench import cells as cells_lib
from grpo_jax.bench import grid as grid_lib
from grpo_jax.bench import provenance
from grpo_jax.bench import rekey as rekey_lib
from grpo_jax.bench import sweep_outputs as outputs_lib
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.run import workdir as workdir_lib


def define_flags():
  """The CLI flags; defined only when run as a program, so tests can import this module."""
  flags.DEFINE_string("grid", None, "grid file, e.g. configs/sweeps/movement.py[:arg]")
  flags.DEFINE_string("out", None, "output folder: cells/, the tables, the figures "
                      "(default runs/sweep/<grid name>)")
  flags.DEFINE_string("workdirs", "", "folder of the cells' run folders (default <out>/runs)")
  flags.DEFINE_integer("max_cells", 0, "run at most this many cells now (0 = all)")
  flags.DEFINE_multi_string("only", [], "run only the cells matching KEY=V1,V2 (KEY: seed, "
                            "method or an axis path; repeat to match all); the tables and "
                            "figures still cover every finished cell of the grid")
  flags.DEFINE_bool("report", False, "only write the tables and figures of the finished cells")
  flags.DEFINE_bool("carry_over", False, "mark records of older configs current where a "
                    "re-run of the same method and code reproduced its record exactly (see "
                    "carry_over), then write the tables")
  flags.DEFINE_bool("rekey", False, "give records written before records stored their config "
                    "the config they ran, rebuilt at their code commit where it reproduces "
                    "their hash (see rekey), then write the tables")
  flags.DEFINE_bool("detach", False, "run in the background, output in <out>/sweep.log")
  flags.DEFINE_bool("keep_checkpoints", False, "keep each finished cell's checkpoints")
  flags.DEFINE_string("cell", "", "internal: run this one cell (by id) in this process")


def cell_path(out: str, cell: grid_lib.Cell) -> str:
  return os.path.join(out, "cells", f"{cell.id}.json")


def finished(out: str, grid: grid_lib.Grid, cell: grid_lib.Cell) -> bool:
  """Whether the cell has a record of a successful run of its current config."""
  try:
    with open(cell_path(out, cell)) as f:
      rec = json.load(f)
  except (OSError, ValueError):
    return False
  return rec.get("status") == "done" and grid.current(cell).stands(rec)


def _stale_record(out: str, grid: grid_lib.Grid, cell: grid_lib.Cell) -> dict | None:
  """The cell's done record if it ran an older config (a re-run's ``previous``), else None."""
  try:
    with open(cell_path(out, cell)) as f:
      rec = json.load(f)
  except (OSError, ValueError):
    return None
  return carry_lib.stale(rec, grid.current(cell))


def _records_now(grid: grid_lib.Grid, out: str) -> tuple[dict[str, dict], dict]:
  """The grid's records under ``out`` and their cells' configs today (``grid.current``), by
  cell id."""
  recs, now = {}, {}
  for cell in grid.cells():
    try:
      with open(cell_path(out, cell)) as f:
        recs[cell.id] = json.load(f)
    except (OSError, ValueError):
      continue
    now[cell.id] = grid.current(cell)
  return recs, now


def carry_over(grid: grid_lib.Grid, out: str) -> tuple[list[str], dict[str, str]]:
  """``carry_over.decide`` on the grid's records under ``out``; rewrites those carried over.

  Returns:
    The ids carried over, and for each stale record left as it is, why.
  """
  carried, left = carry_lib.decide(*_records_now(grid, out))
  cells = {c.id: c for c in grid.cells()}
  for cell_id, rec in carried.items():
    outputs_lib.write_json(cell_path(out, cells[cell_id]), rec)
  return list(carried), left


def rekey(grid: grid_lib.Grid, spec: str, out: str,
          find: rekey_lib.ConfigsAt = rekey_lib.configs_at) -> dict[str, str]:
  """``rekey.rekey`` on the grid's records under ``out``; rewrites those re-keyed.

  Returns:
    For each record without a stored config: ``done``, ``stale: <what changed>`` or why it
    was left as it is.
  """
  recs, now = _records_now(grid, out)
  added = rekey_lib.added_by(os.path.join(out, "cells"))
  commits = {cell_id: rekey_lib.candidates(rec.get("code") or "", added.get(f"{cell_id}.json"))
             for cell_id, rec in recs.items() if rec.get("code")}
  rekeyed, verdicts = rekey_lib.rekey(recs, now, spec, commits, find)
  cells = {c.id: c for c in grid.cells()}
  for cell_id, rec in rekeyed.items():
    outputs_lib.write_json(cell_path(out, cells[cell_id]), rec)
  return verdicts


def records(out: str, grid: grid_lib.Grid) -> list[dict]:
  """The done records of this grid's current cells, in grid order."""
  out_records = []
  for cell in grid.cells():
    if finished(out, grid, cell):
      with open(cell_path(out, cell)) as f:
        out_records.append(json.load(f))
  return out_records


def run(grid: grid_lib.Grid, spec: str, out: str, workdirs: str, max_cells: int = 0,
        keep_checkpoints: bool = False, only: tuple[str, ...] = ()) -> int:
  """Runs the cells of ``grid`` (those matching ``only``, see ``grid.select``) that are not
  done, one at a time; returns how many failed."""
  cells = grid.cells()
  done = {c.id for c in cells if finished(out, grid, c)}
  chosen = grid_lib.select(grid, list(only)) if only else cells
  todo = [c for c in chosen if c.id not in done]
  total = len(cells)
  console.say(f"sweep {grid.name}: {total} cells, {len(done)} done, {len(todo)} to run"
              + (f" of the {len(chosen)} chosen by --only" if only else "")
              + (f" (at most {max_cells} now)" if max_cells and max_cells < len(todo) else ""))
  if max_cells:
    todo = todo[:max_cells]
  code_version, machine = provenance.code_version(), provenance.platform_info()
  env = dict(os.environ)
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(workdirs, "jax_cache"))
  failed, walls = 0, []
  for i, cell in enumerate(todo):
    workdir = os.path.join(workdirs, cell.id)
    os.makedirs(workdir, exist_ok=True)
    now = grid.current(cell)
    rec = {"grid": grid.name, "id": cell.id, "method": cell.method,
           "spec": grid.methods[cell.method], "setting": dict(cell.setting),
           "setting_key": cell.setting_key, "seed": cell.seed,
           "config_hash": now.hash, "code": code_version, "platform": machine}
    prev = _stale_record(out, grid, cell)  # a done record of an older config, if any
    start, cpu0, busy0 = time.monotonic(), _children_cpu(), _machine_busy_s()
    code, last = _run_child(spec, cell, workdir, env)
    rec.update(wall_s=time.monotonic() - start, cpu_s=_children_cpu() - cpu0,
               finished_at=time.strftime("%Y-%m-%dT%H:%M:%S"))
    # CPU time the rest of the machine used meanwhile: > 10% of the wall time means the
    # cell's timing columns do not compare with a quiet cell's.
    rec["other_cpu_s"] = max(0.0, _machine_busy_s() - busy0 - rec["cpu_s"])
    rec["contended"] = rec["other_cpu_s"] > 0.1 * rec["wall_s"]
    walls.append(rec["wall_s"])
    left = len(todo) - i - 1
    eta = f"; {left} left, about {_duration(sum(walls) / len(walls) * left)}" if left else ""
    if code == 0:
      k = grid.config(cell).eval.k
      rec.update(status="done", k=k, **cells_lib.record(workdir, k))
      end = rec["evals"][-1]
      console.say(f"[{i + 1}/{len(todo)}] {cell.id}: mean@{k} {end['mean_at_k']:.3f} (se "
                  f"{end['mean_at_k_se']:.3f}) at {end['rollouts']:,} rollouts, "
                  f"{rec['wall_s']:.0f} s{eta}")
      if prev is not None:  # the evidence ``carry_over`` reads
        rec["previous"] = {"config_hash": prev["config_hash"], "code": prev.get("code"),
                           "identical": carry_lib.same_evaluations(prev, rec),
                           "agreed_until_step": carry_lib.agreed_until(prev, rec)}
        changed = now.changes(prev)  # None for a record that did not store its config
        if changed:
          rec["previous"]["changed"] = changed
      if not keep_checkpoints:
        shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
    elif code == _STOPPED or (_STOP["asked"] and code in _SIGNALLED):
      # (a child the forwarded signal reached before its own handler was installed dies of it:
      # stopped by the user all the same, not a failure)
      rec.update(status="stopped", error=last)
      console.say(f"[{i + 1}/{len(todo)}] {cell.id}: stopped before its budget")
    else:
      failed += 1
      rec.update(status="failed", returncode=code, error=last)
      console.say(f"[{i + 1}/{len(todo)}] {cell.id}: FAILED ({last}); log: "
                  f"{os.path.join(workdir, 'cell.log')}{eta}")
    if prev is not None and rec["status"] != "done":
      rec["replaces"] = prev  # a stopped or failed re-run loses nothing of the old record
    rec["config"] = now.config  # last: the rest of the record reads first
    outputs_lib.write_json(cell_path(out, cell), rec)
    write_outputs(grid, out, figures=False)
    signalled = code < 0 or code == _STOPPED or code in _SIGNALLED
    if signalled or _STOP["asked"]:
      console.say(f"sweep {grid.name}: stopped; the same command resumes it")
      break
  write_outputs(grid, out, figures=True)
  return failed


def write_outputs(grid: grid_lib.Grid, out: str, figures: bool = True) -> list[str]:
  """The tidy table, the summary and (with ``figures``) the plots of the finished cells
  (``sweep_outputs.write``)."""
  return outputs_lib.write(grid, out, records(out, grid), figures)


def _run_child(spec, cell, workdir, env) -> tuple[int, str]:
  """Runs one cell as ``python -m grpo_jax.bench.sweep --cell=ID``; (exit code, last line)."""
  log = os.path.join(workdir, "cell.log")
  with open(log, "a") as f:
    child = subprocess.Popen([sys.executable, "-m", "grpo_jax.bench.sweep", f"--grid={spec}",
                              f"--cell={cell.id}", f"--workdirs={os.path.dirname(workdir)}"],
                             stdout=f, stderr=subprocess.STDOUT, env=env)
    _STOP["child"] = child
    code = child.wait()
    _STOP["child"] = None
  with open(log) as f:
    lines = [line.strip() for line in f if line.strip()]
  return code, lines[-1] if lines else f"exit code {code}"


_STOP = {"asked": False, "child": None}
_STOPPED = 3  # the child's exit code for a run stopped before its budget
# exit codes of a child killed by SIGTERM / SIGINT (negative from Popen, 128 + n from a shell)
_SIGNALLED = (-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT)


def _stop(signum, frame):
  """SIGTERM / SIGINT: pass it to the running cell (it checkpoints and exits), then stop."""
  del frame
  _STOP["asked"] = True
  if _STOP["child"] is not None and _STOP["child"].poll() is None:
    _STOP["child"].send_signal(signum)


def _machine_busy_s() -> float:
  """Seconds of CPU the whole machine has spent busy since boot (/proc/stat; NaN elsewhere)."""
  try:
    with open("/proc/stat") as f:
      fields = [int(v) for v in f.readline().split()[1:]]
  except (OSError, ValueError):
    return float("nan")
  idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
  return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def _duration(seconds: float) -> str:
  return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _lock(out: str) -> None:
  """Takes ``<out>/sweep.lock`` (this process's pid) or exits if a live sweep holds it."""
  path = os.path.join(out, "sweep.lock")
  try:
    with open(path) as f:
      pid = int(f.read().strip() or 0)
  except (OSError, ValueError):
    pid = 0
  if pid and pid != os.getpid():
    try:
      os.kill(pid, 0)
      sys.exit(f"grpo_jax.bench.sweep: another sweep (pid {pid}) is writing {out}; wait for it "
               f"or stop it (kill {pid})")
    except ProcessLookupError:
      pass  # a sweep that died: its lock is stale
    except PermissionError:
      sys.exit(f"grpo_jax.bench.sweep: {path} is held by pid {pid}")
  with open(path, "w") as f:
    f.write(str(os.getpid()))
  atexit.register(lambda: os.path.exists(path) and os.remove(path))


def _run_one(spec: str, cell_id: str, workdirs: str) -> None:
  """The child: trains one cell in this process."""
  from grpo_jax import train  # pylint: disable=g-import-not-at-top
  grid = grid_lib.load(spec)
  cell = next((c for c in grid.cells() if c.id == cell_id), None)
  if cell is None:
    sys.exit(f"grpo_jax.bench.sweep: no cell {cell_id!r} in {spec}")
  console.quiet_unless_verbose()
  config, workdir = grid.config(cell), os.path.join(workdirs, cell_id)
  train.train_and_evaluate(config, workdir)
  # A run stopped by a signal saves and returns normally (the train loop's preemption rule):
  # only a run that spent its budget is a finished cell.
  steps = [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]
  last = steps[-1] if steps else {"step": 0}
  if not (last["step"] >= config.total_steps or workdir_lib.budget_spent(config, last)):
    print(f"grpo_jax.bench.sweep: cell {cell_id} stopped at step {last['step']} before its "
          "budget; the same command resumes it from its checkpoint")
    sys.exit(_STOPPED)


def main(argv):
  del argv
  f = flags.FLAGS
  if not f.grid:
    raise app.UsageError("--grid is required, e.g. --grid=configs/sweeps/movement.py")
  try:
    grid = grid_lib.load(f.grid)
    if f.only:
      grid_lib.select(grid, f.only)  # a bad --only fails here, in one line
  except grid_lib.GridError as e:
    sys.exit(f"grpo_jax.bench.sweep: {e}")
  if f.cell:
    try:
      _run_one(f.grid, f.cell, f.workdirs)
    except Exception as e:  # pylint: disable=broad-except
      # The loop's own errors are one line already; anything else is named, not traced here
      # (the parent records the last line; the traceback is in the cell's log above it).
      import traceback  # pylint: disable=g-import-not-at-top
      traceback.print_exc()
      sys.exit(f"grpo_jax.bench.sweep: cell {f.cell}: {type(e).__name__}: {e}")
    return
  out = f.out or os.path.join("runs", "sweep", grid.name)
  workdirs = f.workdirs or os.path.join(out, "runs")
  os.makedirs(out, exist_ok=True)
  if f.rekey:
    verdicts = rekey(grid, f.grid, out)
    counts = collections.Counter(v.split(":")[0] for v in verdicts.values())
    console.say(f"sweep {grid.name}: {len(verdicts)} record(s) without a stored config: "
                f"{counts.get('done', 0)} re-keyed and done, {counts.get('stale', 0)} re-keyed "
                f"and stale, {counts.get('left', 0)} left as they are")
    for verdict in dict.fromkeys(v for v in verdicts.values() if v != "done"):
      console.say(f"  {verdict}")
  if f.carry_over:
    carried, left = carry_over(grid, out)
    console.say(f"sweep {grid.name}: {len(carried)} record(s) carried over to the current "
                f"config; {len(left)} stale record(s) left")
    for reason in dict.fromkeys(left.values()):
      console.say(f"  left: {reason}")
  if f.report or f.carry_over or f.rekey:
    for path in write_outputs(grid, out):
      print(f"wrote {path}")
    return
  if f.detach:
    log = os.path.join(out, "sweep.log")
    argv = [a for a in sys.argv[1:] if a not in ("--detach", "--detach=true")]
    with open(log, "a") as handle:
      child = subprocess.Popen([sys.executable, "-m", "grpo_jax.bench.sweep", *argv],
                               stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    print(f"sweep {grid.name} running in the background (pid {child.pid}); progress: tail -f "
          f"{log}; the same command without --detach resumes it if it stops")
    return
  _lock(out)
  signal.signal(signal.SIGTERM, _stop)
  signal.signal(signal.SIGINT, _stop)
  failed = run(grid, f.grid, out, workdirs, f.max_cells, f.keep_checkpoints, tuple(f.only))
  print(f"wrote {out}/summary.md, sweep.csv, sweep.parquet")
  if failed:
    sys.exit(f"grpo_jax.bench.sweep: {failed} cell(s) failed; their logs are named above; the "
             "same command runs them again")


if __name__ == "__main__":
  define_flags()
  app.run(main)
