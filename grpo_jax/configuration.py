"""Validation of RL configs before anything loads or compiles.

Every check names the field and the fix, so a bad ``--config.x=y`` fails in a second with one
readable line instead of a traceback from inside jit.
"""

from __future__ import annotations

import os

import math
import re

import jax

from grpo_jax import allocation, deprecated, errors, registry, sharding, tasks
from grpo_jax.generate import asynchronous
from grpo_jax.models import architectures, attention, causal_lm
from grpo_jax.rewards import functions as rewards, scoring
from grpo_jax.rl import losses, optim, replay_objectives
from grpo_jax.rl.replay import method as method_lib
from grpo_jax.rl.step_config import PROX_ESTIMATES, PROX_PASSES, REMAT, StepConfig
from grpo_jax.settings import ModelSettings, Settings
from grpo_jax.tasks import row_schemas

_GROUPS = ("model", "task", "rollout", "rl", "replay", "prox", "allocation", "opt", "eval",
           "checkpoint", "mesh")


ConfigError = errors.ConfigError  # re-exported: callers catch configuration.ConfigError


_check = errors.check


PARTIAL_CACHES = ("keep", "reprefill")
# The asynchronous knobs' defaults (grpo_jax/schema/defaults.py): any other value needs rollout.devices.
ASYNC_DEFAULTS = {"schedule": "free", "lockstep_chunks": 1, "ahead": 1}
CORRECTIONS = ("decoupled", "naive")


def uses_pool(config) -> bool:
  """Whether rows come from the slot pool of partial rollouts: ``rollout.partial``, or
  generation on its own devices (``rollout.devices`` > 0), whose queue the pool is."""
  r = config.rollout
  return bool(r.partial) or bool(r.get("devices", 0))


def _asynchronous(config) -> sharding.MeshConfig:
  """``rollout.devices`` and its knobs (``generate/asynchronous.py``), each refusal one line;
  the device count is checked against the machine's in ``check_mesh``. Returns the generation
  mesh's layout."""
  r = config.rollout
  for name in ("devices", "generation_mesh", "schedule", "lockstep_chunks", "ahead"):
    _check(name in r, f"rollout.{name}", "missing (start from grpo_jax.schema.base_config())")
  _check(isinstance(r.devices, int) and not isinstance(r.devices, bool) and r.devices >= 0,
         "rollout.devices", f"{r.devices!r} must be an integer >= 0 (0 = generate on the "
         "training devices)")
  _check(r.schedule in asynchronous.SCHEDULES, "rollout.schedule",
         f"{r.schedule!r}; known: {', '.join(asynchronous.SCHEDULES)}")
  _check(isinstance(r.lockstep_chunks, int) and r.lockstep_chunks >= 0,
         "rollout.lockstep_chunks", f"{r.lockstep_chunks!r} must be an integer >= 0")
  _check(isinstance(r.ahead, int) and r.ahead >= 0, "rollout.ahead",
         f"{r.ahead!r} must be an integer >= 0 (0 = only the next step's groups)")
  if not r.devices:  # the knobs of a generator on its own devices: nothing for them to act on
    for name, default in ASYNC_DEFAULTS.items():
      _check(r[name] == default, f"rollout.{name}",
             f"{r[name]!r} acts only with generation on its own devices (rollout.devices > 0, "
             f"preset :async=K); with rollout.devices=0 leave it at {default!r}")
  try:
    return sharding.MeshConfig.from_config(r.generation_mesh)
  except sharding.MeshError as e:
    raise ConfigError(str(e).replace("config.mesh", "config.rollout.generation_mesh")) from None


