"""What a run builds once, and the state its loop changes: ``setup(config, workdir)`` checks the
config, loads the model (``load_model``), makes the KL reference (``frozen_reference``), the
replay buffer (``init_replay``), the sampler, allocator, scorer and held-out sets, restores the
newest readable checkpoint, and returns a ``Run``: ``Setup`` (frozen) and ``Progress`` (what
``grpo_jax.run.loop`` changes as it trains). Nothing is written before every input is checked.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import transformers
from flax import nnx

from grpo_jax import allocation
from grpo_jax import configuration
from grpo_jax import console
from grpo_jax import distributed
from grpo_jax import errors
from grpo_jax import random_keys
from grpo_jax import sharding as sharding_lib
from grpo_jax import tasks as tasks_lib
from grpo_jax import timing
from grpo_jax.generate import asynchronous
from grpo_jax.generate import producer as producer_lib
from grpo_jax.generate import prompts as prompts_lib
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.generate import static_round
from grpo_jax.generate import transfer
from grpo_jax.models import CheckpointError, from_pretrained, lora
from grpo_jax.models import family
from grpo_jax.rewards import scoring
from grpo_jax.rl import optim
from grpo_jax.rl import replay as replay_lib
from grpo_jax.rl import step as step_lib
from grpo_jax.run import checkpoint as checkpoint_lib
from grpo_jax.run import metrics as metrics_lib
from grpo_jax.run import records
from grpo_jax.run import workdir as workdir_lib


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
  settings = configuration.validate(config)
  # Multi-host: every process runs this same function on the same prompts (README: Sharding).
  distributed.initialize(config.mesh)
  r = config.rollout
  if settings.generation_devices:  # generation on its own devices: two meshes of >= 1 device
    generation_mesh, mesh = sharding_lib.split(settings.generation_mesh, settings.mesh,
                                               settings.generation_devices)
  else:
    generation_mesh, mesh = None, sharding_lib.run_mesh(settings.mesh)  # None on one device
  configuration.check_mesh(config, mesh, generation_mesh)
  configuration.check_backend(config)  # training runs the attention kernel: it must exist here
  for note in configuration.backend_notes(config, jax.default_backend()):
    console.say(note)
  tokenizer = transformers.AutoTokenizer.from_pretrained(config.model.path)
  graphdef, params = load_model(settings.model, tokenizer, mesh)
  # The reference must own its buffers: the state's parameters are donated every step. Under
  # LoRA the step takes the base (adapters off) as the reference: no copy is made.
  copy_ref = config.rl.loss.kl_coef > 0 and not lora.has_adapters(params)
  ref_params = frozen_reference(params, config.model.dtype) if copy_ref else None
  tx = optim.make_optimizer(settings.optimizer)
  state = step_lib.init_train_state(params, tx, mesh)
  replay = init_replay(settings.replay, config, mesh)
  if mesh is None:
    # A restored state comes back committed to its device; the fresh one is committed too, so
    # that a run and its resume compile the same programs (one persistent-cache entry each).
    state, replay = jax.device_put((state, replay), jax.devices()[0])
  task = tasks_lib.make_task(config)
  stream = prompts_lib.PromptStream(task, tokenizer, r.prompt_len, config.task.chat_template,
                                    train_size=config.task.train_size)
  sampling = sampler_lib.sampling_config_for(
      tokenizer, r.completion_len, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
      model_path=config.model.path,
      prompt_group=r.group_size if config.rl.shared_prompts else 1,
      row_block=r.sampler_rows)
  # Static rounds on the slot pool (``generate/static_round.py``): the sampler's tokens.
  sample_fn = static_round.cached_round_fn(graphdef, sampling, mesh)
  timer = timing.PhaseTimer()  # this step's phases; the allocator times its own on it
  scorer = scoring.make_scorer(config, task)  # the user's reward functions load here
  allocator = allocation.make_allocator(
      config, sample_fn, tokenizer, task, stream, timer, scorer,
      make_producer=(producer_factory(config, graphdef, params, sampling,
                                      generation_mesh or mesh)
                     if settings.uses_pool else None),
      make_generator=(generator_factory(config, state.params, mesh, generation_mesh)
                      if settings.generation_devices else None),
      rule_spec=settings.rule, selector_spec=settings.selector)

  # Only now, after every input has been checked, is anything written.
  os.makedirs(workdir, exist_ok=True)
  workdir_lib.check_same_run(config, workdir)
  ckpt = checkpoint_lib.Checkpointer(workdir, config.checkpoint.keep)
  start = ckpt.latest_step() or 0
  complete = workdir_lib.is_complete(config, ckpt, start)
  tensorboard = os.path.join(workdir, "tensorboard")
  tensorboard = tensorboard if os.path.isdir(tensorboard) else None  # before a writer makes it
  # Only process 0 writes metrics and logs (console.say is silent on the others).
  writer = (metrics_lib.MetricWriter if distributed.is_primary() and not complete
            else metrics_lib.NullWriter)(workdir)
  counters, timers = records.Counters(), dict.fromkeys(timing.PHASES, 0.0)
  if start and not complete:
    start, (state, replay, saved) = workdir_lib.restore_newest_readable(ckpt, state, replay)
    counters = records.Counters.from_host(saved)
    allocator.load_state_dict(saved["allocator"])
    timers = workdir_lib.resumed_timers(workdir, timers)
  if settings.generation_devices:  # the generation mesh's copy of the (fresh or restored) params
    allocator.start_generator(state.params)
  shardings = None if mesh is None else sharding_lib.step_shardings(
      mesh, state, replay, family.param_axes(), ref_params)
  train_step = step_lib.cached_train_step(graphdef, tx, settings.step, shardings)
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


def producer_factory(config, graphdef, params, sampling, mesh=None):
  """``make_producer(prompts=...)``: the slot pool of ``rollout.partial``
  (``generate.producer.Producer``), its rows in groups of G sharing each prompt's prefill, split
  over the mesh's batch axes when there is one."""
  r = config.rollout
  return functools.partial(
      producer_lib.Producer, graphdef,
      dataclasses.replace(sampling, prompt_group=r.group_size, row_block=0),
      nnx.merge(graphdef, params).config, slots=r.slots or r.batch_prompts * r.group_size,
      prompt_len=r.prompt_len, chunk=r.chunk or max(1, r.completion_len // 32),
      max_staleness=r.max_staleness,
      reprefill=r.partial_cache == "reprefill", budget=r.decode_budget, mesh=mesh)


def generator_factory(config, params, mesh, generation_mesh):
  """``make_generator(producer)``: generation on its own devices (``rollout.devices``,
  ``generate.asynchronous.Generator``), the parameters laid out on the generation mesh by the
  same rules as on the training ``mesh`` and sent between them device to device
  (``generate.transfer``): under LoRA the adapters after each update, the base once."""
  r = config.rollout
  axes = family.param_axes()
  src = lora.trainable(sharding_lib.tree_shardings(mesh, params, axes))
  try:
    dst = lora.trainable(sharding_lib.tree_shardings(generation_mesh, params, axes))
  except sharding_lib.MeshError as e:  # its message names config.mesh: say which one
    raise sharding_lib.MeshError(str(e).replace("config.mesh", "config.rollout.generation_mesh")
                                 .replace("mesh.", "rollout.generation_mesh.")) from None
  send = transfer.Transfer(src[0], dst[0], config.model.dtype)
  send_frozen = None if src[1] is None else transfer.Transfer(src[1], dst[1], config.model.dtype)
  return lambda producer: asynchronous.Generator(
      producer, send, send_frozen, num_groups=r.batch_prompts, schedule=r.schedule,
      lockstep_chunks=r.lockstep_chunks, ahead=r.ahead)


def frozen_reference(params, dtype: str):
  """The KL reference's parameters: a copy of ``params`` (the state's are donated every step)
  with every floating array in the compute ``dtype``. Every layer casts its weights to the
  compute dtype where it uses them, so the reference computes exactly what a float32 copy
  would, in half the memory under bfloat16 matmuls (2 bytes a parameter instead of 4)."""
  dtype = jnp.dtype(dtype)
  return jax.tree.map(
      lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.copy(x),
      params)


def load_model(model_settings, tokenizer, mesh) -> tuple[nnx.GraphDef, Any]:
  """The policy's (graphdef, params) from ``model_settings`` (``settings.ModelSettings``: the
  ``model`` group), checked against the tokenizer; with LoRA adapters the base is stored in the
  compute dtype (it is never updated, so it needs no float32 master copy) and carries fresh
  adapters (``lora.attach``, drawn from ``random_keys.lora_init`` of the seed). Builds on any
  backend: a model configured with an accelerator's attention kernel is only refused where
  attention runs (``setup``)."""
  m = model_settings
  model = from_pretrained(m.path, param_dtype=m.param_dtype, dtype=m.dtype, mesh=mesh,
                          attention=m.attention, attention_block=m.attention_block)
  if len(tokenizer) > model.config.vocab_size:
    raise CheckpointError(
        f"the tokenizer in {m.path} has {len(tokenizer):,} tokens but the model's "
        f"embedding has {model.config.vocab_size:,} rows: they do not belong together")
  if m.lora:
    try:
      lora.attach(model, m.lora, nnx.Rngs(params=random_keys.lora_init(m.seed)))
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


def init_replay(method, config, mesh) -> replay_lib.ReplayState:
  """The empty replay buffer of replay ``method`` (``settings.Settings.replay``), laid out on
  the mesh, if any."""
  r = config.rollout
  replay = replay_lib.init_replay(config.replay.capacity, method.entry_size(r.group_size),
                                  r.prompt_len, r.completion_len)
  if mesh is not None:
    replay = sharding_lib.put(replay, sharding_lib.replay_shardings(mesh, replay))
  return replay
