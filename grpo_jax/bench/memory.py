"""Compiled memory of the train step and the sampler, from abstract shapes (no weights).

Per-device memory of a preset on a mesh of fake CPU devices (the table in docs/scaling.md):

    python -m grpo_jax.bench.memory --config=configs/popo.py:qwen3_8b --mesh=8

``--mesh=N`` starts JAX with N fake CPU devices (``XLA_FLAGS=
--xla_force_host_platform_device_count=N``, set here before JAX is imported, together with
``CPU_MEMORY_SCHEDULER``: see below) and lays them out
as ``config.mesh`` says (the qwen3 presets: FSDP over all of them; override with
``--config.mesh.fsdp=4 --config.mesh.tensor=2`` etc.). The architecture comes from
``config.model.arch`` (set by the qwen3 presets; ``models/architectures.py``) or else from the
``config.json`` of ``config.model.path``; the batch, lengths, minibatches, LM-head chunk, remat,
dtypes, replay buffer and KL reference from the config. Parameters, optimiser state, buffer and
rollouts are ``ShapeDtypeStruct``s carrying their shardings: nothing is allocated or run. The
jitted train step (``step.make_train_step`` with the run's optimiser and shardings) and the
jitted rollout round (``static_round.make_round_fn``, N rows of P + T tokens: what a run's
rounds compile) are lowered and compiled, and XLA's ``memory_analysis()`` of each executable
printed per device. The numbers describe the backend this compiles for (CPU), whose buffer
assignment and bf16 handling may differ from an accelerator's (XLA:CPU computes bf16 dots in
float32, and its memory scheduler is a heuristic with no rematerialisation pass to meet a
memory limit, unlike TPU and GPU compilers).

Without ``--config``, the earlier single-device comparison at Qwen3-0.6B shape, with and without
LM-head chunking:

    python -m grpo_jax.bench.memory --batch_prompts=2 --group_size=4 --prompt_len=64 \
        --completion_len=512 --num_minibatches=2 --chunk=1024

compiles the train step (AdamW, plain GRPO, no replay) for ``logprob_chunk=0`` (the full
float32 [N, T, V] logits of every log-prob pass) and for ``logprob_chunk=--chunk``.
``--kl_coef > 0`` adds the reference pass.

Columns (GiB per device): argument (state, rollouts, reference params), output, alias (outputs
written in place of donated arguments), temp (XLA's scratch buffers: activations, logits,
gradients) and total = argument + output - alias + temp, the executable's peak footprint as
XLA reports it.
"""

import json
import os
import sys


def _fake_devices(argv) -> int:
  """N of ``--mesh=N`` / ``--mesh N`` in ``argv`` (0 when absent)."""
  for i, arg in enumerate(argv):
    if arg.startswith("--mesh="):
      return int(arg.split("=", 1)[1])
    if arg == "--mesh" and i + 1 < len(argv):
      return int(argv[i + 1])
  return 0


# XLA:CPU's default scheduler orders operations for thread concurrency, not memory, and then
# keeps rematerialised activations alive anyway (jax.checkpoint saves nothing on its schedule);
# the memory-minimising scheduler it falls back to without it is the one that reflects what an
# accelerator's memory-aware scheduler does. Used by the --config mode (the table in
# docs/scaling.md).
CPU_MEMORY_SCHEDULER = "--xla_cpu_enable_concurrency_optimized_scheduler=false"

if __name__ == "__main__" and any(a.startswith("--config") for a in sys.argv):
  # Before JAX is imported: JAX fixes its device count and compiler flags when it starts.
  _flags = [os.environ.get("XLA_FLAGS", ""), CPU_MEMORY_SCHEDULER]
  if _fake_devices(sys.argv):
    _flags.append(f"--xla_force_host_platform_device_count={_fake_devices(sys.argv)}")
    os.environ["JAX_PLATFORMS"] = "cpu"  # fake devices are CPU ones, on a GPU machine too
  os.environ["XLA_FLAGS"] = " ".join(f for f in _flags if f)

