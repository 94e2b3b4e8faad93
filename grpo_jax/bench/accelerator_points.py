"""The accelerator check's measurements, each in a child process that ``bench.accelerator`` starts.

    python -m grpo_jax.bench.accelerator_points SPEC_JSON RESULT_PATH DEADLINE

measures the point ``SPEC_JSON`` names ({"kind": env | parity | train | decode, its keyword
arguments}), writes its result to ``RESULT_PATH`` as JSON and ends itself at ``DEADLINE``
(``time.time()``), should its parent not kill it first. The parent (``bench.accelerator``)
documents the points.

The project's modules are imported inside the functions that need them (hence the file-wide
pylint exception): the environment's point imports JAX alone, so that a machine missing a
package (``ml_collections``, which ``grpo_jax.models`` needs) still reports its device and
versions, and says what is missing, before any other point fails on the import.
"""
# pylint: disable=g-import-not-at-top

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from grpo_jax.bench import bounded, hbm, peak as peak_lib, synthetic_step

MIB = 2 ** 20
GIB = 2 ** 30
# What the measuring points import beyond JAX (flax brings its own), by pip name: read by the
# environment's point, so that a machine without one stops with one line instead of every
# point failing on the same ImportError.
REQUIRED_MODULES = {"flax": "flax", "optax": "optax", "ml_collections": "ml-collections",
                    "yaml": "PyYAML"}


def qwen3_0p6b_shape(tiny: bool):
  """Qwen3-0.6B's shape (28 layers, D 1024, 16 query / 8 key-value heads of 128), bf16 matmuls,
  float32 parameters; ``tiny``: the same head layout at D 64, one layer, V 256."""
  from grpo_jax.models import ModelConfig
  if tiny:
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                       dtype="bfloat16")
  return ModelConfig(vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                     num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                     tie_word_embeddings=True, dtype="bfloat16")


