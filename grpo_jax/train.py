"""RL training entry point.

    python -m grpo_jax.train --config=configs/grpo.py [--config.x=y ...] [--workdir=DIR]

``train_and_evaluate(config, workdir)`` does the work so notebooks and tests can call it: the
loop is prompts -> sampler -> host rewards -> jitted train step -> metrics, with held-out
evaluation every ``eval.every`` steps, orbax checkpoints every ``checkpoint.every`` steps and
automatic resume from the latest checkpoint in ``workdir``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import transformers
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from grpo_jax import allocation
from grpo_jax import checkpoint as checkpoint_lib
from grpo_jax import configuration
from grpo_jax import console
from grpo_jax import evaluate as evaluate_lib
from grpo_jax import keys
from grpo_jax import metrics as metrics_lib
from grpo_jax import optim
from grpo_jax import report
from grpo_jax import replay as replay_lib
from grpo_jax import prompts as prompts_lib
from grpo_jax import sampler as sampler_lib
from grpo_jax import sharding as sharding_lib
from grpo_jax import step as step_lib
from grpo_jax import tokenization
from grpo_jax.models import CheckpointError, from_pretrained
from grpo_jax import tasks as tasks_lib

def define_flags():
  """The CLI flags; defined only when run as a program, so importing this module is free."""
  config_flags.DEFINE_config_file("config", None, "RL config file, e.g. configs/grpo.py.")
  flags.DEFINE_string("workdir", None, "Output folder (metrics, checkpoints); default "
                      "runs/<config file name>, e.g. runs/grpo.")


def _evaluate(config, graphdef, params, tokenizer, task, problems, render, mesh=None) -> dict:
  r, e = config.rollout, config.eval
  kw = dict(prompt_len=r.prompt_len, completion_len=r.completion_len, seed=config.seed,
            render=render, model_path=config.model.path, mesh=mesh)
  out = evaluate_lib.evaluate(graphdef, params, tokenizer, task, problems, k=e.k,
                              temperature=e.temperature, **kw)
  result = {f"eval/mean_at_{e.k}": out["mean_at_k"], f"eval/pass_at_{e.k}": out["pass_at_k"],
            "eval/mean_length": out["mean_length"],
            "eval/constant_fraction": out["constant_fraction"]}
  if e.greedy:
    greedy = evaluate_lib.evaluate(graphdef, params, tokenizer, task, problems, k=1,
                                   temperature=0.0, **kw)
    result["eval/greedy_accuracy"] = greedy["mean_at_k"]
  return result


def train_and_evaluate(config, workdir: str) -> dict:
  """Runs (or resumes) training; returns the last evaluation's metrics."""
  configuration.validate(config)
  # Multi-host: every process runs this same function on the same prompts (README: Sharding).
  sharding_lib.initialize_distributed(config.mesh)
  mesh = sharding_lib.mesh_from_config(config)  # None on a single device
  configuration.check_mesh(config, mesh)
  r = config.rollout
  tokenizer = transformers.AutoTokenizer.from_pretrained(config.model.path)
  model = from_pretrained(config.model.path, param_dtype=config.model.param_dtype,
                          dtype=config.model.dtype, mesh=mesh)
  if len(tokenizer) > model.config.vocab_size:
    raise CheckpointError(
        f"the tokenizer in {config.model.path} has {len(tokenizer):,} tokens but the model's "
        f"embedding has {model.config.vocab_size:,} rows: they do not belong together")
  graphdef, params = nnx.split(model)
  del model
  # The reference must own its buffers: the state's parameters are donated every step.
  ref_params = jax.tree.map(jnp.copy, params) if config.rl.kl_coef > 0 else None
  tx = optim.make_optimizer(config)
  state = step_lib.init_train_state(params, tx, mesh)
  method = configuration.replay_config(config)
  replay = replay_lib.init_replay(config.replay.capacity, method.entry_size(r.group_size),
                                  r.prompt_len, r.completion_len)
  if mesh is not None:
    replay = sharding_lib.put(replay, sharding_lib.replay_shardings(mesh, replay))
  task = tasks_lib.make_task(config)
  stream = prompts_lib.PromptStream(task, tokenizer, r.prompt_len, config.task.chat_template,
                                     train_size=config.task.train_size)
  sample_fn = sampler_lib.make_sampler(graphdef, sampler_lib.sampling_config_for(
      tokenizer, r.completion_len, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
      model_path=config.model.path,
      prompt_group=r.group_size if config.rl.get("shared_prompts", True) else 1), mesh)
  timer = metrics_lib.PhaseTimer()  # this step's phases; the allocator times its own on it
  allocator = allocation.make_allocator(config, sample_fn, tokenizer, task, stream, timer)
  host = {"rollouts": 0, "completion_tokens": 0, "reward_errors": 0}

  # Only now, after every input has been checked, is anything written.
  os.makedirs(workdir, exist_ok=True)
  _check_same_run(config, workdir)
  ckpt = checkpoint_lib.Checkpointer(workdir, config.checkpoint.keep)
  start = ckpt.latest_step() or 0
  budget = config.total_rollouts
  k = config.eval.k
  tb_dir = os.path.join(workdir, "tensorboard")
  paths = {"metrics": os.path.join(workdir, "metrics.jsonl"),
           "tensorboard": tb_dir if os.path.isdir(tb_dir) else None,
           "checkpoints": ckpt.directory}
  if start >= config.total_steps or (start and budget and
                                     ckpt.host(start).get("rollouts", 0) >= budget):
    # A finished run started again: say so, and print the same summary.
    ckpt.close()
    records = metrics_lib.read_metrics(workdir)
    console.say(f"grpo_jax: {workdir} is complete ({start}/{config.total_steps} steps"
                + (f", rollout budget {budget:,}" if budget else "") + "); nothing to do.")
    console.say(console.summary(records, k, {**paths, **_report_paths(workdir)},
                                config.total_steps, budget))
    evals = [r for r in records if f"eval/mean_at_{k}" in r]
    return {key: v for key, v in evals[-1].items() if key.startswith("eval/")} if evals else {}
  # Only process 0 writes metrics and logs (console.say is silent on the others).
  writer = (metrics_lib.MetricWriter if sharding_lib.is_primary() else metrics_lib.NullWriter)(
      workdir)
  paths["tensorboard"] = writer.tensorboard_dir
  timers = dict.fromkeys(metrics_lib.PHASES, 0.0)  # cumulative seconds, restarts included
  if start:
    start, (state, replay, saved) = _restore_newest_readable(ckpt, state, replay)
    host.update({key: saved[key] for key in host})
    allocator.load_state_dict(saved["allocator"])
    last_step = [r for r in metrics_lib.read_metrics(workdir) if "loss" in r]
    if last_step:  # time spent before the restart keeps counting
      timers.update({name: last_step[-1].get(f"time_{name}_s", 0.0) for name in timers})
  console.say(f"grpo_jax: {'resuming at step ' + str(start) if start else 'starting'}; "
              f"{config.total_steps} steps of {r.batch_prompts} prompts x {r.group_size} "
              f"rollouts\n  metrics      {writer.path}\n  checkpoints  {ckpt.directory}\n"
              f"  replay buffer: {replay.capacity} entries, {replay.nbytes:,} bytes")

  train_step = step_lib.make_train_step(
      graphdef, tx, configuration.step_config(config),
      None if mesh is None else sharding_lib.step_shardings(mesh, state, replay, ref_params))
  eval_problems = task.eval_problems(config.eval.num_prompts)
  render = stream.render

  def evaluate_now(step):
    with timer.phase("evaluation"):
      return _evaluate(config, graphdef, state.params, tokenizer, task, eval_problems, render,
                       mesh)

  def write_eval(step, result):
    writer.write(step, {**result, "rollouts": host["rollouts"]})
    console.say(console.eval_line(step, result, host["rollouts"], k))

  last_eval = {}
  if start == 0:
    last_eval = evaluate_now(0)
    write_eval(0, last_eval)
  for name, seconds in timer.take().items():  # the first evaluation belongs to no step
    timers[name] += seconds
  try:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm(total=config.total_steps, initial=start, dynamic_ncols=True, leave=False,
               file=sys.stdout, disable=not sharding_lib.is_primary())
  except ImportError:
    bar = None
  pending = None  # the last step's record: its device metrics are fetched one step late
  t_start, tokens_at_start = time.time(), host["completion_tokens"]
  window = [time.perf_counter()]  # when the current step's time window opened
  stop = _StopSignals()
  skips = 0  # consecutive steps the device skipped for a non-finite loss or gradient

  def save(done):
    with timer.phase("checkpoint"):
      ckpt.save(done, state, replay, {**host, "allocator": allocator.state_dict(),
                                      "prompts_skipped": stream.skipped, "seed": config.seed})

  def close_window() -> dict:
    """Ends the current step's time window: its per-phase seconds (``time/<phase>_s``, "other"
    being whatever no phase timed) and wall time, added to the run's cumulative ``timers``."""
    now = time.perf_counter()
    seconds = timer.take()
    step_s = now - window[0]
    window[0] = now
    seconds["other"] = max(step_s - sum(seconds.values()), 0.0)
    for name, v in seconds.items():
      timers[name] = timers.get(name, 0.0) + v
    return {"time/step_s": step_s, **{f"time/{name}_s": seconds.get(name, 0.0)
                                      for name in metrics_lib.PHASES}}

  def fetch(pending):
    """The step's device metrics (waited for here); stops the run after too many skips."""
    nonlocal skips
    if pending["values"] is not None:
      return
    pending["values"] = values = {key: float(v)
                                  for key, v in jax.device_get(pending["metrics"]).items()}
    skips = skips + 1 if values.get("skipped") else 0
    limit = config.rl.max_consecutive_skips
    if limit and skips >= limit:
      if "timing" not in pending:  # fetched before its evaluation: the step ends here
        pending["timing"], pending["cumulative"] = close_window(), dict(timers)
      _log_step(writer, bar, pending, last_eval, config, tokens_at_start)
      save(pending["step"])
      raise TrainingStopped(
          f"{skips} consecutive steps skipped for a non-finite loss or gradient (last: step "
          f"{pending['step']}); parameters, optimiser state and buffer are those of the last "
          f"good step, saved in {ckpt.directory} at step {pending['step']}. Check the rewards "
          "and the learning rate (rl.max_consecutive_skips sets this limit; 0 never stops).")

  def flush(pending):
    """Fetches (if not yet) and writes the step's record; its time window must be closed."""
    fetch(pending)
    _log_step(writer, bar, pending, last_eval, config, tokens_at_start)

  try:
    for step in range(start, config.total_steps):
      key = keys.train_step_key(config.seed, step)
      rollouts_before = host["rollouts"]
      # B complete groups, however the allocator spent its rollouts (allocation/allocator.py);
      # it times its phases (prompts, generation, scoring, assembly) on ``timer``.
      rollout, stats = allocator.collect(state.params, step, keys.generation(key))
      for name in host:
        host[name] += stats[name]
      with timer.phase("update"):
        state, replay, step_metrics = train_step(state, replay, rollout, ref_params,
                                                 keys.update(key))
        # Generation needs the new parameters anyway, so waiting here costs no overlap and lets
        # the phases split the time honestly: "update" is dispatch plus the device's work.
        jax.block_until_ready(state.step)
      if pending is not None:  # the previous step's record, its metrics long computed
        with timer.phase("metrics"):
          flush(pending)
      done = step + 1
      pending = {"step": done, "metrics": step_metrics, "stats": stats, "host": dict(host),
                 "wall_s": max(time.time() - t_start, 1e-9), "values": None}
      spent = bool(budget) and host["rollouts"] >= budget
      last = done == config.total_steps or spent
      every = config.eval.every_rollouts
      evaluation = None
      if (every and host["rollouts"] // every > rollouts_before // every) or last or (
          not every and done % config.eval.every == 0):
        with timer.phase("metrics"):
          fetch(pending)  # a run stopped for non-finite steps stops before evaluating
        evaluation = evaluate_now(done)
      saved_now = done % config.checkpoint.every == 0 or last
      if saved_now:
        save(done)
      pending["timing"], pending["cumulative"] = close_window(), dict(timers)
      if evaluation is not None:  # the step's record, then its evaluation's
        flush(pending)
        pending = None
        last_eval = evaluation
        write_eval(done, evaluation)
      if last:
        break
      if stop.signal is not None:
        # Preempted: this step is finished; write it down and leave cleanly.
        if pending is not None:
          flush(pending)
          pending = None
        if not saved_now:
          save(done)
        if bar is not None:
          bar.close()
        writer.close()
        ckpt.close()
        console.say(f"grpo_jax: stopped by {stop.name} after step {done}; checkpoint saved in "
                    f"{ckpt.directory}. Run the same command to resume.")
        return last_eval
  finally:
    stop.restore()  # whatever ends the loop, the previous handlers come back
  if pending is not None:
    flush(pending)
  if bar is not None:
    bar.close()
  writer.close()
  ckpt.close()
  if sharding_lib.is_primary():
    console.say(console.summary(metrics_lib.read_metrics(workdir), k,
                                {**paths, **_report_paths(workdir, write=True)},
                                config.total_steps, budget))
  return last_eval