def _partial_rollouts(config) -> sharding.MeshConfig:
  """``rollout.partial`` and its knobs (``allocation/partial.py``), each refusal one line;
  returns the generation mesh's layout (``_asynchronous``)."""
  r = config.rollout
  for name in ("partial", "slots", "max_staleness", "chunk", "decode_budget", "partial_cache"):
    _check(name in r, f"rollout.{name}", "missing (start from grpo_jax.schema.base_config())")
  _check(isinstance(r.partial, bool), "rollout.partial", f"{r.partial!r} must be true or false")
  rows = r.batch_prompts * r.group_size
  _check(isinstance(r.slots, int) and r.slots >= 0 and r.slots % r.group_size == 0,
         "rollout.slots", f"{r.slots!r} must be 0 (B x G = {rows}) or a multiple of "
         f"rollout.group_size ({r.group_size})")
  _check(isinstance(r.max_staleness, int) and r.max_staleness >= 0, "rollout.max_staleness",
         f"{r.max_staleness!r} must be an integer >= 0")
  _check(isinstance(r.chunk, int) and r.chunk >= 0, "rollout.chunk",
         f"{r.chunk!r} must be an integer >= 0 (0 = rollout.completion_len / 32, at least 1)")
  _check(isinstance(r.decode_budget, int) and r.decode_budget >= 0, "rollout.decode_budget",
         f"{r.decode_budget!r} must be an integer >= 0 (0 = until B groups are complete)")
  _check(r.partial_cache in PARTIAL_CACHES, "rollout.partial_cache",
         f"{r.partial_cache!r}; known: {', '.join(PARTIAL_CACHES)}")
  generation_mesh = _asynchronous(config)
  if not uses_pool(config):
    return generation_mesh
  budget, t = r.decode_budget, r.completion_len
  _check(not budget or budget * (r.max_staleness + 1) >= t - 1, "rollout.decode_budget",
         f"{budget} decode steps per step x (rollout.max_staleness {r.max_staleness} + 1) can "
         f"never finish a row of rollout.completion_len={t} tokens ({t - 1} after the "
         "prefill's): raise either")
  _check(not r.sampler_rows, "rollout.sampler_rows",
         f"{r.sampler_rows}: partial rollouts hold rollout.slots rows in flight; set 0 and "
         "size the pool with rollout.slots")
  return generation_mesh