def _device_peak() -> float | None:
  """This process's device peak bytes in use (None on a CPU: no statistics)."""
  stats = jax.devices()[0].memory_stats()
  return float(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def _cudnn_version() -> int | None:
  try:
    from jax._src.lib import cuda_versions
    return int(cuda_versions.cudnn_get_version()) if cuda_versions else None
  except Exception:  # pylint: disable=broad-except
    return None  # no CUDA plugin, or a JAX that moved the private module


def copy_bandwidth(nbytes: int, repeats: int = 10) -> float:
  """Bytes read + written per second of a jitted elementwise pass over ``nbytes`` of random
  float32 (the median of ``repeats`` after a warm-up): the memory ceiling measured, against
  which the datasheet's is a lead."""
  x = jax.random.uniform(jax.random.key(0), (nbytes // 4,))
  bump = jax.jit(lambda a: a + 1.0)
  jax.block_until_ready(bump(x))
  seconds = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(bump(x))
    seconds.append(time.perf_counter() - t0)
  return 2.0 * nbytes / float(np.median(seconds))


def env_point(tiny: bool) -> dict:
  """The environment, read in a child like every measurement (``tiny`` changes nothing)."""
  del tiny
  devices = jax.devices()
  kind = devices[0].device_kind
  stats = devices[0].memory_stats() or {}
  backend = jax.default_backend()
  try:
    info = jax.print_environment_info(return_string=True)
  except Exception as e:  # pylint: disable=broad-except
    info = f"print_environment_info failed: {e}"
  missing = [pip for module, pip in REQUIRED_MODULES.items()
             if importlib.util.find_spec(module) is None]
  return {"backend": backend, "device_kind": kind, "device_count": len(devices),
          "missing_packages": missing,
          "process_count": jax.process_count(), "memory_bytes_limit": stats.get("bytes_limit"),
          "jax": jax.__version__, "jaxlib": jaxlib.__version__, "cudnn": _cudnn_version(),
          "matmul_precision": jax.config.jax_default_matmul_precision,
          "compilation_cache_dir": jax.config.jax_compilation_cache_dir,
          "bf16_peak_flops": peak_lib.chip_peak(kind, "bfloat16"),
          "hbm_bytes_per_s": hbm.hbm_bandwidth(kind),
          # 2 GiB on a device (several times any L2), 16 MiB on a CPU.
          "copy_bytes_per_s": copy_bandwidth(2 * GIB if backend != "cpu" else 16 * MIB),
          "environment_info": info}


def _padded_rows(n: int, s: int):
  """[N, S] key mask of rows padded every way a fused kernel must take: on the left, on the
  right, on both sides, not at all (repeated for N > 4)."""
  first = jnp.array([s // 8, 0, s // 16, 0])[jnp.arange(n) % 4]
  end = jnp.array([s, s - s // 4, s - s // 8, s])[jnp.arange(n) % 4]
  pos = jnp.arange(s)[None]
  return (pos >= first[:, None]) & (pos < end[:, None])


def parity(tiny: bool) -> list[dict]:
  """Each fused kernel this backend has (splash interpreted off a TPU, tiny only) against
  ``flash.flash_attention`` with its non-real queries' outputs zeroed: bf16 inputs, rows padded
  on the left, the right, both sides or not at all, a random cotangent on every position. Max
  |difference| of outputs and of the three input gradients over every position, the largest
  magnitude the kernel leaves at padded positions (outputs and gradients; 0 expected) and
  whether everything it returned is finite."""
  from grpo_jax.models import flash, fused_attention
  backend = jax.default_backend()
  kernels = []
  if backend == "gpu":
    kernels.append(("cudnn", fused_attention.cudnn_attention))
  if backend == "tpu":
    kernels.append(("splash", fused_attention.splash_attention))
  elif tiny:
    kernels.append(("splash (interpreted)",
                    lambda *a: fused_attention.splash_attention(*a, interpret=True)))
  # S = 1280: the qwen3 presets' prompt + completion, not a multiple of splash's 512 block.
  n, s, kh, qh, w = (4, 128, 2, 2, 128) if tiny else (4, 1280, 8, 2, 128)
  ks = jax.random.split(jax.random.key(0), 4)
  bf = lambda a: a.astype(jnp.bfloat16)
  q = bf(jax.random.normal(ks[0], (n, s, kh, qh, w)))
  k, v = (bf(jax.random.normal(kk, (n, s, kh, w))) for kk in ks[1:3])
  key_mask = _padded_rows(n, s)
  real_q = key_mask[:, :, None, None, None]
  cot = bf(jax.random.normal(ks[3], q.shape))
  f32 = lambda a: a.astype(jnp.float32)

  def value_and_grads(fn):
    """fn's outputs and input gradients, compiled with the inputs as arguments (not constants
    XLA would fold on the host)."""
    def run(q, k, v, key_mask, cot):
      out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, key_mask), q, k, v)
      return (out, *vjp(cot))
    return jax.jit(run)(q, k, v, key_mask, cot)

  ref = value_and_grads(lambda q, k, v, key_mask: jnp.where(
      key_mask[:, :, None, None, None], flash.flash_attention(q, k, v, key_mask, 0), 0))
  diff = lambda a, b: float(jnp.max(jnp.abs(f32(a) - f32(b))))
  pads = (~real_q, ~real_q, ~key_mask[:, :, None, None], ~key_mask[:, :, None, None])
  results = []
  for name, kernel in kernels:
    got = value_and_grads(kernel)
    results.append({"kernel": name, "shape": [n, s, kh * qh, w],
                    "max_out_diff": diff(got[0], ref[0]),
                    "max_grad_diff": max(diff(a, b) for a, b in zip(got[1:], ref[1:])),
                    "max_at_padding": max(float(jnp.max(jnp.abs(jnp.where(p, f32(a), 0))))
                                          for a, p in zip(got, pads)),
                    "finite": all(bool(jnp.all(jnp.isfinite(a))) for a in got),
                    "ref_out_scale": float(jnp.max(jnp.abs(f32(ref[0])))),
                    "ref_grad_scale": max(float(jnp.max(jnp.abs(f32(a)))) for a in ref[1:])})
  return results


def parity_point(tiny: bool) -> dict:
  return {"parity": parity(tiny), "device_peak_bytes": _device_peak()}


def run_config(method: str, n: int, g: int, p: int, t: int, attention: str):
  """configs/{method}.py with the qwen3_0p6b preset (the real bf16 configuration: bf16 matmuls,
  float32 master weights, layer remat, query blocks of 256, prox_pass auto) at these shapes."""
  from grpo_jax.schema import files
  config = files.load(f"{method}:qwen3_0p6b")
  config.rollout.update(batch_prompts=n // g, group_size=g, prompt_len=p, completion_len=t)
  config.model.attention = attention
  return config


def _init_model(cfg):
  """(graphdef, params) of a random model, its initialisation one jitted program (eager init
  would compile and dispatch each of a few hundred initialisers on its own)."""
  from flax import nnx
  from grpo_jax.models import Qwen3
  make = lambda: Qwen3(cfg, rngs=nnx.Rngs(0))
  graphdef = nnx.graphdef(nnx.eval_shape(make))
  return graphdef, jax.jit(lambda: nnx.state(make()))()


def train_point(tiny: bool, method: str, attention: str, rows: int, group: int, prompt_len: int,
                completion_len: int, packing: str = "none", lengths: str = "full") -> dict:
  """One train step of the real configuration on synthetic rollouts (random 0/1 scores; every
  completion T tokens, or with ``lengths="lognormal"`` the lengths of ``bench.rollouts``'
  workload: median T / 4, 4% at T), compiled first, then called twice: the second call is
  timed. ``packing``: ``rl.packing`` (``tokens``: the update at the real tokens)."""
  from grpo_jax import configuration
  from grpo_jax.bench import flops as flops_lib, growth
  from grpo_jax.models import attention as attn
  n, g, p, t = rows, group, prompt_len, completion_len
  config = run_config(method, n, g, p, t, attention)
  config.rl.packing = packing
  cfg = qwen3_0p6b_shape(tiny).replace(attention=attention, dtype=config.model.dtype,
                                       param_dtype=config.model.param_dtype)
  step_config = configuration.step_config(config)
  graphdef, params = _init_model(cfg)
  rollout = synthetic_step.rollout(n, g, p, t, cfg.vocab_size, lengths)
  completion_mask = np.asarray(rollout.completion_mask)
  timed = synthetic_step.timed_step(graphdef, params, config, rollout)
  train_s, metrics, step, compile_s, first_s = (timed[k] for k in (
      "train_s", "metrics", "step", "compile_s", "first_s"))
  group_ = g if step_config.shared_prompts else 1
  phases = flops_lib.step_phases(cfg, n, p, t, kl=step_config.loss.kl_coef > 0,
                                 prox_pass=step_config.prox_pass == "all",
                                 epochs=step_config.num_epochs, prompt_group=group_)
  step_flops = sum(v for k, v in phases.items() if k != "generation")
  kind = jax.devices()[0].device_kind
  chip = peak_lib.chip_peak(kind, cfg.dtype, jax.config.jax_default_matmul_precision)
  return {"method": method, "attention": attention, "resolved": attn.resolve(attention, p + t),
          "rows": n, "G": g, "P": p, "T": t, "dtype": cfg.dtype, "packing": packing,
          "lengths": lengths, "real_tokens": int(np.sum(completion_mask)) + n // g * p,
          "update_useful_fraction": float(metrics["update_useful_fraction"]),
          "prox_pass": step_config.prox_pass, "minibatches": step_config.num_minibatches,
          "remat": step_config.remat, "train_s": train_s, "first_call_s": first_s,
          "train_tokens_per_s": n * (p + t) / train_s, "step_flops": step_flops,
          "train_mfu": None if chip is None else step_flops / train_s / chip,
          "planned_step_bytes": growth.peak_bytes(step), "device_peak_bytes": _device_peak(),
          "compile_s": compile_s}


def decode_point(tiny: bool, attention: str, rows: int, group: int, prompt_len: int,
                 completion_len: int) -> dict:
  """The sampler (shared-prompt prefill, then T - 1 decode steps, EOS disabled) compiled, then
  called twice: the second call is timed. ``step_s`` is its seconds over T (the prefill of N / G
  prompts is counted in), so the bandwidth fractions are lower bounds."""
  from grpo_jax.bench import growth
  from grpo_jax.generate import sampler as sampler_lib
  from grpo_jax.models import attention as attn
  n, g, p, t = rows, group, prompt_len, completion_len
  cfg = qwen3_0p6b_shape(tiny).replace(attention=attention)
  graphdef, params = _init_model(cfg)
  ids, mask = synthetic_step.prompts(n, g, p, cfg.vocab_size)
  sample = sampler_lib.make_sampler(graphdef, sampler_lib.SamplingConfig(
      max_new_tokens=t, eos_ids=(-1,), pad_id=0, temperature=1.0, prompt_group=g))
  t0 = time.perf_counter()
  sampler = sample.lower(params, ids, mask, jax.random.key(0)).compile()
  compile_s = time.perf_counter() - t0
  first_s, _ = synthetic_step.timed(lambda: sampler(params, ids, mask, jax.random.key(0)))
  gen_s, _ = synthetic_step.timed(lambda: sampler(params, ids, mask, jax.random.key(1)))
  moved = hbm.decode_bytes(cfg, n, p, t)
  env = json.loads(os.environ.get("GRPO_JAX_ACCELERATOR_ENV", "{}"))
  spec_bw = hbm.hbm_bandwidth(jax.devices()[0].device_kind)
  rate = moved["total"] / gen_s
  copy_bw = env.get("copy_bytes_per_s")
  # The decode step's own kernel: ``attention.cache_kernel`` where the models have it (a Pallas
  # decode kernel on a GPU), else the cache passes run ``blocked`` under every kernel but xla.
  cache_kernel = getattr(attn, "cache_kernel", None)
  resolved = (cache_kernel(attention, 1, p + t) if cache_kernel else
              "xla" if attn.resolve(attention, p + t) == "xla" else "blocked")
  return {"attention": attention, "resolved": resolved, "rows": n, "G": g,
          "P": p, "T": t, "dtype": cfg.dtype, "gen_s": gen_s, "first_call_s": first_s,
          "tokens_per_s": n * t / gen_s, "step_s": gen_s / t,
          "bytes_per_step": moved["per_step"], "weights_bytes": moved["weights_per_step"],
          "decode_bytes": moved["total"], "bytes_per_s": rate, "hbm_bytes_per_s": spec_bw,
          "hbm_fraction": None if spec_bw is None else rate / spec_bw,
          "copy_fraction": rate / copy_bw if copy_bw else None,
          "planned_bytes": growth.peak_bytes(sampler), "device_peak_bytes": _device_peak(),
          "compile_s": compile_s}


def rollouts_point(tiny: bool, rows: int, group: int, prompt_len: int, completion_len: int,
                   staleness: int = 4, steps: int = 2) -> dict:
  """Static batch against partial rollouts (``bench.rollouts``) on the log-normal lengths
  (median T / 4, 4% at T) of the benchmark's stop rule: ``rows`` rows (B = rows / G groups a
  step) in both, the pipeline at ``staleness``, chunks of T / 32; ``steps`` timed steps each
  after one (static) or 1 + staleness (pipeline) untimed. Generation only."""
  from grpo_jax.bench import rollouts as rollouts_lib
  from grpo_jax.generate import producer as producer_lib, sampler as sampler_lib
  n, g, p, t = rows, group, prompt_len, completion_len
  cfg = qwen3_0p6b_shape(tiny).replace(attention="auto")
  graphdef, params = _init_model(cfg)
  config = sampler_lib.SamplingConfig(max_new_tokens=t, eos_ids=(cfg.vocab_size,), pad_id=0,
                                      temperature=1.0, prompt_group=g)

  def producer(static):
    draw = rollouts_lib.length_sampler("lognormal", t, np.random.default_rng(0))
    return producer_lib.Producer(graphdef, config, cfg, slots=n, prompt_len=p,
                            chunk=max(1, t // 32), max_staleness=staleness, static=static,
                            prompts=rollouts_lib.prompt_source(cfg.vocab_size, p, g, draw, 0))

  static = rollouts_lib.run_mode(producer(True), params, n // g, 1, steps)
  pipe = rollouts_lib.run_mode(producer(False), params, n // g, 1 + staleness, steps)
  key = "generation_us_per_useful_token"
  speedup = static[key] / pipe[key]
  return {"rows": n, "G": g, "P": p, "T": t, "staleness": staleness, "static": static,
          "pipeline": pipe, "generation_speedup_per_useful_token": speedup,
          "summary": (f"useful fraction static {static['useful_fraction']:.3f}, partial "
                      f"{pipe['useful_fraction']:.3f}; generation {speedup:.2f}x faster per "
                      f"useful token (N {n}, P {p}, T {t}, staleness {staleness})")}


POINTS = {"env": env_point, "parity": parity_point, "train": train_point,
          "decode": decode_point, "rollouts": rollouts_point}


def child_main(spec: dict, result_path: str, deadline: float) -> None:
  """A child's whole life: bound itself, set up JAX, measure, write the result."""
  if deadline:
    bounded.exit_at(deadline)
  if spec.pop("hang", False):
    time.sleep(3600)  # the parent's kill ends this (tests of the cut)
  from grpo_jax import console
  from grpo_jax.run import compilation_cache
  console.quiet_third_party()
  compilation_cache.enable()
  kind = spec.pop("kind")
  result = POINTS[kind](**spec)
  bounded.write_atomic(result_path, json.dumps(_finite(result)))


def _finite(tree):
  """``tree`` with non-finite floats as None (strict JSON: NaN is not a JSON value)."""
  if isinstance(tree, dict):
    return {k: _finite(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_finite(v) for v in tree]
  return None if isinstance(tree, float) and not math.isfinite(tree) else tree


def main(argv: list[str]) -> None:
  child_main(json.loads(argv[1]), argv[2], float(argv[3]))


if __name__ == "__main__":
  main(sys.argv)
