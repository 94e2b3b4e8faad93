"""A run's folder between its starts: the config record, whether the run is complete, resume
from the newest readable checkpoint, and where its report is.

One workdir holds one run: ``config.json`` (the config it was started with; another config is
refused), ``metrics.jsonl``, ``tensorboard/``, ``checkpoints/`` and, at its end, ``report/``.
"""

from __future__ import annotations

import json
import os
import time

from grpo_jax import configuration, deprecated
from grpo_jax import console
from grpo_jax import distributed
from grpo_jax.models import CheckpointError
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.run import report_writer

# Fields that may change between the runs of one workdir: how long, how often to evaluate,
# log and checkpoint, and the mesh (checkpoints restore onto any mesh; the values then differ
# only by float rounding). Anything else changes the trajectory.
# Generation on its own devices saves at the same point under either schedule, and its pool
# restores onto any layout; the split itself (rollout.devices) is not among these.
_RESUMABLE_CHANGES = ("total_steps", "total_rollouts", "total_tokens", "log_every", "eval.",
                      "checkpoint.", "mesh.", "rollout.generation_mesh.", "rollout.schedule",
                      "rollout.lockstep_chunks", "rollout.ahead")


def check_same_run(config, workdir: str) -> None:
  """Refuses to resume a workdir whose run had another config (unless
  ``checkpoint.allow_config_change``); writes ``config.json`` for the next start."""
  path = os.path.join(workdir, "config.json")
  current = json.loads(config.to_json_best_effort())
  if os.path.exists(path) and not config.checkpoint.allow_config_change:
    with open(path, encoding="utf-8") as f:
      try:
        saved = json.load(f)
      except json.JSONDecodeError as e:
        raise configuration.ConfigError(
            f"{path} is not readable JSON ({e}): restore it, or pass "
            "--config.checkpoint.allow_config_change=true to resume without the check") from None
    flat = lambda d, pre="": ({f"{pre}{k}": v for k, v in d.items() if not isinstance(v, dict)}
                              | {kk: vv for k, v in d.items() if isinstance(v, dict)
                                 for kk, vv in flat(v, f"{pre}{k}.").items()})
    # Keys moved since the run started (``deprecated.MOVED``) are compared at their new place.
    a, b = deprecated.migrate_saved(flat(saved)), flat(current)
    # A key the saved config lacks is a field added since the run started; new fields default
    # to the behaviour from before them, so its absence is no change.
    differ = sorted(key for key in a if a.get(key) != b.get(key)
                    and not key.startswith(_RESUMABLE_CHANGES))
    if differ:
      shown = ", ".join(f"{key} ({a.get(key)!r} -> {b.get(key)!r})" for key in differ[:6])
      raise configuration.ConfigError(
          f"{workdir} holds a run with another config: {shown}"
          + (f" (+{len(differ) - 6} more)" if len(differ) > 6 else "")
          + "; use another --workdir, or --config.checkpoint.allow_config_change=true to "
          "resume it anyway")
  if distributed.is_primary():
    # Written beside it and renamed: in a multi-host resume the other processes read this file
    # while the primary rewrites it, and must see the old or the new file whole, never a
    # truncated one (rename is atomic on POSIX file systems).
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(current, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def is_complete(config, ckpt, start: int) -> bool:
  """Whether the run saved at step ``start`` has nothing left to do: all its steps, or its
  rollout or token budget, spent."""
  if start >= config.total_steps:
    return True
  if not start or not (config.total_rollouts or config.total_tokens):
    return False
  return budget_spent(config, ckpt.host(start))


def budget_spent(config, counters) -> bool:
  """Whether ``counters`` (a dict with ``rollouts`` and ``completion_tokens``) reach the run's
  rollout budget or its token budget (each 0: none)."""
  rollouts, tokens = config.total_rollouts, config.total_tokens
  return bool(rollouts and counters.get("rollouts", 0) >= rollouts
              or tokens and counters.get("completion_tokens", 0) >= tokens)


def restore_newest_readable(ckpt, state, replay):
  """(step, restored) from the newest checkpoint that restores; a damaged one (killed during
  the save, truncated or corrupted files) is reported and the next older one is tried. Orbax
  never lists a save that did not finish (it writes to a temporary folder and renames)."""
  errors = []
  for step in sorted(ckpt.manager.all_steps(), reverse=True):
    try:
      restored = ckpt.restore(step, state, replay)
    except CheckpointError:
      raise  # written in another layout (Checkpointer.restore says which): not damaged
    except Exception as e:  # pylint: disable=broad-except
      # Moved aside, not deleted (nothing is lost), so that the run can save that step again.
      aside = os.path.join(os.path.dirname(ckpt.directory), "checkpoints_unreadable",
                           f"{step}-{int(time.time())}")
      os.makedirs(os.path.dirname(aside), exist_ok=True)
      os.rename(os.path.join(ckpt.directory, str(step)), aside)
      ckpt.manager.reload()
      errors.append(f"checkpoint {step} is unreadable ({type(e).__name__}: {str(e)[:200]})")
      console.say(f"grpo_jax: {errors[-1]}; moved to {aside}; trying an older one")
      continue
    if errors:
      console.say(f"grpo_jax: resuming from checkpoint {step} (the newest readable one)")
    return step, restored
  raise CheckpointError("no readable checkpoint in " + ckpt.directory + ": " + "; ".join(errors))


def resumed_timers(workdir: str, timers: dict) -> dict:
  """The cumulative seconds per phase of ``timers``' phases as the last step record before the
  restart has them (time spent before a restart keeps counting); ``timers`` without one."""
  last_step = [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]
  if not last_step:
    return dict(timers)
  return {name: last_step[-1].get(f"time_{name}_s", 0.0) for name in timers}


def report_paths(workdir: str, write: bool = False, k: int = 8) -> dict:
  """The run's report (summary table, plots of mean@k), written now when asked; where it is."""
  out = os.path.join(workdir, "report")
  if write:
    try:
      written = report_writer.write_report([workdir], out, k=k)
    except Exception as e:  # pylint: disable=broad-except
      console.say(f"grpo_jax: report not written ({e})")
      return {}
    plots = [p for p in written if p.endswith(".png")]
    return {"report": os.path.join(out, "summary.md"),
            "plots": ", ".join(plots) if plots else "(pip install matplotlib for plots)"}
  return {"report": out} if os.path.isdir(out) else {}