# Fields that may change between the runs of one workdir: how long, how often to evaluate,
# log and checkpoint, and the mesh (checkpoints restore onto any mesh; the values then differ
# only by float rounding). Anything else changes the trajectory.
_RESUMABLE_CHANGES = ("total_steps", "total_rollouts", "log_every", "eval.", "checkpoint.",
                      "mesh.")


def _check_same_run(config, workdir: str) -> None:
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
    a, b = flat(saved), flat(current)
    differ = sorted(key for key in set(a) | set(b) if a.get(key) != b.get(key)
                    and not key.startswith(_RESUMABLE_CHANGES))
    if differ:
      shown = ", ".join(f"{key} ({a.get(key)!r} -> {b.get(key)!r})" for key in differ[:6])
      raise configuration.ConfigError(
          f"{workdir} holds a run with another config: {shown}"
          + (f" (+{len(differ) - 6} more)" if len(differ) > 6 else "")
          + "; use another --workdir, or --config.checkpoint.allow_config_change=true to "
          "resume it anyway")
  if sharding_lib.is_primary():
    # Written beside it and renamed: in a multi-host resume the other processes read this file
    # while the primary rewrites it, and must see the old or the new file whole, never a
    # truncated one (rename is atomic on POSIX file systems).
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(current, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


class TrainingStopped(RuntimeError):
  """The run stopped itself (e.g. too many non-finite steps); the message says why and where
  the last good state was saved."""


class _StopSignals:
  """SIGTERM / SIGINT set a flag: the current step finishes, a checkpoint is written, the run
  exits 0. Later signals (e.g. a second Ctrl-C during the save) change nothing, so the save
  completes and the last good checkpoint is never torn by us."""

  def __init__(self):
    self.signal = None
    self._previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      try:
        self._previous[sig] = signal.signal(sig, self._handle)
      except ValueError:  # not the main thread (e.g. a notebook worker): no handler
        pass

  def _handle(self, signum, frame):
    del frame
    if self.signal is None:
      self.signal = signum
      console.say(f"grpo_jax: {signal.Signals(signum).name} received; finishing this step, "
                  "then saving a checkpoint")

  @property
  def name(self) -> str:
    return signal.Signals(self.signal).name if self.signal is not None else ""

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}