import time  # noqa: E402  (after XLA_FLAGS)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from grpo_jax import configuration  # noqa: E402
from grpo_jax import console  # noqa: E402
from grpo_jax import sharding  # noqa: E402
# What each chip gives JAX (``hbm.py``), re-exported: memory.pools, memory.CHIPS, ...
from grpo_jax.bench.hbm import (  # noqa: E402,F401
    CHIPS, DEFAULT_GPU_FRACTION, GPU_CHIPS, gpu_memory_fraction, pools)
from grpo_jax.generate import sampler as sampler_lib  # noqa: E402
from grpo_jax.generate import static_round  # noqa: E402
from grpo_jax.models import FAMILIES, ModelConfig, Qwen3, lora  # noqa: E402
from grpo_jax.models import attention as attention_lib  # noqa: E402
from grpo_jax.models import family  # noqa: E402
from grpo_jax.rl import losses, optim, replay as replay_lib  # noqa: E402
from grpo_jax.rl import step as step_lib  # noqa: E402
from grpo_jax.rl.step_config import StepConfig  # noqa: E402
from grpo_jax.types import Rollout  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "RL config (e.g. configs/popo.py:qwen3_8b): per-device memory of its train "
    "step and sampler on the mesh; without it, the single-device chunking comparison")
_MESH = flags.DEFINE_integer("mesh", 0, "fake CPU devices to compile for (0: the real ones)")

_PROMPTS = flags.DEFINE_integer("batch_prompts", 2, "B, prompts per step")
_GROUP = flags.DEFINE_integer("group_size", 4, "G, rollouts per prompt")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "P")
_COMPLETION_LEN = flags.DEFINE_integer("completion_len", 512, "T")
_MINIBATCHES = flags.DEFINE_integer("num_minibatches", 2, "minibatches per step")
_CHUNK = flags.DEFINE_integer("chunk", 1024, "logprob_chunk of the 'after' configuration")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "parameter and compute dtype")
_KL = flags.DEFINE_float("kl_coef", 0.0, "KL coefficient (> 0 adds the reference pass)")
_JSON = flags.DEFINE_bool("json", False, "--config mode: end with one JSON line (per-device "
                          "step_peak_bytes, sampler_peak_bytes, sampling_peak_bytes, the "
                          "arithmetic breakdown, what fits)")

GIB = 2 ** 30


def qwen3_0_6b(dtype: str) -> ModelConfig:
  """Qwen3-0.6B (Hugging Face Qwen/Qwen3-0.6B config.json)."""
  return ModelConfig(vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                     num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                     rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     param_dtype=dtype, dtype=dtype)