def validate(config, *, weights: bool = True) -> Settings:
  """The typed groups of an RL config (``settings.Settings``); raises ConfigError naming the
  first invalid field.

  Old keys that moved into a group and were set are moved there first, in place
  (``grpo_jax.deprecated``, one notice each).

  Args:
    config: the RL config.
    weights: check that ``model.path`` is a model folder (False for abstract benchmarks, which
      may name the architecture by ``model.arch`` instead).
  """
  for group in _GROUPS:
    _check(group in config, group, "missing group (start from grpo_jax.schema.base_config())")
  deprecated.apply(config)
  tasks.infer_name(config)
  m, r, rl, o = config.model, config.rollout, config.rl, config.opt
  if weights or not m.arch:
    _check(bool(m.path), "model.path", "empty: pass --config.model.path=/path/to/hf_folder")
    _check(os.path.isdir(m.path), "model.path", f"{m.path!r} is not a folder")
    _check(os.path.exists(os.path.join(m.path, "config.json")), "model.path",
           f"{m.path!r} has no config.json (not a Hugging Face model folder)")
  for f in ("param_dtype", "dtype"):
    _check(m[f] in causal_lm.DTYPES, f"model.{f}",
           f"{m[f]!r}; known: {', '.join(causal_lm.DTYPES)}")
  _check(m.remat in REMAT, "model.remat", f"{m.remat!r}; known: {', '.join(REMAT)}")
  _check(m.query_block >= 0, "model.query_block", f"{m.query_block} must be >= 0 (0 = all at once)")
  _attention(m)
  _check(not m.arch or m.arch in architectures.ARCHITECTURES, "model.arch",
         f"{m.arch!r}; known: {', '.join(architectures.ARCHITECTURES)} (or empty)")
  _lora(m)
  try:
    mesh = sharding.MeshConfig.from_config(config.mesh)
  except sharding.MeshError as e:
    raise ConfigError(str(e)) from None
  _check(config.task.name in tasks.TASKS, "task.name",
         f"{config.task.name!r}; known: {', '.join(tasks.TASKS.names())}")
  _check(r.group_size >= 2, "rollout.group_size",
         f"{r.group_size}: group-relative advantages need >= 2 rollouts per prompt")
  _check(r.batch_prompts >= 1, "rollout.batch_prompts", f"{r.batch_prompts} must be >= 1")
  _check(r.prompt_len >= 1 and r.completion_len >= 1, "rollout.prompt_len",
         "prompt_len and completion_len must be >= 1")
  _check(r.temperature > 0, "rollout.temperature",
         f"{r.temperature}: RL needs stochastic rollouts (temperature > 0)")
  rows = r.sampler_rows
  _check(isinstance(rows, int) and rows >= 0 and (
      not rows or (rows % r.group_size == 0 and (r.batch_prompts * r.group_size) % rows == 0)),
         "rollout.sampler_rows", f"{rows!r} must be 0 (all rows at once) or a multiple of "
         f"rollout.group_size ({r.group_size}) that divides the {r.batch_prompts * r.group_size} "
         "rows of a step")
  # The train step's log-probs are of the full softmax at the temperature; a top-k / top-p
  # filter in the sampler would make mu a different (truncated) distribution, so fresh rows
  # would start with rho != 1 and replayed rows' behaviour weights would be biased.
  _check(r.top_k == 0, "rollout.top_k",
         f"{r.top_k}: RL rollouts must sample the full distribution (set 0); the loss's "
         "log-probs are not top-k filtered")
  _check(r.top_p == 1.0, "rollout.top_p",
         f"{r.top_p}: RL rollouts must sample the full distribution (set 1.0); the loss's "
         "log-probs are not top-p filtered")
  generation_mesh = _partial_rollouts(config)
  _check(rl.score_base in scoring.SCORE_BASES, "rl.score_base",
         f"{rl.score_base!r}; known: {', '.join(scoring.SCORE_BASES)}")
  _validate_rewards(config)
  _prox(config)
  _check(rl.max_consecutive_skips >= 0, "rl.max_consecutive_skips",
         f"{rl.max_consecutive_skips} must be >= 0 (0 never stops)")
  _check(0 <= rl.overlong_buffer < r.completion_len, "rl.overlong_buffer",
         f"{rl.overlong_buffer} must be in [0, completion_len={r.completion_len})")
  _check(rl.get("packing", "none") != "tokens" or m.attention not in ("cudnn", "splash"),
         "rl.packing", f"'tokens' runs its own attention over packed rows (each slot to its own "
         f"sequence), which model.attention={m.attention!r} cannot express: use auto, xla or "
         "blocked, or rl.packing=none")
  method = _replay_method(config)
  try:
    step = step_config(config, method)  # config.rl's keys, every estimator's and loss's group
  except registry.GroupError as e:
    raise ConfigError(e.under("config.rl")) from None
  fresh = r.batch_prompts * r.group_size
  rows = fresh + method.extra_rows(fresh, r.group_size)
  _check(rl.num_minibatches >= 1 and rows % rl.num_minibatches == 0, "rl.num_minibatches",
         f"{rl.num_minibatches} must divide the update batch: {fresh} fresh rows"
         + (f" + {rows - fresh} replay rows" if rows > fresh else "") + f" = {rows}")
  rule, selector = _validate_allocation(config)
  _check(o.learning_rate > 0, "opt.learning_rate", f"{o.learning_rate} must be > 0")
  _check(o.schedule in ("constant", "cosine"), "opt.schedule",
         f"{o.schedule!r}; known: constant, cosine")
  _check(config.total_steps >= 1, "total_steps", "must be >= 1")
  _check(config.total_rollouts >= 0, "total_rollouts", "must be >= 0 (0 = no limit)")
  _check(config.total_tokens >= 0, "total_tokens", "must be >= 0 (0 = no limit)")
  _check(config.eval.every_rollouts >= 0, "eval.every_rollouts", "must be >= 0 (0 = off)")
  _check(config.eval.every_tokens >= 0, "eval.every_tokens", "must be >= 0 (0 = off)")
  _check(not (config.eval.every_rollouts and config.eval.every_tokens), "eval.every_tokens",
         "set eval.every_rollouts or eval.every_tokens, not both")
  _check(config.eval.every >= 1 and config.checkpoint.every >= 1, "eval.every",
         "eval.every and checkpoint.every must be >= 1")
  _check(config.eval.k >= 1 and config.eval.num_prompts >= 1, "eval.k",
         "eval.k and eval.num_prompts must be >= 1")
  return Settings(mesh=mesh, generation_mesh=generation_mesh, generation_devices=r.devices,
                  uses_pool=uses_pool(config), replay=method, rule=rule, selector=selector,
                  step=step, optimizer=optim.OptimizerSettings.from_config(config),
                  model=ModelSettings.from_config(config))


