"""The RL training loop: ``setup`` builds a ``Run`` from a config, ``run`` trains it.

Each step is prompts -> sampler -> host rewards (the allocator) -> jitted train step ->
metrics, with held-out evaluation every ``eval.every`` steps (or ``eval.every_rollouts``
rollouts), orbax checkpoints every ``checkpoint.every`` steps and automatic resume from the
newest readable checkpoint in the workdir. A step's device metrics are fetched one step late
(``records.StepRecord``), so that the host never waits for them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import transformers
from flax import nnx

from grpo_jax import allocation
from grpo_jax import configuration
from grpo_jax import console
from grpo_jax import errors
from grpo_jax import keys
from grpo_jax import sharding as sharding_lib
from grpo_jax import tasks as tasks_lib
from grpo_jax import timing
from grpo_jax.generate import prompts as prompts_lib
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.models import CheckpointError, from_pretrained, lora
from grpo_jax.models import family
from grpo_jax.rewards import scoring
from grpo_jax.rl import optim
from grpo_jax.rl import replay as replay_lib
from grpo_jax.rl import step as step_lib
from grpo_jax.run import checkpoint as checkpoint_lib
from grpo_jax.run import evaluate as evaluate_lib
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.run import preemption
from grpo_jax.run import records
from grpo_jax.run import workdir as workdir_lib


class TrainingStopped(RuntimeError):
  """The run stopped itself (e.g. too many non-finite steps); the message says why and where
  the last good state was saved."""


@dataclasses.dataclass(frozen=True)
class Setup:
  """What ``setup`` builds once; the loop reads it and never replaces a field.

  Attributes:
    config: the validated run config.
    workdir: the run's folder.
    mesh: the device mesh (None on a single device).
    tokenizer: the model's tokenizer.
    task: the task (``tasks.make_task``).
    stream: the prompt stream (``prompts.PromptStream``).
    allocator: spends each step's rollouts (``allocation.make_allocator``).
    graphdef: the model's structure (evaluation merges it with the state's parameters).
    train_step: the jitted step ``(state, replay, rollout, ref_params, rng)``, state and buffer
      donated.
    ref_params: the frozen reference's parameters (None without a KL term).
    ckpt: the workdir's Checkpointer.
    writer: the MetricWriter (a NullWriter on processes other than 0 and for a complete run).
    paths: where the run's outputs are, for the summary.
    scorer: scores the rows and the held-out completions (``scoring.make_scorer``).
    eval_sets: the held-out problems by set name ("" for a task's one unnamed set).
    timer: the PhaseTimer of the step under way (the allocator times its phases on it too).
    start: the step the loop starts at (a restored checkpoint's, or 0).
    complete: the run had ended already: nothing to train.
  """

  config: Any
  workdir: str
  mesh: Any
  tokenizer: Any
  task: Any
  stream: prompts_lib.PromptStream
  allocator: Any
  graphdef: nnx.GraphDef
  train_step: Any
  ref_params: Any
  ckpt: checkpoint_lib.Checkpointer
  writer: Any
  paths: dict
  scorer: scoring.Scorer
  eval_sets: dict
  timer: timing.PhaseTimer
  start: int
  complete: bool


@dataclasses.dataclass
class Progress:
  """What the loop changes as it goes.

  Attributes:
    state: the TrainState, replaced by every step.
    replay: the ReplayState, replaced by every step.
    counters: the host counters (records.Counters).
    timers: cumulative seconds per phase (timing.PHASES), restarts included.
    last_eval: the latest evaluation's metrics ({} until there is one).
    pending: the last step's record until it is written (one step late), else None.
    skips: consecutive steps the device skipped for a non-finite loss or gradient.
    bar: the tqdm progress bar (None without tqdm, or before the loop).
    t_start: ``time.time()`` when the loop started.
    tokens_at_start: the completion tokens when the loop started.
    window_start: ``time.perf_counter()`` when the current step's time window opened.
  """

  state: Any
  replay: replay_lib.ReplayState
  counters: records.Counters
  timers: dict
  last_eval: dict = dataclasses.field(default_factory=dict)
  pending: records.StepRecord | None = None
  skips: int = 0
  bar: Any = None
  t_start: float = 0.0
  tokens_at_start: int = 0
  window_start: float = 0.0


@dataclasses.dataclass(frozen=True)
class Run:
  """A run: ``setup`` (built once) and ``progress`` (what the loop changes)."""

  setup: Setup
  progress: Progress


def setup(config, workdir: str) -> Run:
  """Checks ``config``, builds everything the loop needs and restores the newest readable
  checkpoint of ``workdir`` (nothing is written before every input has been checked)."""
  configuration.validate(config)
  # Multi-host: every process runs this same function on the same prompts (README: Sharding).
  sharding_lib.initialize_distributed(config.mesh)
  mesh = sharding_lib.mesh_from_config(config)  # None on a single device
  configuration.check_mesh(config, mesh)
  r = config.rollout
  configuration.check_backend(config)  # training runs the attention kernel: it must exist here
  for note in configuration.backend_notes(config, jax.default_backend()):
    console.say(note)
  tokenizer = transformers.AutoTokenizer.from_pretrained(config.model.path)
  graphdef, params = load_model(config, tokenizer, mesh)
  # The reference must own its buffers: the state's parameters are donated every step. Under
  # LoRA the step takes the base (adapters off) as the reference: no copy is made.
  copy_ref = config.rl.loss.kl_coef > 0 and not lora.has_adapters(params)
  ref_params = frozen_reference(params, config.model.dtype) if copy_ref else None
  tx = optim.make_optimizer(config)
  state = step_lib.init_train_state(params, tx, mesh)
  replay = init_replay(config, mesh)
  if mesh is None:
    # A restored state comes back committed to its device; the fresh one is committed too, so
    # that a run and its resume compile the same programs (one persistent-cache entry each).
    state, replay = jax.device_put((state, replay), jax.devices()[0])
  task = tasks_lib.make_task(config)
  stream = prompts_lib.PromptStream(task, tokenizer, r.prompt_len, config.task.chat_template,
                                    train_size=config.task.train_size)
  sample_fn = sampler_lib.make_sampler(graphdef, sampler_lib.sampling_config_for(
      tokenizer, r.completion_len, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
      model_path=config.model.path,
      prompt_group=r.group_size if config.rl.shared_prompts else 1,
      row_block=r.sampler_rows), mesh)
  timer = timing.PhaseTimer()  # this step's phases; the allocator times its own on it
  scorer = scoring.make_scorer(config, task)  # the user's reward functions load here
  allocator = allocation.make_allocator(config, sample_fn, tokenizer, task, stream, timer, scorer)

  # Only now, after every input has been checked, is anything written.
  os.makedirs(workdir, exist_ok=True)
  workdir_lib.check_same_run(config, workdir)
  ckpt = checkpoint_lib.Checkpointer(workdir, config.checkpoint.keep)
  start = ckpt.latest_step() or 0
  complete = workdir_lib.is_complete(config, ckpt, start)
  tensorboard = os.path.join(workdir, "tensorboard")
  tensorboard = tensorboard if os.path.isdir(tensorboard) else None  # before a writer makes it
  # Only process 0 writes metrics and logs (console.say is silent on the others).
  writer = (metrics_lib.MetricWriter if sharding_lib.is_primary() and not complete
            else metrics_lib.NullWriter)(workdir)
  counters, timers = records.Counters(), dict.fromkeys(timing.PHASES, 0.0)
  if start and not complete:
    start, (state, replay, saved) = workdir_lib.restore_newest_readable(ckpt, state, replay)
    counters = records.Counters.from_host(saved)
    allocator.load_state_dict(saved["allocator"])
    timers = workdir_lib.resumed_timers(workdir, timers)
  shardings = None if mesh is None else sharding_lib.step_shardings(
      mesh, state, replay, family.param_axes(), ref_params)
  train_step = step_lib.make_train_step(graphdef, tx, configuration.step_config(config), shardings)
  return Run(
      setup=Setup(
          config=config, workdir=workdir, mesh=mesh, tokenizer=tokenizer, task=task,
          stream=stream, allocator=allocator, graphdef=graphdef, train_step=train_step,
          ref_params=ref_params, ckpt=ckpt, writer=writer,
          paths={"metrics": os.path.join(workdir, "metrics.jsonl"),
                 "tensorboard": tensorboard if complete else writer.tensorboard_dir,
                 "checkpoints": ckpt.directory},
          scorer=scorer, eval_sets=_eval_sets(config, task, stream), timer=timer, start=start,
          complete=complete),
      progress=Progress(state=state, replay=replay, counters=counters, timers=timers))


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
  elif sharding_lib.is_primary():
    console.say(console.summary(metrics_lib.read_metrics(s.workdir), s.config.eval.k,
                                {**s.paths, **workdir_lib.report_paths(s.workdir, write=True,
                                                                     k=s.config.eval.k)},
                                s.config.total_steps, s.config.total_rollouts,
                                s.config.total_tokens))
  return p.last_eval


def frozen_reference(params, dtype: str):
  """The KL reference's parameters: a copy of ``params`` (the state's are donated every step)
  with every floating array in the compute ``dtype``. Every layer casts its weights to the
  compute dtype where it uses them, so the reference computes exactly what a float32 copy
  would, in half the memory under bfloat16 matmuls (2 bytes a parameter instead of 4)."""
  dtype = jnp.dtype(dtype)
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.copy(x),
      params)


def load_model(config, tokenizer, mesh) -> tuple[nnx.GraphDef, Any]:
  """The policy's (graphdef, params) from ``config.model.path``, checked against the
  tokenizer; with ``model.lora.rank`` > 0 the base is stored in the compute dtype (it is never
  updated, so it needs no float32 master copy) and carries fresh adapters (``lora.attach``,
  drawn from ``keys.lora_init`` of the seed). Builds on any backend: a model configured with
  an accelerator's attention kernel is only refused where attention runs (``setup``)."""
  adapters = lora.from_config(config.model)
  param_dtype = config.model.dtype if adapters else config.model.param_dtype
  model = from_pretrained(config.model.path, param_dtype=param_dtype,
                          dtype=config.model.dtype, mesh=mesh,
                          attention=config.model.attention,
                          attention_block=config.model.attention_block)
  if len(tokenizer) > model.config.vocab_size:
    raise CheckpointError(
        f"the tokenizer in {config.model.path} has {len(tokenizer):,} tokens but the model's "
        f"embedding has {model.config.vocab_size:,} rows: they do not belong together")
  if adapters:
    try:
      lora.attach(model, adapters, nnx.Rngs(params=keys.lora_init(config.seed)))
    except ValueError as e:
      raise errors.ConfigError(f"config.model.lora: {e}") from None
  return nnx.split(model)


def _eval_sets(config, task, stream) -> dict:
  """The task's held-out sets, ``eval.num_prompts`` each, of prompts no longer than
  ``rollout.prompt_len``: a named set's first that fit (the longer ones are counted and said), a
  generated set's first (the generator's prompts fit; one that does not is said and left out).
  A set left empty is a ConfigError."""
  n = config.eval.num_prompts
  named = hasattr(task, "eval_sets")  # finite files: read whole, filtered, then cut to n
  sets = tasks_lib.eval_sets(task, None if named else n)
  for name, problems in sets.items():
    kept = [p for p in problems if stream.fits(stream.render(p))]
    label = f"held-out set {name!r}" if name else "the held-out set"
    errors.check(
        bool(kept), "rollout.prompt_len", f"no prompt of {label} fits in {stream.prompt_len} "
        "tokens: raise it")
    if len(kept) < len(problems):
      console.say(f"grpo_jax: {len(problems) - len(kept)} of {len(problems)} prompts of {label} "
                  f"are longer than rollout.prompt_len={stream.prompt_len}: left out")
    sets[name] = kept[:n]
  return sets


def init_replay(config, mesh) -> replay_lib.ReplayState:
  """The empty replay buffer of the configured method (laid out on the mesh, if any)."""
  r = config.rollout
  method = configuration.replay_method(config)
  replay = replay_lib.init_replay(config.replay.capacity, method.entry_size(r.group_size),
                                  r.prompt_len, r.completion_len)
  if mesh is not None:
    replay = sharding_lib.put(replay, sharding_lib.replay_shardings(mesh, replay))
  return replay


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
  key = keys.train_step_key(config.seed, step)
  before = p.counters
  _progress_for_rewards(run, step)
  # B complete groups, however the allocator spent its rollouts (allocation/allocator.py); it
  # times its phases (prompts, generation, scoring, assembly) on ``timer``.
  rollout, stats = s.allocator.collect(p.state.params, step, keys.generation(key))
  p.counters = p.counters.add(stats)
  _, logged = s.scorer.take_log(training=True)
  if logged:  # a reward function logged columns (TRL's log_extra): the step's completions
    s.writer.write_completions(f"step_{step + 1:06d}", logged)
  with timer.phase("update"):
    p.state, p.replay, device_metrics = s.train_step(p.state, p.replay, rollout,
                                                           s.ref_params, keys.update(key))
    # Generation needs the new parameters anyway, so waiting here costs no overlap and lets
    # the phases split the time honestly: "update" is dispatch plus the device's work.
    jax.block_until_ready(p.state.step)
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
  state.is_world_process_zero = state.is_local_process_zero = sharding_lib.is_primary()


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
  if not sharding_lib.is_primary() or not sys.stdout.isatty():
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