def abstract_inputs(cfg: ModelConfig, tx, b: int, g: int, p: int, t: int, with_ref: bool):
  """(graphdef, state, replay, rollout, ref_params, key) with ShapeDtypeStruct leaves."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: Qwen3(cfg, rngs=nnx.Rngs(0))))
  state = jax.eval_shape(lambda p_: step_lib.init_train_state(p_, tx), params)
  replay = jax.eval_shape(lambda: replay_lib.init_replay(0, g, p, t))
  n = b * g
  s = jax.ShapeDtypeStruct
  rollout = Rollout(prompt_ids=s((n, p), jnp.int32), prompt_mask=s((n, p), bool),
                    completion_ids=s((n, t), jnp.int32),
                    completion_mask=s((n, t), bool),
                    behaviour_logp=s((n, t), jnp.float32), scores=s((n,), jnp.float32),
                    truncated=s((n,), bool),
                    success=s((n,), bool), prompt_id=s((n,), jnp.int32),
                    version=s((n, t), jnp.int32))
  key = jax.eval_shape(lambda: jax.random.key(0))
  return graphdef, state, replay, rollout, (params if with_ref else None), key


def measure(chunk: int) -> dict:
  """Compile the train step with ``logprob_chunk=chunk``; its memory stats and timings."""
  b, g, p, t = _PROMPTS.value, _GROUP.value, _PROMPT_LEN.value, _COMPLETION_LEN.value
  cfg = qwen3_0_6b(_DTYPE.value)
  tx = optax.adamw(1e-6)
  graphdef, *args = abstract_inputs(cfg, tx, b, g, p, t, _KL.value > 0)
  config = StepConfig(group_size=g, num_minibatches=_MINIBATCHES.value,
                               loss=losses.LossConfig(kl_coef=_KL.value), logprob_chunk=chunk)
  fn = step_lib.make_train_step(graphdef, tx, config)
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  t1 = time.perf_counter()
  stats = lowered.compile().memory_analysis()
  t2 = time.perf_counter()
  out = dict(argument=stats.argument_size_in_bytes, output=stats.output_size_in_bytes,
             alias=stats.alias_size_in_bytes, temp=stats.temp_size_in_bytes)
  out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  out.update(lower_s=t1 - t0, compile_s=t2 - t1)
  return out


def main(argv):
  del argv
  console.quiet_unless_verbose()
  if _CONFIG.value is not None:
    return config_main(_CONFIG.value)
  b, g, p, t = _PROMPTS.value, _GROUP.value, _PROMPT_LEN.value, _COMPLETION_LEN.value
  n, m = b * g, _MINIBATCHES.value
  cfg = qwen3_0_6b(_DTYPE.value)
  print(f"Qwen3-0.6B shape ({cfg.num_params / 1e6:.0f}M params, {_DTYPE.value}), "
        f"backend {jax.default_backend()}: N = {b}x{g} = {n} rows, P = {p}, T = {t}, "
        f"{m} minibatches of {n // m} rows, kl_coef {_KL.value}", flush=True)
  full_logits = (n // m) * t * cfg.vocab_size * 4
  print(f"one minibatch's float32 logits [{n // m}, {t}, {cfg.vocab_size}]: "
        f"{full_logits / GIB:.2f} GiB", flush=True)
  cols = ("argument", "output", "alias", "temp", "total")
  print("| logprob_chunk | " + " | ".join(f"{c} GiB" for c in cols) + " | compile s |")
  print("|---|" + "---|" * (len(cols) + 1))
  for chunk in (0, _CHUNK.value):
    r = measure(chunk)
    print(f"| {chunk} | " + " | ".join(f"{r[c] / GIB:.3f}" for c in cols)
          + f" | {r['lower_s'] + r['compile_s']:.0f} |", flush=True)
    print("  bytes: " + ", ".join(f"{c}={r[c]}" for c in cols), flush=True)


# --- per-device memory of a config on a mesh -------------------------------------------------

def architecture_of(config) -> ModelConfig:
  """The ModelConfig of ``config.model.arch``, else of ``config.model.path``'s config.json."""
  from grpo_jax.models import architectures, hf  # pylint: disable=g-import-not-at-top
  m = config.model
  if m.arch:
    cfg = architectures.architecture(m.arch, param_dtype=m.param_dtype, dtype=m.dtype)
  else:
    cfg = hf.config_from_hf(hf.read_hf_config(m.path), param_dtype=m.param_dtype,
                            dtype=m.dtype)
  return cfg.replace(attention=m.attention, attention_block=m.attention_block)


def _with_shardings(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _stats(compiled) -> dict:
  m = compiled.memory_analysis()
  out = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
             alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes)
  out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def abstract_state(config, mesh):
  """(graphdef, params, optimiser, TrainState) of ``config``'s model as ShapeDtypeStructs laid
  out on ``mesh``: under ``model.lora`` the base in the compute dtype (as the loop loads it)
  with adapters, and the optimiser state of the adapters only."""
  adapters = lora.from_config(config.model)
  cfg = architecture_of(config)
  if adapters:
    cfg = cfg.replace(param_dtype=cfg.dtype)  # the frozen base in the compute dtype, as loaded
  build = FAMILIES.get(cfg.model_type).build

  def model():
    m = build(cfg, rngs=nnx.Rngs(0))
    if adapters:
      lora.attach(m, adapters, nnx.Rngs(0))
    return m

  graphdef, params = nnx.split(nnx.eval_shape(model))
  params = _with_shardings(params, sharding.tree_shardings(mesh, params, family.param_axes()))
  tx = optim.make_optimizer(optim.OptimizerSettings.from_config(config))
  state = jax.eval_shape(lambda p: step_lib.init_train_state(p, tx), params)
  return graphdef, params, tx, _with_shardings(state, sharding.tree_shardings(mesh, state, family.param_axes()))


