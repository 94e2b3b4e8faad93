"""Full GRPO step timing: generation + reference/policy log-probs + one update.

    python -m grpo_jax.bench.throughput --model=DIR --num_prompts=16 --group_size=8 \
        --prompt_len=32 --completion_len=64 --steps=6

Random prompts of exactly ``prompt_len`` tokens; EOS disabled so every completion has exactly
``completion_len`` tokens; random 0/1 rewards (so every group teaches); float32; KL coefficient
0.04 (one no-grad reference pass inside the same jit); one minibatch, one epoch. The first
step (compilation) is excluded from the medians. ``--init_random`` first writes a randomly
initialised Qwen3 of the given shape to ``--model`` (the issue's reference model by default).

``--methods=grpo,popo --ineffective_fraction=0.5`` times the train step of each method on the
same rollouts in the same run (steps alternate), with that fraction of groups given constant
rewards so POPO refills them from its buffer: the cost of the buffer, as a ratio. A method's
presets set its pi_prox pass too (``popo:prox_chunks=0``: the pass over the whole batch,
``popo:prox=interpolate``: none; ``headroom:walk=2``: the candidate pass in two chunks).

``--rows_equal`` adds, for each method that trains on more rows than the N fresh ones (rollout
replay's extra rows, Headroom-Drift's extra groups: ``extra_rows``), a GRPO step on that many
rows (the step's rollout with its first groups repeated: a step's cost depends on its shapes
only), so that ``{method}_over_grpo_equal_rows`` is the method's overhead alone, the rows it
trains on being its own choice. POPO trains on N rows: its ratio is the plain one.

``--phases`` (the default) then times each phase alone on the last step's rollouts, each its own
jitted function (first call compiles and is excluded, then ``steps - 1`` timed calls): (a)
generation (the timings above), (b) one no-grad log-prob pass over the batch
(``policy.logprobs``), (c) one forward + backward (``jax.value_and_grad`` of the
masked-mean log-prob). For each it prints the median seconds, the model GFLOP
(``bench/flops.py``: matmuls and attention products, 2 per multiply-add), the achieved GFLOP/s
and the utilisation: achieved / the peak of ``--dtype`` (``bench/peak.py``: the chip's
specification on a known accelerator, else a 2048^3 ``jnp.dot`` measured here; both the float32
and bfloat16 peaks are printed). Then the whole step's model FLOPs (generation plus
``flops.step_phases`` of the first method, without replayed rows) over ``step_s_median``, and
the train step's alone over ``train_s_median``. ``--dtype=bfloat16`` keeps float32 parameters and
computes in bfloat16.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from grpo_jax import configuration
from grpo_jax import console
from grpo_jax.bench import flops as flops_lib, peak as peak_lib
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.models import ModelConfig, Qwen3, from_pretrained, save_pretrained
from grpo_jax.rl import batch as batch_lib, policy, step as step_lib
from grpo_jax.rl import losses, replay as replay_lib
from grpo_jax.rl.replay import method as method_lib
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.schema import files
from grpo_jax.types import Rollout

_MODEL = flags.DEFINE_string("model", "/tmp/qwen3_bench", "Hugging Face Qwen3 folder.")
_INIT = flags.DEFINE_bool("init_random", False, "write a random Qwen3 of the shape below first")
_VOCAB = flags.DEFINE_integer("vocab", 512, "--init_random: vocabulary size")
_WIDTH = flags.DEFINE_integer("width", 256, "--init_random: hidden size")
_FFN = flags.DEFINE_integer("intermediate", 768, "--init_random: SwiGLU width")
_LAYERS = flags.DEFINE_integer("layers", 4, "--init_random: layers")
_PROMPTS = flags.DEFINE_integer("num_prompts", 16, "B")
_GROUP = flags.DEFINE_integer("group_size", 8, "G")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "P")
_COMPLETION_LEN = flags.DEFINE_integer("completion_len", 64, "T")
_STEPS = flags.DEFINE_integer("steps", 6, "steps, the first of which compiles")
_KL = flags.DEFINE_float("kl_coef", 0.04, "KL coefficient (0 skips the reference pass)")
_METHODS = flags.DEFINE_list("methods", ["grpo"], "train steps to time: config files under "
                             "configs/ with optional presets (grpo, popo, rollout_replay, "
                             "headroom, popo:filter)")
_INEFFECTIVE = flags.DEFINE_float("ineffective_fraction", 0.0,
                                  "fraction of groups given constant rewards")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "compute dtype (parameters stay float32)")
_PHASES = flags.DEFINE_bool("phases", True, "time generation, one log-prob pass and one "
                            "forward + backward separately; model FLOPs and utilisation")
_SHARED = flags.DEFINE_bool("shared_prompts", True, "run each prompt once for its G rows in the "
                            "sampler's prefill and every log-prob pass (the default of the "
                            "train loop); --noshared_prompts: every row [prompt; completion]")
_ROWS_EQUAL = flags.DEFINE_bool("rows_equal", False, "also time GRPO on as many rows as each "
                                "method trains on (fresh + replayed), for the overhead ratio "
                                "at equal rows")
_PEAK_SIZE = flags.DEFINE_integer("peak_size", 2048, "--phases: matrix side of the measured "
                                  "GEMM peak")


def main(argv):
  del argv
  console.quiet_unless_verbose()
  if _INIT.value and not os.path.exists(os.path.join(_MODEL.value, "config.json")):
    cfg = ModelConfig(vocab_size=_VOCAB.value, hidden_size=_WIDTH.value,
                      intermediate_size=_FFN.value, num_layers=_LAYERS.value, num_heads=4,
                      num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
    save_pretrained(Qwen3(cfg, rngs=nnx.Rngs(0)), _MODEL.value)
  model = from_pretrained(_MODEL.value, dtype=_DTYPE.value)
  graphdef, params = nnx.split(model)
  b, g, p, t = _PROMPTS.value, _GROUP.value, _PROMPT_LEN.value, _COMPLETION_LEN.value
  n = b * g
  sample = sampler_lib.make_sampler(graphdef, sampler_lib.SamplingConfig(
      max_new_tokens=t, eos_ids=(-1,), pad_id=0, temperature=1.0,
      prompt_group=g if _SHARED.value else 1))
  tx = optax.adamw(1e-5)
  ref_params = jax.tree.map(jnp.copy, params)
  runs = {}
  for method in _METHODS.value:
    replay_method, capacity, run_config = _replay_method(method, b, g)
    config = StepConfig(group_size=g, loss=losses.LossConfig(kl_coef=_KL.value),
                                 replay=replay_method, shared_prompts=_SHARED.value,
                                 prox_estimate=run_config.prox.estimate,
                                 prox_chunks=run_config.prox.chunks, num_minibatches=1,
                                 logprob_chunk=0)
    runs[method] = dict(
        config=config, step=step_lib.make_train_step(graphdef, tx, config),
        state=step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx),
        replay=replay_lib.init_replay(capacity, replay_method.entry_size(g), p, t), train_s=[])
  # GRPO at each other method's row count (--rows_equal): "grpo_rows<M>".
  equal = {}
  for method in list(runs) if _ROWS_EQUAL.value else []:
    extra = runs[method]["config"].replay.extra_rows(n, g)
    if extra and f"grpo_rows{n + extra}" not in runs:
      if extra % g:
        raise app.UsageError(f"--rows_equal: {method} adds {extra} rows, not whole groups of {g}")
      config = StepConfig(group_size=g, loss=losses.LossConfig(kl_coef=_KL.value),
                                   replay=method_lib.NoReplay(), shared_prompts=_SHARED.value,
                                   num_minibatches=1, logprob_chunk=0)
      runs[f"grpo_rows{n + extra}"] = dict(
          config=config, step=step_lib.make_train_step(graphdef, tx, config),
          state=step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx),
          replay=replay_lib.init_replay(0, g, p, t), train_s=[], rows=n + extra)
    equal[method] = f"grpo_rows{n + extra}" if extra else "grpo"
  rng = np.random.RandomState(0)
  gen_s, step_s = [], []
  n_constant = int(round(_INEFFECTIVE.value * b))
  for i in range(_STEPS.value):
    ids = np.repeat(rng.randint(0, model.config.vocab_size, (b, p)), g, axis=0).astype(np.int32)
    mask = np.ones_like(ids, bool)
    first = runs[_METHODS.value[0]]
    t0 = time.perf_counter()
    out = jax.block_until_ready(sample(first["state"].params, ids, mask, jax.random.key(i)))
    t1 = time.perf_counter()
    scores_np = rng.randint(0, 2, (b, g)).astype(np.float32)
    scores_np[:, :2] = [1.0, 0.0]  # every group mixed ...
    scores_np[:n_constant] = 0.0  # ... except the first n_constant, all wrong
    scores = jnp.asarray(scores_np.reshape(n))
    rollout = Rollout(prompt_ids=jnp.asarray(ids), prompt_mask=jnp.asarray(mask),
                      completion_ids=out.completion_ids, completion_mask=out.completion_mask,
                      behaviour_logp=out.behaviour_logp, truncated=out.truncated,
                      scores=scores, success=scores > 0,
                      prompt_id=jnp.zeros(n, jnp.int32),
                      version=jnp.full(out.completion_ids.shape, i, jnp.int32))
    line = f"step {i}: gen {t1 - t0:.3f}s"
    for method, run in runs.items():
      rows = _repeat_rows(rollout, run["rows"]) if "rows" in run else rollout
      run["fed_rows"] = rows.num_rows
      t2 = time.perf_counter()
      run["state"], run["replay"], metrics = run["step"](run["state"], run["replay"], rows,
                                                         ref_params, jax.random.key(i))
      jax.block_until_ready(metrics)
      dt = time.perf_counter() - t2
      if i:
        run["train_s"].append(dt)
      line += f" {method} train {dt:.3f}s"
      if "replay_rows" in metrics:
        line += f" (replayed rows {int(metrics['replay_rows'])})"
    if i:  # the first step compiles
      gen_s.append(t1 - t0)
      step_s.append(t1 - t0 + runs[_METHODS.value[0]]["train_s"][-1])
    print(line, flush=True)
  train_s = runs[_METHODS.value[0]]["train_s"]
  med = lambda x: float(np.median(x)) if x else float("nan")
  extra = {}
  if _PHASES.value:
    extra = phase_report(graphdef, ref_params, model.config, rollout, med(gen_s), med(step_s),
                         med(train_s), max(_STEPS.value - 1, 1),
                         runs[_METHODS.value[0]]["config"])
  print(json.dumps({
      "model": _MODEL.value, "backend": jax.default_backend(), "rows": n, "prompt_len": p,
      "completion_len": t, "params": model.config.num_params, "step_s_median": round(med(step_s), 4),
      "gen_s_median": round(med(gen_s), 4), "train_s_median": round(med(train_s), 4),
      "completion_tokens_per_s": round(n * t / med(step_s), 1),
      **{f"{m}_train_s_median": round(med(r["train_s"]), 4) for m, r in runs.items()},
      **{f"{m}_over_grpo_train": round(med(r["train_s"]) / med(runs["grpo"]["train_s"]), 3)
         for m, r in runs.items() if m != "grpo" and "grpo" in runs},
      **{f"{m}_fed_rows": r["fed_rows"] for m, r in runs.items() if _ROWS_EQUAL.value},
      **{f"{m}_over_grpo_equal_rows": round(med(runs[m]["train_s"]) / med(runs[e]["train_s"]), 3)
         for m, e in equal.items() if m != "grpo" and e in runs},
      **{f"{m}_buffer_bytes": r["replay"].nbytes for m, r in runs.items() if "rows" not in r},
      "dtype": _DTYPE.value, **extra}))


def _repeat_rows(rollout: Rollout, rows: int) -> Rollout:
  """The rollout grown to ``rows`` rows (a multiple of G) by repeating its first rows: the
  same shapes as a batch of that many fresh rows, whole groups kept whole."""
  n = rollout.num_rows
  idx = jnp.arange(rows) % n
  return jax.tree.map(lambda x: x[idx], rollout)


def _median_seconds(fn, args, repeats: int) -> float:
  """Median wall time of ``fn(*args)`` over ``repeats`` calls after one (compiling) call."""
  jax.block_until_ready(fn(*args))
  seconds = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    seconds.append(time.perf_counter() - t0)
  return float(np.median(seconds))


def phase_report(graphdef, params, config: ModelConfig, rollout: Rollout, gen_s: float,
                 step_s: float, train_s: float, repeats: int,
                 step_config: StepConfig) -> dict:
  """Times a log-prob pass and a forward + backward alone; prints every phase's utilisation.

  Args:
    graphdef, params: the model.
    config: its ModelConfig.
    rollout: the rows to time on (N rows, P + T tokens).
    gen_s, step_s, train_s: median generation, whole-step and train-step seconds measured by
      the main loop.
    repeats: timed calls per phase.
    step_config: the first method's step (its KL and prox pass decide the step's FLOPs).

  Returns:
    The JSON fields: ``{phase}_s_median`` (new timings), ``{phase}_gflop``,
    ``{phase}_gflops_per_s`` and ``{phase}_util`` for phase in gen, logprob, fwd_bwd, train
    (the whole train step) and step (generation + train step); the peaks in GFLOP/s and their
    source.
  """
  n, p = rollout.prompt_ids.shape
  t = rollout.completion_ids.shape[1]
  batch = batch_lib.Tokens.of(rollout)
  mask_NxT = rollout.completion_mask.astype(jnp.float32)

  # The bench's prompts repeat by construction: the pass the step takes, without its check
  # (the step makes the check around the whole gradient, not inside it).
  grouped = step_config.shared_prompts

  def logp(params, batch):
    return policy.logprobs(graphdef, params, batch, step_config, grouped=grouped)[0]

  def masked_mean_logp(params, batch):
    return jnp.sum(logp(params, batch) * mask_NxT) / jnp.maximum(jnp.sum(mask_NxT), 1.0)

  seconds = {
      "gen": gen_s,
      "logprob": _median_seconds(jax.jit(logp), (params, batch), repeats),
      "fwd_bwd": _median_seconds(jax.jit(jax.value_and_grad(masked_mean_logp)), (params, batch),
                                 repeats),
  }
  shape = (config, n, p, t)
  # The FLOPs the passes compute: fewer with shared prompts (counted as run, not as before).
  group = step_config.group_size if step_config.shared_prompts else 1
  step_flops = flops_lib.step_phases(*shape, kl=step_config.loss.kl_coef > 0,
                                     prox_pass=step_config.prox_pass == "all",
                                     epochs=step_config.num_epochs, prompt_group=group)
  gen_flops = step_flops["generation"]
  train_flops = sum(v for k, v in step_flops.items() if k != "generation")
  model_flops = {
      "gen": gen_flops,
      "logprob": flops_lib.forward_flops(*shape, lm_head_positions=t, prompt_group=group),
      "fwd_bwd": flops_lib.train_flops(*shape, lm_head_positions=t, prompt_group=group),
      "train": train_flops,
      "step": gen_flops + train_flops,
  }
  seconds.update(train=train_s, step=step_s)
  peaks, source = {}, None
  for dtype in ("float32", "bfloat16"):
    peaks[dtype], src = peak_lib.peak_and_source(dtype, size=_PEAK_SIZE.value)
    source = src if dtype == config.dtype else source
  peak = peaks[config.dtype]
  print(f"peak GEMM: float32 {peaks['float32'] / 1e9:.1f} GFLOP/s, bfloat16 "
        f"{peaks['bfloat16'] / 1e9:.1f} GFLOP/s ({source}); utilisation against {config.dtype}")
  out = {"peak_float32_gflops": round(peaks["float32"] / 1e9, 1),
         "peak_bfloat16_gflops": round(peaks["bfloat16"] / 1e9, 1), "peak_source": source}
  names = {"gen": "generation", "logprob": "log-prob pass (no grad)",
           "fwd_bwd": "forward + backward", "train": "train step (jit)",
           "step": "whole step (gen + train)"}
  for phase, name in names.items():
    rate = model_flops[phase] / seconds[phase]
    util = rate / peak
    print(f"{name:>26}: {seconds[phase]:.4f} s, {model_flops[phase] / 1e9:.3g} GFLOP, "
          f"{rate / 1e9:.1f} GFLOP/s, utilisation {100 * util:.1f}%")
    if phase in ("logprob", "fwd_bwd"):
      out[f"{phase}_s_median"] = round(seconds[phase], 4)
    out.update({f"{phase}_gflop": float(f"{model_flops[phase] / 1e9:.4g}"),
                f"{phase}_gflops_per_s": round(rate / 1e9, 2), f"{phase}_util": round(util, 4)})
  return out


def _replay_method(name: str, b: int, g: int):
  """(replay method, buffer capacity, the run config) of configs/<name>.py[:presets] at this
  batch shape (the step takes its pi_prox settings, the ``prox`` group, from the config too).

  Warm-up is switched off so that replay happens from the second step on.
  """
  config = files.load(name)
  config.rollout.batch_prompts, config.rollout.group_size = b, g
  config.replay.prioritized.warmup_steps = 0
  method = configuration.replay_method(config)
  return method, (config.replay.capacity if config.replay.method != "none" else 0), config


if __name__ == "__main__":
  app.run(main)
