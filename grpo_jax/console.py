"""What a run prints: quiet third-party logging, one line per evaluation, the end-of-run summary.

The terminal of ``python -m grpo_jax.train`` is for a person: the project's own lines (where
things go, one formatted line per held-out evaluation, a summary at the end) and one progress
bar; orbax's and JAX's INFO chatter is turned down to WARNING unless ``--verbosity`` is given.
Everything machine-readable goes to ``metrics.jsonl`` instead.
"""

from __future__ import annotations

import logging
import sys

import numpy as np

from grpo_jax import timing

_THIRD_PARTY = ("jax", "orbax", "absl", "etils", "tensorflow", "transformers", "h5py")


def quiet_third_party() -> None:
  """Third-party loggers (orbax, absl, JAX's backend probing, ...) at WARNING."""
  from absl import logging as absl_logging  # pylint: disable=g-import-not-at-top
  absl_logging.set_verbosity(absl_logging.WARNING)
  for name in _THIRD_PARTY:
    logging.getLogger(name).setLevel(logging.WARNING)


def quiet_unless_verbose() -> None:
  """``quiet_third_party`` unless the command line gave absl's ``--verbosity`` (``--verbosity=0``
  brings orbax's and JAX's INFO lines back). For the ``main`` of every command."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  if not flags.FLAGS["verbosity"].present:
    quiet_third_party()


def say(text: str) -> None:
  """Prints one of the project's lines without breaking a tqdm progress bar (process 0 only:
  in a multi-host run the other processes stay silent)."""
  jax = sys.modules.get("jax")  # not imported here: the check must not start a backend
  if jax is not None and jax.distributed.is_initialized() and jax.process_index() != 0:
    return
  try:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    tqdm.write(text, file=sys.stdout)
  except ImportError:
    print(text, flush=True)
  sys.stdout.flush()


def eval_set_names(evaluation: dict, k: int) -> list[str]:
  """The named held-out sets of an evaluation record (``eval/<set>/mean_at_<k>``), in order."""
  suffix = f"/mean_at_{k}"
  return [key[len("eval/"):-len(suffix)] for key in evaluation
          if key.startswith("eval/") and key.endswith(suffix) and key.count("/") == 2]


def eval_line(step: int, evaluation: dict, rollouts: int, k: int) -> str:
  """``step 25  mean@8 0.329  pass@8 0.71  greedy 0.40  len 8.3  constant 0.34  rollouts 6,400``,
  then a line per named held-out set (``  math500  mean@8 0.412  pass@8 0.80  ...``); the
  first line pools the sets."""
  def parts(prefix):
    out = [f"mean@{k} {evaluation[f'{prefix}mean_at_{k}']:.3f}",
           f"pass@{k} {evaluation[f'{prefix}pass_at_{k}']:.2f}"]
    if f"{prefix}greedy_accuracy" in evaluation:
      out.append(f"greedy {evaluation[f'{prefix}greedy_accuracy']:.2f}")
    return out + [f"len {evaluation[f'{prefix}mean_length']:.1f}",
                  f"constant {evaluation[f'{prefix}constant_fraction']:.2f}"]
  lines = ["  ".join([f"step {step}"] + parts("eval/") + [f"rollouts {rollouts:,}"])]
  names = eval_set_names(evaluation, k)
  width = max(map(len, names), default=0)
  lines += ["  ".join([f"  {name:<{width}}"] + parts(f"eval/{name}/")) for name in names]
  return "\n".join(lines)


# Runs logged before the step was split into timing.PHASES recorded only these four.
_TIME_REQUIRED = ("generation", "update", "evaluation", "checkpoint")


def _minutes(seconds: float) -> str:
  return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _allocation_line(steps: list[dict]) -> str:
  """What an allocator did over the run (empty for uniform allocation)."""
  total = lambda key: sum(r.get(key, 0.0) for r in steps)
  if not any(r.get("alloc/rounds", 1) > 1 or "alloc/abandoned" in r for r in steps):
    return ""
  generated = max(total("alloc/rollouts_generated"), 1.0)
  parts = [f"rollouts in updates {total('alloc/rollouts_in_update') / generated:.0%} of those "
           f"generated", f"{total('alloc/rounds') / len(steps):.1f} rounds/step",
           f"{1000 * total('alloc/effective_groups') / generated:.0f} effective groups per "
           "1,000 rollouts"]
  if any("alloc/abandoned" in r for r in steps):
    decided = total("alloc/committed") + total("alloc/abandoned") + total("alloc/surplus")
    audited = total("alloc/audited")
    parts.append(f"abandoned {total('alloc/abandoned') / max(decided, 1):.0%} of prompts, "
                 f"{total('alloc/wrong_abandoned') / max(audited, 1):.1%} of {audited:,.0f} "
                 "audited wrongly")
  if total("alloc/empty_groups"):
    parts.append(f"{total('alloc/empty_groups'):,.0f} empty group slots")
  return "allocation: " + "; ".join(parts)


def summary(records: list[dict], k: int, paths: dict, total_steps: int,
            total_rollouts: int = 0, total_tokens: int = 0) -> str:
  """The end-of-run summary from a run's metric records (so a restarted finished run prints
  the same). ``paths`` maps names (metrics, checkpoints, plots, ...) to where they are;
  ``total_rollouts`` / ``total_tokens`` are the run's budgets (0: none)."""
  evals = [r for r in records if f"eval/mean_at_{k}" in r]
  steps = [r for r in records if "loss" in r]
  done = steps[-1]["step"] if steps else 0
  last_step = steps[-1] if steps else {}
  spent = [f"{name} budget {budget:,} spent" for name, budget, key in (
      ("rollout", total_rollouts, "rollouts"), ("token", total_tokens, "completion_tokens"))
           if budget and last_step.get(key, 0) >= budget]
  lines = [f"grpo_jax: run {'complete' if done >= total_steps or spent else 'stopped'} at step "
           f"{done}/{total_steps}" + (f" ({', '.join(spent)})" if spent else "")]
  if evals:
    a, b = evals[0][f"eval/mean_at_{k}"], evals[-1][f"eval/mean_at_{k}"]
    line = (f"  held-out mean@{k} {a:.3f} -> {b:.3f} ({100 * (b - a):+.1f} points, step "
            f"{evals[0]['step']} -> {evals[-1]['step']})")
    if "eval/greedy_accuracy" in evals[-1]:
      line += (f"   greedy {evals[0].get('eval/greedy_accuracy', float('nan')):.3f} -> "
               f"{evals[-1]['eval/greedy_accuracy']:.3f}")
    lines.append(line)
    for name in eval_set_names(evals[-1], k):
      key = f"eval/{name}/mean_at_{k}"
      first = next((r[key] for r in evals if key in r), float("nan"))
      lines.append(f"    {name}: mean@{k} {first:.3f} -> {evals[-1][key]:.3f}")
  if steps:
    last = steps[-1]
    lines.append(f"  rollouts {last.get('rollouts', 0):,}   completion tokens "
                 f"{last.get('completion_tokens', 0):,}   reward errors "
                 f"{last.get('reward_errors', 0)}")
    parts = [(name, last.get(f"time_{name}_s")) for name in timing.PHASES]
    if all(last.get(f"time_{name}_s") is not None for name in _TIME_REQUIRED):
      parts = [(name, v) for name, v in parts if v is not None]  # older runs: the four only
      total = sum(v for _, v in parts)
      lines.append(f"  time {_minutes(total)}: " + ", ".join(
          f"{name} {_minutes(v)}" for name, v in parts))
    stats = []
    mean = lambda key: float(np.mean([r[key] for r in steps if key in r]))
    if any("ineffective_fraction" in r for r in steps):
      stats.append(f"ineffective groups {mean('ineffective_fraction'):.0%}")
    if any("replay_rows" in r for r in steps):
      stats.append(f"replayed rows/step {mean('replay_rows'):.1f}, age "
                   f"{mean('replay_age_mean'):.1f} steps")
    if any("headroom_accept_rate" in r for r in steps):
      stats.append(f"drift-gate acceptance {mean('headroom_accept_rate'):.0%}")
    if stats:
      lines.append("  " + "; ".join(stats))
    allocation = _allocation_line(steps)
    if allocation:
      lines.append("  " + allocation)
  width = max((len(n) for n in paths), default=0)
  lines += [f"  {name:<{width}}  {where}" for name, where in paths.items() if where]
  return "\n".join(lines)