def abstract_step(config, mesh):
  """``config``'s jitted train step on ``mesh`` and its arguments as laid-out
  ``ShapeDtypeStruct``s (state, replay buffer, rollout, KL reference, key), from abstract shapes.

  Returns:
    (step, args, graphdef, params): ``step.lower(*args)`` compiles it; ``graphdef`` and
    ``params`` (abstract) are the model's, as the sampler takes them.
  """
  r = config.rollout
  graphdef, params, tx, state = abstract_state(config, mesh)
  adapters = lora.from_config(config.model)
  method = configuration.replay_method(config)
  replay = jax.eval_shape(lambda: replay_lib.init_replay(
      config.replay.capacity, method.entry_size(r.group_size), r.prompt_len, r.completion_len))
  replay = _with_shardings(replay, sharding.replay_shardings(mesh, replay))
  # The KL reference as the run keeps it (build.frozen_reference: the compute dtype); under
  # LoRA the base is the reference, no copy.
  compute = jnp.dtype(config.model.dtype)
  ref = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, compute if jnp.issubdtype(x.dtype, jnp.floating)
                                     else x.dtype, sharding=x.sharding),
      params) if config.rl.loss.kl_coef > 0 and not adapters else None
  n, p, t = r.batch_prompts * r.group_size, r.prompt_len, r.completion_len
  rows = sharding.rows_sharding(mesh)
  s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
  rollout = Rollout(prompt_ids=s((n, p), jnp.int32), prompt_mask=s((n, p), bool),
                    completion_ids=s((n, t), jnp.int32), completion_mask=s((n, t), bool),
                    behaviour_logp=s((n, t), jnp.float32), scores=s((n,), jnp.float32),
                    truncated=s((n,), bool),
                    success=s((n,), bool), prompt_id=s((n,), jnp.int32),
                    version=s((n, t), jnp.int32))
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                             sharding=sharding.replicated(mesh))
  fn = step_lib.make_train_step(graphdef, tx, configuration.step_config(config),
                                sharding.step_shardings(mesh, state, replay, family.param_axes(), ref))
  return fn, (state, replay, rollout, ref, key), graphdef, params


def _mesh(config):
  """``config``'s mesh on the current devices, after checking the config against it."""
  configuration.validate(config, weights=False)
  mesh = sharding.make_mesh(sharding.MeshConfig.from_config(config.mesh))
  configuration.check_mesh(config, mesh)
  return mesh


def step_memory(config) -> dict:
  """Compiles ``config``'s train step alone (``config_memory`` without the sampler) for
  abstract inputs on the current devices.

  Returns:
    Its memory stats in bytes per device (argument, output, alias, temp, total) and
    ``compile_s``.
  """
  fn, args, _, _ = abstract_step(config, _mesh(config))
  t0 = time.perf_counter()
  return {**_stats(fn.lower(*args).compile()), "compile_s": time.perf_counter() - t0}