def _validate_rewards(config) -> None:
  """The task's data and reward keys: a known schema, math-verify's bounds, reward entries that
  load, one weight per reward, a success reward among them."""
  t = config.task
  _check(t.schema in ("auto",) + row_schemas.SCHEMAS, "task.schema",
         f"{t.schema!r}; known: auto, {', '.join(row_schemas.SCHEMAS)}")
  _check(t.math_workers >= 0, "task.math_workers", f"{t.math_workers} must be >= 0 (0 = auto)")
  _check(t.math_timeout_s > 0 and math.isfinite(t.math_timeout_s), "task.math_timeout_s",
         f"{t.math_timeout_s} must be a positive number of seconds")
  _check(t.math_batch_timeout_s >= 0 and math.isfinite(t.math_batch_timeout_s),
         "task.math_batch_timeout_s", f"{t.math_batch_timeout_s} must be >= 0 (0 = none)")
  _check(t.max_reward_failures >= 0, "task.max_reward_failures",
         f"{t.max_reward_failures} must be >= 0 (0 never stops)")
  _check(math.isfinite(t.success_threshold), "task.success_threshold",
         f"{t.success_threshold} must be a finite number")
  specs = scoring.reward_specs(t)
  if not specs:
    _check(not t.reward_weights and not t.success_reward, "task.reward_weights",
           "reward_weights / success_reward need task.rewards to name the rewards")
    return
  names = []
  for spec in specs:
    try:
      names.append(rewards.load(spec)[0])
    except rewards.RewardSpecError as e:
      raise ConfigError(f"config.task.rewards: {e}") from None
  try:
    scoring.parse_weights(t.reward_weights, len(specs))
  except ValueError as e:
    raise ConfigError(f"config.task.reward_weights: {e}") from None
  _check(not t.success_reward or t.success_reward in names, "task.success_reward",
         f"{t.success_reward!r} is not one of the rewards ({', '.join(names)})")


def _replay_method(config):
  """The replay method, every method's group checked (an inactive group's value must run
  too once selected), then the active method's checks against the other groups."""
  p = config.replay
  _check(p.method in method_lib.METHODS, "replay.method",
         f"{p.method!r}; known: {', '.join(method_lib.METHODS.names())}")
  _check(p.capacity >= 0, "replay.capacity", "must be >= 0")
  _check(p.objective in replay_objectives.OBJECTIVES, "replay.objective",
         f"{p.objective!r}; known: {', '.join(replay_objectives.OBJECTIVES)}")
  method = None
  for name, cls in method_lib.METHODS.items():
    try:
      built = cls.from_config(config)
    except ValueError as e:
      raise ConfigError(f"config.replay.{name}: {e}") from None
    if name == p.method:
      method = built
  method.check_config(config)
  return method


def _validate_allocation(config) -> tuple:
  """The allocation group: a known rule and selector, each registered rule's and selector's
  group in range, their checks against the other groups, a finite pool for the selectors
  that learn per prompt. Returns the (rule, selector) specs."""
  a, t = config.allocation, config.task
  _check(a.method in allocation.RULES, "allocation.method",
         f"{a.method!r}; known: {', '.join(allocation.RULES.names())}")
  _check(a.selector in allocation.SELECTORS, "allocation.selector",
         f"{a.selector!r}; known: {', '.join(allocation.SELECTORS.names())}")
  _check(a.max_rounds >= 2, "allocation.max_rounds", f"{a.max_rounds} must be >= 2")
  specs = {}
  for table in (allocation.RULES, allocation.SELECTORS):
    for name in table.names():
      try:
        specs[table, name] = allocation.spec(table, a, name)
      except ValueError as e:
        raise ConfigError(f"config.allocation.{name}: {e}") from None
  specs[allocation.RULES, a.method].check_config(config)
  _check(t.train_size >= 0, "task.train_size", f"{t.train_size} must be >= 0 (0 = all)")
  if allocation.SELECTORS.get(a.selector).needs_pool:
    _check(t.train_size > 0 or t.name != "countdown" or bool(t.data_path), "task.train_size",
           f"allocation.selector={a.selector} learns per prompt and needs prompts that come "
           "back: set a finite training set (e.g. --config.task.train_size=1024)")
  return specs[allocation.RULES, a.method], specs[allocation.SELECTORS, a.selector]