def _restore_newest_readable(ckpt, state, replay):
  """(step, restored) from the newest checkpoint that restores; a damaged one (killed during
  the save, truncated or corrupted files) is reported and the next older one is tried. Orbax
  never lists a save that did not finish (it writes to a temporary folder and renames)."""
  errors = []
  for step in sorted(ckpt.manager.all_steps(), reverse=True):
    try:
      restored = ckpt.restore(step, state, replay)
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


def _report_paths(workdir: str, write: bool = False) -> dict:
  """The run's report (summary table, plots), written now when asked; where it is."""
  out = os.path.join(workdir, "report")
  if write:
    try:
      written = report.write_report([workdir], out)
    except Exception as e:  # pylint: disable=broad-except
      console.say(f"grpo_jax: report not written ({e})")
      return {}
    plots = [p for p in written if p.endswith(".png")]
    return {"report": os.path.join(out, "summary.md"),
            "plots": ", ".join(plots) if plots else "(pip install matplotlib for plots)"}
  return {"report": out} if os.path.isdir(out) else {}


def _log_step(writer, bar, pending, last_eval, config, tokens_at_start):
  """Writes one step's record (its device metrics already fetched, one step after they were
  made) and moves the progress bar."""
  values, host_then, stats = pending["values"], pending["host"], pending["stats"]
  step, elapsed = pending["step"], pending["wall_s"]
  record = {**values, "rollouts": host_then["rollouts"],
            "completion_tokens": host_then["completion_tokens"],
            "reward_errors": host_then["reward_errors"],
            "truncated_fraction": stats["truncated_fraction"],
            **{k: v for k, v in stats.items() if k.startswith("alloc/")},
            "tokens_per_s": (host_then["completion_tokens"] - tokens_at_start) / elapsed,
            # Seconds since this process's loop started, at the end of this step's update
            # (earlier evaluations included; not resumed).
            "wall_s": elapsed,
            # This step's time window (metrics.PHASES; time/step_s is its wall time)...
            **pending["timing"],
            # ... and the run's cumulative seconds per phase, restarts included.
            **{f"time_{name}_s": v for name, v in pending["cumulative"].items()}}
  if step % config.log_every == 0 or values.get("skipped"):
    writer.write(step, record)
  if bar is not None:
    acc = last_eval.get(f"eval/mean_at_{config.eval.k}", float("nan"))
    bar.n = step
    bar.set_postfix(acc=f"{acc:.3f}", success=f"{values['success_mean']:.2f}",
                    rollouts=host_then["rollouts"], tok_s=f"{record['tokens_per_s']:.0f}",
                    refresh=False)
    bar.refresh()


