"""The RL training loop: ``run`` trains a ``Run`` (``grpo_jax.run.build.setup`` builds it).

Each step is prompts -> sampler -> host rewards (the allocator) -> jitted train step ->
metrics, with held-out evaluation every ``eval.every`` steps (or ``eval.every_rollouts``
rollouts), orbax checkpoints every ``checkpoint.every`` steps and automatic resume from the
newest readable checkpoint in the workdir. A step's device metrics are fetched one step late
(``records.StepRecord``), so that the host never waits for them.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax

from grpo_jax import console
from grpo_jax import distributed
from grpo_jax import random_keys
from grpo_jax.run import evaluate as evaluate_lib
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.run import preemption
from grpo_jax.run import records
from grpo_jax.run import workdir as workdir_lib
from grpo_jax.run.build import Run


class TrainingStopped(RuntimeError):
  """The run stopped itself (e.g. too many non-finite steps); the message says why and where
  the last good state was saved."""


def run(run: Run) -> dict:  # pylint: disable=redefined-outer-name
  """Trains ``run`` to its end (``total_steps`` or the rollout budget), or until a SIGTERM or
  SIGINT (the step under way finishes and is saved); returns the last evaluation's metrics.

  A complete run says so and prints its summary again. Whatever ends the loop, the signal
  handlers from before come back; a run that ends without an error then writes its last step
  record, closes its writers and checkpointer and prints how it ended.
  """
  s, p = run.setup, run.progress
  if s.complete:
    return _report_complete(run)
  _say_start(run)
  if s.start == 0:
    p.last_eval = _evaluate(run, 0)
    _write_eval(run, 0, p.last_eval)
  records.accumulate(p.timers, s.timer.take())  # the first evaluation belongs to no step
  p.bar = _progress_bar(run)
  p.t_start, p.tokens_at_start = time.time(), p.counters.completion_tokens
  p.window_start = time.perf_counter()
  stop = preemption.StopSignals()
  try:
    stopped_after = _train(run, stop)
  finally:
    stop.restore()
    s.scorer.close()
  _flush_pending(run)
  if p.bar is not None:
    p.bar.close()
  s.writer.close()
  s.ckpt.close()
  if stopped_after is not None:
    console.say(f"grpo_jax: stopped by {stop.name} after step {stopped_after}; checkpoint "
                f"saved in {s.ckpt.directory}. Run the same command to resume.")
  elif distributed.is_primary():
    console.say(console.summary(metrics_lib.read_metrics(s.workdir), s.config.eval.k,
                                {**s.paths, **workdir_lib.report_paths(s.workdir, write=True,
                                                                     k=s.config.eval.k)},
                                s.config.total_steps, s.config.total_rollouts,
                                s.config.total_tokens))
  return p.last_eval


def _train(run: Run, stop: preemption.StopSignals) -> int | None:
  """The steps from ``run.setup.start`` to the end; returns the step a signal stopped the run after
  (that step's record written and its checkpoint saved, while further signals are still
  ignored), or None when the run reached its end."""
  s = run.setup
  for step in range(s.start, s.config.total_steps):
    done, last, saved = _step(run, step)
    if last:
      break
    if stop.signal is not None:
      # Preempted: this step is finished; write it down and leave cleanly.
      _flush_pending(run)
      if not saved:
        _save(run, done)
      return done
  return None


def _step(run: Run, step: int) -> tuple[int, bool, bool]:
  """Train step ``step`` and what follows it: the previous step's record, then this step's
  evaluation and checkpoint when due. Returns (steps done, whether the run ends with it,
  whether it was saved)."""
  s, p = run.setup, run.progress
  config, timer = s.config, s.timer
  key = random_keys.train_step_key(config.seed, step)
  before = p.counters
  _progress_for_rewards(run, step)
  # B complete groups, however the allocator spent its rollouts (allocation/allocator.py); it
  # times its phases (prompts, generation, scoring, assembly) on ``timer``.
  rollout, stats = s.allocator.collect(p.state.params, step, random_keys.generation(key))
  _, logged = s.scorer.take_log(training=True)
  if logged:  # a reward function logged columns (TRL's log_extra): the step's completions
    s.writer.write_completions(f"step_{step + 1:06d}", logged)
  with timer.phase("update"):
    p.state, p.replay, device_metrics = s.train_step(p.state, p.replay, rollout,
                                                           s.ref_params, random_keys.update(key))
    if not config.rollout.devices:
      # Generation needs the new parameters anyway, so waiting here costs no overlap and lets
      # the phases split the time honestly: "update" is dispatch plus the device's work.
      jax.block_until_ready(p.state.step)
  # With generation on its own devices, it runs while the update does (its "generation"
  # time), then holds the new parameters (generate/asynchronous.py); what it generated then
  # is the step's too, so the counters add up after it.
  stats.update(s.allocator.overlap(p.state.params, step))
  p.counters = p.counters.add(stats)
  if p.pending is not None:  # the previous step's record, its metrics long computed
    with timer.phase("metrics"):
      _flush_pending(run)
  done = step + 1
  record = p.pending = records.StepRecord(
      step=done, metrics=device_metrics, stats=stats, counters=p.counters,
      wall_s=max(time.time() - p.t_start, 1e-9))
  last = done == config.total_steps or workdir_lib.budget_spent(
      config, dataclasses.asdict(p.counters))
  evaluation = None
  if last or _evaluation_due(config, before, p.counters, done):
    with timer.phase("metrics"):
      _fetch(run, record)  # a run stopped for non-finite steps stops before evaluating
    evaluation = _evaluate(run, done)
  saved = done % config.checkpoint.every == 0 or last
  if saved:
    _save(run, done)
  record.timing, record.cumulative = _close_window(run), dict(p.timers)
  if evaluation is not None:  # the step's record, then its evaluation's
    _flush_pending(run)
    p.last_eval = evaluation
    _write_eval(run, done, evaluation)
  return done, last, saved


def _progress_for_rewards(run: Run, done: int) -> None:
  """The ``trainer_state`` reward functions see (``reward_calls.TrainerState``), at ``done``
  completed steps: the loop's step and counters, the epoch of a finite training set."""
  s, p = run.setup, run.progress
  config, state = s.config, s.scorer.state
  size = s.stream.train_size or s.task.num_train_problems()
  state.global_step, state.max_steps = done, config.total_steps
  state.epoch = s.stream.position / size if size else None
  state.rollouts, state.completion_tokens = p.counters.rollouts, p.counters.completion_tokens
  state.max_rollouts, state.max_tokens = config.total_rollouts, config.total_tokens
  state.is_world_process_zero = state.is_local_process_zero = distributed.is_primary()


