"""The accelerator check: one command for the first minutes on a GPU or TPU.

    python -m grpo_jax.bench.accelerator --out_dir=/tmp/accel          # on the device, < 8 min
    python -m grpo_jax.bench.accelerator --tiny --notests --out_dir=D  # anywhere (tests/ runs it)

In order, each part timed and stopped early when ``--budget_s`` is spent (what was skipped is
said in the output):

1. **tests**: ``pytest`` of the files that exercise the device paths (``--test_files``: the
   attention kernels, the model against transformers' logits, the sampler), pass/fail counts.
2. **parity**: the backend's fused kernels against ``blocked`` (``flash``), bf16, head width 128:
   ``cudnn`` on a GPU, ``splash`` on a TPU (in Pallas' interpreter elsewhere, at the tiny
   shape), rows padded left, right, both sides and not at all: largest output and gradient
   differences over every position, and what the kernel leaves at padded ones (0 expected).
3. **steps**: a random Qwen3-0.6B-shaped model (``--tiny``: a 1-layer toy) in bfloat16 matmuls
   with float32 master weights, per completion length in ``--lengths`` and attention kernel in
   ``--attention``: the sampler (N rows, EOS disabled: every completion T tokens) and a GRPO
   train step on its rollouts, then a POPO step (replay, the decoupled objective) with ``auto``.
   Generation and training tokens/s, model-FLOP utilisation against the chip's specification
   (``peak.chip_peak``; NaN for unknown chips and CPUs), the compiled step's planned peak
   (``memory_analysis``, as ``bench.memory`` predicts it) and the device's real peak
   (``memory_stats()['peak_bytes_in_use']``, cumulative over the process; None on a CPU).

Writes ``accelerator.json`` (everything) and ``accelerator.md`` (one table) into ``--out_dir``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from grpo_jax import console, replay as replay_lib, sampler as sampler_lib
from grpo_jax import step as step_lib
from grpo_jax.bench import flops as flops_lib, growth, peak as peak_lib
from grpo_jax.models import ModelConfig, Qwen3, attention as attn, flash, fused_attention
from grpo_jax.types import Rollout

_OUT = flags.DEFINE_string("out_dir", "", "where accelerator.json / accelerator.md go")
_TINY = flags.DEFINE_bool("tiny", False, "toy shapes (a CPU check of the script itself)")
_TESTS = flags.DEFINE_bool("tests", True, "run the device-path test files first")
_TEST_FILES = flags.DEFINE_list(
    "test_files", ["tests/test_attention.py", "tests/test_models.py", "tests/test_sampler.py"],
    "test files of part 1")
_LENGTHS = flags.DEFINE_list("lengths", ["1024", "4096"], "completion lengths T of part 3")
_ATTENTION = flags.DEFINE_list("attention", ["xla", "blocked", "auto"],
                               "kernels of the GRPO steps (auto = cudnn / splash on a device)")
_ROWS = flags.DEFINE_integer("rows", 8, "N rows per step (prompts x group size)")
_GROUP = flags.DEFINE_integer("group_size", 4, "G")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "P")
_BUDGET = flags.DEFINE_float("budget_s", 420.0, "stop starting new measurements after this")

MIB = 2 ** 20


def qwen3_0p6b_shape(tiny: bool) -> ModelConfig:
  """Qwen3-0.6B's shape (28 layers, D 1024, 16 query / 8 key-value heads of 128), bf16 matmuls,
  float32 parameters; ``tiny``: the same head layout at D 64, one layer, V 256."""
  if tiny:
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True,
                       dtype="bfloat16")
  return ModelConfig(vocab_size=151_936, hidden_size=1024, intermediate_size=3072,
                     num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                     tie_word_embeddings=True, dtype="bfloat16")


def run_tests(files) -> dict:
  """pytest of ``files`` in a subprocess: {"returncode", "summary", "seconds"}."""
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-n", "0",
                         *files], capture_output=True, text=True, check=False)
  lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
  return {"returncode": proc.returncode, "summary": lines[-1] if lines else "",
          "seconds": time.perf_counter() - t0}


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


def _device_peak() -> float | None:
  stats = jax.devices()[0].memory_stats()
  return None if not stats else float(stats.get("peak_bytes_in_use", float("nan")))


def _method(name: str, g: int, p: int, t: int, n: int):
  """(StepConfig, empty replay buffer) of configs/{name}.py at these shapes: no KL, layer
  remat, LM-head chunks of 1,024 positions."""
  import importlib  # pylint: disable=g-import-not-at-top
  from grpo_jax import configuration  # pylint: disable=g-import-not-at-top
  config = importlib.import_module(f"configs.{name}").get_config()
  config.rollout.update(batch_prompts=n // g, group_size=g, prompt_len=p, completion_len=t)
  config.rl.update(kl_coef=0.0, logprob_chunk=1024)
  config.model.remat = "layer"
  method = configuration.replay_config(config)
  capacity = config.replay.capacity if name != "grpo" else 0
  return (configuration.step_config(config),
          replay_lib.init_replay(capacity, method.entry_size(g), p, t))


def step_point(cfg: ModelConfig, impl: str, method: str, n: int, g: int, p: int, t: int) -> dict:
  """Sampler then one train step (compiled first, then timed once) at one shape and kernel."""
  model = Qwen3(cfg.replace(attention=impl), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  rng = np.random.RandomState(0)
  ids = jnp.asarray(np.repeat(rng.randint(1, cfg.vocab_size, (n // g, p)), g, 0), jnp.int32)
  mask = jnp.ones((n, p), bool)
  sample = sampler_lib.make_sampler(graphdef, sampler_lib.SamplingConfig(
      max_new_tokens=t, eos_ids=(-1,), pad_id=0, temperature=1.0, prompt_group=g))
  t0 = time.perf_counter()
  sampler = sample.lower(params, ids, mask, jax.random.key(0)).compile()
  compile_gen = time.perf_counter() - t0
  jax.block_until_ready(sampler(params, ids, mask, jax.random.key(0)))  # warm
  t0 = time.perf_counter()
  out = jax.block_until_ready(sampler(params, ids, mask, jax.random.key(1)))
  gen_s = time.perf_counter() - t0
  scores = jnp.asarray(rng.randint(0, 2, n), jnp.float32)
  rollout = Rollout(prompt_ids=ids, prompt_mask=mask, completion_ids=out.completion_ids,
                    completion_mask=out.completion_mask, behaviour_logp=out.behaviour_logp,
                    scores=scores, truncated=out.truncated, success=scores > 0,
                    prompt_id=jnp.arange(n, dtype=jnp.int32) // g,
                    version=jnp.zeros(n, jnp.int32))
  tx = optax.adamw(1e-6)
  step_config, replay = _method(method, g, p, t, n)
  state = step_lib.init_train_state(params, tx)
  fn = step_lib.make_train_step(graphdef, tx, step_config)
  t0 = time.perf_counter()
  step = fn.lower(state, replay, rollout, None, jax.random.key(0)).compile()
  compile_step = time.perf_counter() - t0
  planned = growth.peak_bytes(step)
  state, replay, _ = step(state, replay, rollout, None, jax.random.key(0))  # warm
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  state, replay, _ = step(state, replay, rollout, None, jax.random.key(1))
  jax.block_until_ready(state)
  train_s = time.perf_counter() - t0
  phases = flops_lib.step_phases(cfg, n, p, t, kl=False, prox_pass=False, prompt_group=g)
  chip = peak_lib.chip_peak(jax.devices()[0].device_kind, cfg.dtype)
  mfu = lambda flop, s: float("nan") if chip is None else flop / s / chip
  return {"method": method, "attention": impl, "resolved": attn.resolve(impl, p + t),
          "rows": n, "P": p, "T": t, "gen_s": gen_s, "gen_tokens_per_s": n * t / gen_s,
          "gen_mfu": mfu(phases["generation"], gen_s), "train_s": train_s,
          "train_tokens_per_s": n * (p + t) / train_s,
          "train_mfu": mfu(phases["forward_backward"], train_s),
          "planned_step_bytes": planned, "device_peak_bytes": _device_peak(),
          "compile_s": compile_gen + compile_step}


def markdown(result: dict) -> str:
  """The one table of accelerator.md, with the tests' and parity lines above it."""
  lines = [f"Accelerator check: {result['device']} ({result['backend']}), {result['model']}.", ""]
  if result.get("tests"):
    lines.append(f"tests: {result['tests']['summary']} ({result['tests']['seconds']:.0f} s)")
  for pr in result["parity"]:
    lines.append(f"parity {pr['kernel']} vs blocked {pr['shape']}: output "
                 f"{pr['max_out_diff']:.3g}, gradients {pr['max_grad_diff']:.3g} (bf16; scales "
                 f"{pr['ref_out_scale']:.3g}, {pr['ref_grad_scale']:.3g}); at padding "
                 f"{pr['max_at_padding']:.3g} (0 expected), finite {pr['finite']}")
  lines += ["", "| method | attention (ran) | T | gen tokens/s | gen MFU | train tokens/s "
            "| train MFU | planned step MiB | device peak MiB | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  pct = lambda v: "n/a" if not math.isfinite(v) else f"{100 * v:.1f}%"
  mib = lambda v: "n/a" if v is None or not math.isfinite(v) else f"{v / MIB:.0f}"
  for pt in result["steps"]:
    lines.append(f"| {pt['method']} | {pt['attention']} ({pt['resolved']}) | {pt['T']} | "
                 f"{pt['gen_tokens_per_s']:.0f} | {pct(pt['gen_mfu'])} | "
                 f"{pt['train_tokens_per_s']:.0f} | {pct(pt['train_mfu'])} | "
                 f"{mib(pt['planned_step_bytes'])} | {mib(pt['device_peak_bytes'])} | "
                 f"{pt['compile_s']:.0f} |")
  for what in result["skipped"]:
    lines.append(f"\nskipped (time budget): {what}")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  console.quiet_unless_verbose()
  start = time.perf_counter()
  tiny = _TINY.value
  cfg = qwen3_0p6b_shape(tiny)
  result = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "model": ("toy Qwen3 (tiny)" if tiny else
                      f"random Qwen3-0.6B shape ({cfg.num_params / 1e6:.0f}M params)")
                     + ", bf16 matmuls, float32 weights, layer remat",
            "tests": None, "parity": [], "steps": [], "skipped": []}
  if _TESTS.value:
    result["tests"] = run_tests(_TEST_FILES.value)
    print(f"tests: {result['tests']['summary']}", flush=True)
  result["parity"] = parity(tiny)
  for pr in result["parity"]:
    print(f"parity {pr['kernel']}: out {pr['max_out_diff']:.3g} grad "
          f"{pr['max_grad_diff']:.3g} at padding {pr['max_at_padding']:.3g} finite "
          f"{pr['finite']}", flush=True)
  lengths = [int(x) for x in _LENGTHS.value] if not tiny else [16]
  n, g, p = (_ROWS.value, _GROUP.value, _PROMPT_LEN.value) if not tiny else (4, 2, 8)
  plan = [("grpo", impl, t) for t in lengths for impl in _ATTENTION.value]
  plan += [("popo", "auto", t) for t in lengths]
  for method, impl, t in plan:
    if time.perf_counter() - start > _BUDGET.value:
      result["skipped"].append(f"{method} {impl} T={t}")
      continue
    try:
      pt = step_point(cfg, impl, method, n, g, p, t)
    except Exception as e:  # pylint: disable=broad-except
      # An out-of-memory or unsupported shape on a device: recorded, the check goes on.
      result["skipped"].append(f"{method} {impl} T={t}: {type(e).__name__}: {str(e)[:200]}")
      print(f"{method} {impl} T={t}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
      continue
    result["steps"].append(pt)
    print(f"{method} {impl} T={t}: gen {pt['gen_tokens_per_s']:.0f} tok/s, train "
          f"{pt['train_tokens_per_s']:.0f} tok/s, planned {pt['planned_step_bytes'] / MIB:.0f} "
          f"MiB", flush=True)
  result["seconds"] = time.perf_counter() - start
  table = markdown(result)
  print(table, flush=True)
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "accelerator.json"), "w") as f:
      json.dump(result, f, indent=1)
    with open(os.path.join(_OUT.value, "accelerator.md"), "w") as f:
      f.write(table)


if __name__ == "__main__":
  app.run(main)