def config_memory(config) -> dict:
  """Compiles ``config``'s train step and sampler for abstract inputs on the current devices.

  Returns:
    {"mesh": axis sizes, "params": count, "step"/"sampler": memory stats in bytes per device
     plus "compile_s", "sampling_peak": bytes resident while sampling (the step's arguments,
     i.e. state, buffer and reference, plus the sampler's temp and output)}.
  """
  r = config.rollout
  mesh = _mesh(config)
  fn, args, graphdef, params = abstract_step(config, mesh)
  out = {"mesh": dict(mesh.shape), "params": architecture_of(config).num_params}
  t0 = time.perf_counter()
  out["step"] = {**_stats(fn.lower(*args).compile()), "compile_s": time.perf_counter() - t0}
  sampling = sampler_lib.SamplingConfig(
      max_new_tokens=r.completion_len, eos_ids=(0,), pad_id=0, temperature=r.temperature,
      prompt_group=r.group_size if config.rl.get("shared_prompts", True) else 1,
      row_block=r.get("sampler_rows", 0))
  sample = static_round.make_round_fn(graphdef, sampling, mesh)
  rollout, key = args[2], args[4]
  t0 = time.perf_counter()
  compiled = sample.lower(params, rollout.prompt_ids, rollout.prompt_mask, key).compile()
  out["sampler"] = {**_stats(compiled), "compile_s": time.perf_counter() - t0}
  out["sampling_peak"] = (out["step"]["argument"] + out["sampler"]["temp"]
                          + out["sampler"]["output"])
  return out


def arithmetic(config, devices: int) -> dict:
  """Per-device bytes by counting, to check the compiled figures against (docs/scaling.md).

  Parameters and optimiser state split over every device (FSDP), rows over every device. Terms:
  ``state`` (parameters in their storage dtype; trained ones with two float32 AdamW moments),
  ``gradients`` (float32, trained parameters), ``guard_copy`` (the updated state the NaN guard
  keeps beside the old one), ``saved_inputs`` (layer remat: each block's input [U, P + T, D] of
  one minibatch of U rows, compute dtype), ``block_backward`` (one block recomputed: q, k, v, o
  and the three SwiGLU intermediates with their cotangents; attention scores only for the
  ``xla`` kernel, [U, H, query_block or P + T, P + T] float32, none for the others), ``lm_head``
  (two [chunk, V] float32 blocks), ``kv_cache`` (the sampler's [N, P + T] keys and values of
  every layer, compute dtype) and ``sampler_logits`` (the [N, V] float32 logits of a decode
  step). ``step`` and ``sampling`` are their sums as each executable holds them.
  """
  cfg = architecture_of(config)
  r, m = config.rollout, config.model
  n, s = r.batch_prompts * r.group_size, r.prompt_len + r.completion_len
  u = max(1, n // config.rl.num_minibatches) / devices
  n_dev = n / devices
  by = lambda dtype: jnp.dtype(dtype).itemsize
  c_b = by(cfg.dtype)
  adapters = lora.from_config(m)
  if adapters:
    trained = sum(dim for dim in _lora_sizes(config))
    stored = cfg.num_params * c_b + trained * 4
  else:
    trained = cfg.num_params
    stored = cfg.num_params * by(cfg.param_dtype)
  state = (stored + trained * 8) / devices
  gradients = trained * 4 / devices
  d, f, h, k, w, layers = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                           cfg.num_kv_heads, cfg.head_dim, cfg.num_layers)
  saved = layers * u * s * d * c_b
  block = 2 * u * s * ((2 * h + 2 * k) * w + 3 * f) * c_b
  if attention_lib.resolve(m.attention, s) == "xla":
    block += 2 * u * h * (m.query_block or s) * s * 4
  chunk = config.rl.logprob_chunk or u * r.completion_len
  lm_head = 2 * chunk * cfg.vocab_size * 4
  kv = 2 * layers * n_dev * s * k * w * c_b
  logits = n_dev * cfg.vocab_size * 4
  terms = dict(state=state, gradients=gradients, guard_copy=state, saved_inputs=saved,
               block_backward=block, lm_head=lm_head, kv_cache=kv, sampler_logits=logits)
  terms["step"] = state * 2 + gradients + saved + block + lm_head
  terms["sampling"] = state + kv + logits
  return terms


def _lora_sizes(config):
  """Parameter counts of every adapter the config attaches (abstract model, nothing built)."""
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=1))
  _, params, _, _ = abstract_state(config, mesh)
  return [int(np.prod(x.shape)) for x in jax.tree.leaves(lora.split(params)[0])]