def main(argv):
  del argv
  config = flags.FLAGS.config
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/grpo.py")
  name = os.path.splitext(os.path.basename(
      config_flags.get_config_filename(flags.FLAGS["config"])))[0]
  workdir = flags.FLAGS.workdir or os.path.join("runs", name)
  console.quiet_unless_verbose()
  try:
    train_and_evaluate(config, workdir)
  except (configuration.ConfigError, CheckpointError, OSError,
          tokenization.PromptTooLongError, TrainingStopped, sharding_lib.MeshError) as e:
    # User errors (config, paths, data) and the machine's (a full disk, a folder that cannot be
    # written) end with one readable line, not a traceback.
    sys.exit(f"grpo_jax.train: {e}")


def parse_flags(argv):
  """absl's flag parsing, with an unknown ``--config.x`` field or a value of the wrong type
  named in one line, not a traceback from inside ml_collections or absl."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # a value of the wrong type, e.g. --config.rollout.group_size=abc
    sys.exit(f"grpo_jax.train: {e}")
  except (AttributeError, KeyError) as e:
    name = str(e).strip("\"'")
    given = [a.split("=")[0][2:] for a in argv
             if a.startswith("--config.") and name in a.split("=")[0].split(".")]
    sys.exit(f"grpo_jax.train: unknown config field {given[0] if given else name!r}; the "
             "fields and their meaning are in configs/common.py")


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=parse_flags)