def replay_method(config):
  """The replay method named by ``config.replay.method``, from its own group (see
  grpo_jax/rl/replay/method.py)."""
  return method_lib.METHODS.get(config.replay.method).from_config(config)


def loss_config(config) -> losses.LossConfig:
  """The LossConfig of ``config.rl.loss`` (its policy loss from that loss's own group)."""
  return losses.LossConfig.from_group(deprecated.current(config.rl.loss))


def check_mesh(config, mesh, generation_mesh=None) -> None:
  """Raises ConfigError unless the run's arrays split evenly over ``mesh`` (None: nothing to
  check): the rollout rows and the replay buffer's entries over the batch axes (data x fsdp),
  and the slot pool's rows over those of the mesh that generates (``generation_mesh`` when
  generation has its own devices). The parameters are checked as they load
  (``sharding.param_sharding``)."""
  r = config.rollout
  _check(not r.get("devices", 0) or jax.process_count() == 1, "rollout.devices",
         f"not yet across {jax.process_count()} processes: the generation and training meshes "
         "are built from one host's devices (one process may drive all of them)")
  rows = r.batch_prompts * r.group_size
  slots = r.slots or rows
  if generation_mesh is not None:
    gen = sharding.batch_shards(generation_mesh)
    _check(slots % gen == 0, "rollout.slots",
           f"{slots} rows in flight must be a multiple of rollout.generation_mesh data x fsdp "
           f"= {gen} (the slot pool's rows are split over the generation devices)")
  if mesh is None:
    return
  shards = sharding.batch_shards(mesh)
  _check(rows % shards == 0, "rollout.batch_prompts",
         f"{r.batch_prompts} prompts x {r.group_size} rollouts = {rows} rows per step must be a "
         f"multiple of mesh data x fsdp = {shards} (the rows are split over those devices)")
  blocks = r.sampler_rows
  _check(not blocks or (blocks // r.group_size) % shards == 0, "rollout.sampler_rows",
         f"{blocks} rows = {blocks // r.group_size} groups per sampler pass must be a multiple "
         f"of mesh data x fsdp = {shards} (each pass's rows are split over those devices)")
  _check(generation_mesh is not None or not uses_pool(config) or slots % shards == 0,
         "rollout.slots", f"{slots} rows in flight must be a multiple of mesh data x fsdp = "
         f"{shards} (the slot pool's rows are split over those devices)")
  _check(not uses_pool(config) or jax.process_count() == 1, "rollout.partial",
         f"not yet across {jax.process_count()} processes: the producer reads which of the "
         "pool's rows ended on one host (one process may drive every local device)")
  _check(config.replay.capacity % shards == 0, "replay.capacity",
         f"{config.replay.capacity} entries must be a multiple of mesh data x fsdp = {shards} "
         "(buffer entries are split like the batch)")


def _attention(m):
  """model.attention names a kernel; the block is positive (the backend: ``check_backend``)."""
  names = attention.IMPLEMENTATIONS
  _check(m.attention in names, "model.attention", f"{m.attention!r}; known: {', '.join(names)}")
  _check(m.attention_block >= 1, "model.attention_block", f"{m.attention_block} must be >= 1")


def check_backend(config) -> None:
  """model.attention's kernel exists on this process's backend (cudnn: a GPU, splash: a TPU).

  Separate from ``validate``, which must not start JAX's backend (a multi-host run calls
  ``jax.distributed.initialize`` after validating): the loop calls this once the devices are
  up.
  """
  name = config.model.attention
  needs = attention.BACKEND.get(name)
  _check(needs is None or jax.default_backend() == needs, "model.attention",
         f"{name!r} needs a {(needs or '').upper()} backend, this process has "
         f"{jax.default_backend()!r}: use auto or blocked")


def backend_notes(config, backend: str) -> list[str]:
  """One-line notes on running ``config`` on ``backend`` ("cpu", "gpu", "tpu"): today, a
  float32 compute dtype on an accelerator (cuDNN's attention takes bf16 / fp16 only, so
  ``auto`` falls back to the slower ``blocked`` kernel, and a GPU runs float32 matmuls at
  TF32 unless told otherwise)."""
  if backend in ("gpu", "tpu") and config.model.dtype == "float32":
    return [f"grpo_jax: model.dtype=float32 on a {backend.upper()}: matmuls and attention run "
            "off their fast paths (cuDNN / splash take bfloat16); add the :bf16 preset or "
            "--config.model.dtype=bfloat16 (float32 master weights are kept)"]
  return []


def _lora(m) -> None:
  """``model.lora``: rank, alpha, dropout and the targets' regular expression."""
  lo = m.get("lora")
  if lo is None:
    return
  _check(isinstance(lo.rank, int) and lo.rank >= 0, "model.lora.rank",
         f"{lo.rank!r} must be an int >= 0 (0 = full fine-tuning)")
  _check(isinstance(lo.alpha, (int, float)) and lo.alpha > 0, "model.lora.alpha",
         f"{lo.alpha!r} must be > 0 (the update is scaled by alpha / rank)")
  _check(lo.dropout == 0, "model.lora.dropout",
         f"{lo.dropout!r}: only 0 is supported; dropout would make pi_theta random, so the "
         "step's ratio on fresh rows would not start at 1 and no pass would reproduce the "
         "sampler's log-probs")
  try:
    re.compile(lo.targets)
  except (re.error, TypeError) as e:
    raise ConfigError(f"config.model.lora.targets: {lo.targets!r} is not a regular "
                      f"expression ({e})") from None


def _prox(config) -> None:
  """The ``prox`` group (pi_prox's rows, estimate, chunks and the continued rows' correction),
  each refusal one line."""
  p = config.prox
  for name in ("rows", "estimate", "chunks", "continued"):
    _check(name in p, f"prox.{name}", "missing (start from grpo_jax.schema.base_config())")
  # "auto" is the group's own value, resolved from the model's dtype before the step sees it.
  _check(p.rows in ("auto",) + PROX_PASSES, "prox.rows",
         f"{p.rows!r}; known: auto, {', '.join(PROX_PASSES)}")
  _check(p.estimate in PROX_ESTIMATES, "prox.estimate",
         f"{p.estimate!r}; known: {', '.join(PROX_ESTIMATES)}")
  _check(p.estimate == "exact" or prox_pass(config) != "all", "prox.estimate",
         "'interpolate' replaces the pass over replayed rows only, and prox.rows resolves to "
         "'all' (one pass over every row, the default under bfloat16): set prox.rows=replayed "
         "or prox.estimate=exact")
  _check(isinstance(p.chunks, int) and not isinstance(p.chunks, bool) and p.chunks >= 0,
         "prox.chunks", f"{p.chunks!r} must be an integer >= 0 (0 = the whole batch)")
  _check(p.continued in CORRECTIONS, "prox.continued",
         f"{p.continued!r}; known: {', '.join(CORRECTIONS)}")


def prox_pass(config) -> str:
  """``prox.rows`` resolved: "auto" is "all" when the matmuls are not float32 (the sampler's
  cached decoding and the step's full forward then differ), else "replayed"."""
  if config.prox.rows != "auto":
    return config.prox.rows
  return "all" if config.model.dtype != "float32" else "replayed"


def step_config(config, replay=None) -> StepConfig:
  """The train step's static settings: ``config.rl``'s own keys (``StepConfig.from_group``),
  the rest from the groups they belong to; ``replay`` is the replay method when already built.

  Raises:
    registry.GroupError: a value of ``config.rl`` out of range, with its key's path.
  """
  r, m = config.rollout, config.model
  return StepConfig.from_group(
      deprecated.current(config.rl), group_size=r.group_size, prox_pass=prox_pass(config),
      prox_estimate=config.prox.estimate, prox_chunks=config.prox.chunks,
      continued=uses_pool(config) and config.prox.continued == "decoupled",
      temperature=r.temperature, compute_entropy=config.rl.loss.entropy_coef > 0,
      replay=replay_method(config) if replay is None else replay, remat=m.remat,
      query_block=m.query_block)