def config_main(config):
  try:
    configuration.validate(config, weights=False)
  except configuration.ConfigError as e:
    sys.exit(f"grpo_jax.bench.memory: {e}")
  r = config.rollout
  stored = (f"{config.model.dtype} (frozen base; adapters float32)" if config.model.lora.rank
            else config.model.param_dtype)
  print(f"{config.model.arch or config.model.path}: {r.batch_prompts} prompts x "
        f"{r.group_size} rollouts, P = {r.prompt_len}, T = {r.completion_len}, "
        f"{config.rl.num_minibatches} minibatches, logprob_chunk {config.rl.logprob_chunk}, "
        f"remat {config.model.remat}, params {stored}, matmuls "
        f"{config.model.dtype}, replay {config.replay.method} ({config.replay.capacity}), "
        f"kl_coef {config.rl.loss.kl_coef}, LoRA rank {config.model.lora.rank}; "
        f"{jax.device_count()} {jax.default_backend()} devices",
        flush=True)
  try:
    out = config_memory(config)
  except (configuration.ConfigError, sharding.MeshError) as e:
    sys.exit(f"grpo_jax.bench.memory: {e}")
  devices = int(np.prod(list(out["mesh"].values())))
  counted = arithmetic(config, devices)
  print(f"mesh {out['mesh']}, {out['params'] / 1e9:.2f}B parameters; GiB per device:")
  cols = ("argument", "output", "alias", "temp", "total")
  print("| executable | " + " | ".join(cols) + " | compile s |")
  print("|---|" + "---|" * (len(cols) + 1))
  for name in ("step", "sampler"):
    st = out[name]
    print(f"| {name} | " + " | ".join(f"{st[c] / GIB:.2f}" for c in cols)
          + f" | {st['compile_s']:.0f} |")
  peak = max(out["step"]["total"], out["sampling_peak"])
  print(f"peak per device: train step {out['step']['total'] / GIB:.2f} GiB, while sampling "
        f"{out['sampling_peak'] / GIB:.2f} GiB (state, buffer and reference + sampler temp "
        "and output)")
  pool = pools()
  print(f"fits (against the memory JAX gets: {gpu_memory_fraction():.2f} of a GPU, set by "
        "XLA_CLIENT_MEM_FRACTION; a TPU's whole memory): " + ", ".join(
            f"{chip} ({gib:.1f} GiB) {'yes' if peak / GIB <= gib else 'no'}"
            for chip, gib in pool.items()))
  print("by arithmetic (GiB per device): " + ", ".join(
      f"{k} {v / GIB:.2f}" for k, v in counted.items()))
  print("bytes: " + json.dumps({k: out[k] for k in ("step", "sampler", "sampling_peak")}),
        flush=True)
  if _JSON.value:
    print(json.dumps({
        "model": config.model.arch or config.model.path, "lora_rank": config.model.lora.rank,
        "attention": config.model.attention, "rows": r.batch_prompts * r.group_size,
        "prompt_len": r.prompt_len, "completion_len": r.completion_len,
        "minibatches": config.rl.num_minibatches, "mesh": out["mesh"],
        "backend": jax.default_backend(), "params": out["params"],
        "step_peak_bytes": out["step"]["total"],
        "sampler_peak_bytes": out["sampler"]["total"],
        "sampling_peak_bytes": out["sampling_peak"],
        "step": out["step"], "sampler": out["sampler"], "arithmetic_bytes": counted,
        "gpu_memory_fraction": gpu_memory_fraction(),
        "pool_gib": pool,
        "fits": {chip: max(out["step"]["total"], out["sampling_peak"]) / GIB <= gib
                 for chip, gib in pool.items()},
        "fits_by_arithmetic": {chip: max(counted["step"], counted["sampling"]) / GIB <= gib
                               for chip, gib in pool.items()}}), flush=True)


if __name__ == "__main__":
  app.run(main)