def _evaluation_due(config, before: records.Counters, after: records.Counters,
                    done: int) -> bool:
  """Whether the step that took the counters from ``before`` to ``after`` (and the run to
  ``done`` steps) is followed by an evaluation (the last step always is): each
  ``eval.every_rollouts`` rollouts, or ``eval.every_tokens`` completion tokens, or
  ``eval.every`` steps."""
  e = config.eval
  if e.every_rollouts:
    return after.rollouts // e.every_rollouts > before.rollouts // e.every_rollouts
  if e.every_tokens:
    return (after.completion_tokens // e.every_tokens
            > before.completion_tokens // e.every_tokens)
  return done % e.every == 0


def _close_window(run: Run) -> dict:
  """Ends the current step's time window: its ``time/`` fields (records.window), its seconds
  added to the run's cumulative ``timers``."""
  s, p = run.setup, run.progress
  now = time.perf_counter()
  seconds = s.timer.take()
  step_s = now - p.window_start
  p.window_start = now
  timing, seconds = records.window(seconds, step_s)
  records.accumulate(p.timers, seconds)
  return timing


def _fetch(run: Run, record: records.StepRecord) -> None:
  """The step's device metrics (waited for here); stops the run after too many skips."""
  s, p = run.setup, run.progress
  if record.values is not None:
    return
  record.values = {key: float(v) for key, v in jax.device_get(record.metrics).items()}
  p.skips = p.skips + 1 if record.values.get("skipped") else 0
  limit = s.config.rl.max_consecutive_skips
  if limit and p.skips >= limit:
    if record.timing is None:  # fetched before its evaluation: the step ends here
      record.timing, record.cumulative = _close_window(run), dict(p.timers)
    _log_step(run, record)
    _save(run, record.step)
    if record.values.get("prompts_repeat", 1.0) < 1.0:
      raise TrainingStopped(
          f"{p.skips} consecutive steps skipped: a minibatch's groups do not each repeat one "
          f"prompt (last: step {record.step}), which the shared-prompt gradient needs "
          "(rl.shared_prompts=false runs every row on its own); nothing was trained on them, "
          f"and the last good step is saved in {s.ckpt.directory}.")
    raise TrainingStopped(
        f"{p.skips} consecutive steps skipped for a non-finite loss or gradient (last: step "
        f"{record.step}); parameters, optimiser state and buffer are those of the last good "
        f"step, saved in {s.ckpt.directory} at step {record.step}. Check the rewards and "
        "the learning rate (rl.max_consecutive_skips sets this limit; 0 never stops).")


def _flush_pending(run: Run) -> None:
  """Fetches (if not yet) and writes the pending step record, whose time window is closed."""
  p = run.progress
  if p.pending is None:
    return
  _fetch(run, p.pending)
  _log_step(run, p.pending)
  p.pending = None


def _log_step(run: Run, record: records.StepRecord) -> None:
  """Writes one step's record (its device metrics already fetched, one step after they were
  made) and moves the progress bar."""
  s, p = run.setup, run.progress
  config, values = s.config, record.values
  fields = record.fields(p.tokens_at_start)
  if record.step % config.log_every == 0 or values.get("skipped"):
    s.writer.write(record.step, fields)
  if p.bar is not None:
    acc = p.last_eval.get(f"eval/mean_at_{config.eval.k}", float("nan"))
    p.bar.n = record.step
    p.bar.set_postfix(acc=f"{acc:.3f}", success=f"{values['success_mean']:.2f}",
                        rollouts=record.counters.rollouts, tok_s=f"{fields['tokens_per_s']:.0f}",
                        refresh=False)
    p.bar.refresh()


def _save(run: Run, done: int) -> None:
  """Checkpoints the state, the buffer and the host side after ``done`` steps."""
  s, p = run.setup, run.progress
  with s.timer.phase("checkpoint"):
    s.ckpt.save(done, p.state, p.replay,
                  {**dataclasses.asdict(p.counters), "allocator": s.allocator.state_dict(),
                   "prompts_skipped": s.stream.skipped, "seed": s.config.seed})


def _evaluate(run: Run, done: int) -> dict:
  """The held-out evaluation of the current parameters (after ``done`` steps) on each set:
  ``eval/mean_at_<k>``, ``eval/pass_at_<k>``, mean length, constant fraction, and greedy
  accuracy when asked. A named set's metrics are ``eval/<set>/...``; the unprefixed ones pool
  every set's prompts (each a mean over prompts, so the pooled value is the sets' mean weighted
  by their sizes). What reward functions log (TRL's ``log_metric``) in the sampled evaluation
  is each set's ``reward/<name>``, not pooled; the columns they log (``log_extra``) go to
  ``completions/eval_<done>.jsonl``, each row with its set."""
  s, p = run.setup, run.progress
  config = s.config
  r, e = config.rollout, config.eval
  kw = dict(prompt_len=r.prompt_len, completion_len=r.completion_len, seed=config.seed,
            render=s.stream.render, model_path=config.model.path, mesh=s.mesh,
            scorer=s.scorer)
  _progress_for_rewards(run, done)
  per_set, sizes, logged, rows = {}, {}, {}, []
  with s.timer.phase("evaluation"):
    for name, problems in s.eval_sets.items():
      evaluate = lambda k, temperature, problems=problems: evaluate_lib.evaluate(
          s.graphdef, p.state.params, s.tokenizer, s.task, problems, k=k,
          temperature=temperature, **kw)
      out = evaluate(e.k, e.temperature)
      logged[name], set_rows = s.scorer.take_log(training=False)
      rows += [{"set": name, **row} for row in set_rows]
      result = {f"mean_at_{e.k}": out["mean_at_k"], f"mean_at_{e.k}_se": out["mean_at_k_se"],
                f"pass_at_{e.k}": out["pass_at_k"], "mean_length": out["mean_length"],
                "constant_fraction": out["constant_fraction"],
                "truncated_fraction": out["truncated_fraction"]}
      if e.greedy:
        result["greedy_accuracy"] = evaluate(1, 0.0)["mean_at_k"]
        s.scorer.take_log(training=False)  # the greedy pass's logs: not the sampled set's
      per_set[name], sizes[name] = result, len(problems)
  if rows:
    s.writer.write_completions(f"eval_{done:06d}", rows)
  user = {f"eval/{n + '/' if n else ''}reward/{m}": v
          for n, metrics in logged.items() for m, v in metrics.items()}
  if list(per_set) == [""]:
    return {**{f"eval/{key}": v for key, v in per_set[""].items()}, **user}
  pooled = {f"eval/{key}": v for key, v in evaluate_lib.pool(per_set, sizes).items()}
  return {**pooled, **{f"eval/{n}/{key}": v for n, res in per_set.items()
                       for key, v in res.items()}, **user}


def _write_eval(run: Run, step: int, result: dict) -> None:
  """Writes an evaluation's record and its console line."""
  s, p = run.setup, run.progress
  s.writer.write(step, {**result, "rollouts": p.counters.rollouts})
  console.say(console.eval_line(step, result, p.counters.rollouts, s.config.eval.k))


def _say_start(run: Run) -> None:
  s, p = run.setup, run.progress
  r = s.config.rollout
  console.say(f"grpo_jax: {'resuming at step ' + str(s.start) if s.start else 'starting'}; "
              f"{s.config.total_steps} steps of {r.batch_prompts} prompts x {r.group_size} "
              f"rollouts\n  metrics      {s.writer.path}\n  checkpoints  "
              f"{s.ckpt.directory}\n  replay buffer: {p.replay.capacity} entries, "
              f"{p.replay.nbytes:,} bytes")


def _progress_bar(run: Run):
  """A tqdm bar of the steps on stdout when it is a terminal (process 0 only), else None: a
  bar redraws itself with carriage returns, which in a file or a pipe share lines with the
  evaluation lines; there the evaluation lines are the progress."""
  s = run.setup
  if not distributed.is_primary() or not sys.stdout.isatty():
    return None
  try:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return tqdm(total=s.config.total_steps, initial=s.start, dynamic_ncols=True, leave=False,
              file=sys.stdout)


def _report_complete(run: Run) -> dict:
  """A finished run started again: says so, prints the same summary and returns the last
  evaluation's metrics."""
  s = run.setup
  config, workdir = s.config, s.workdir
  k, budget, tokens = config.eval.k, config.total_rollouts, config.total_tokens
  s.ckpt.close()
  written = metrics_lib.read_metrics(workdir)
  console.say(f"grpo_jax: {workdir} is complete ({s.start}/{config.total_steps} steps"
              + (f", rollout budget {budget:,}" if budget else "")
              + (f", token budget {tokens:,}" if tokens else "") + "); nothing to do.")
  console.say(console.summary(written, k, {**s.paths, **workdir_lib.report_paths(workdir)},
                              config.total_steps, budget, tokens))
  evals = [r for r in written if f"eval/mean_at_{k}" in r]
  return {key: v for key, v in evals[-1].items() if key.startswith("eval/")} if evals else {}
