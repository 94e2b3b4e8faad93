"""Compiled memory of the train step at Qwen3-0.6B shape, with and without LM-head chunking.

    python -m grpo_jax.bench.memory --batch_prompts=2 --group_size=4 --prompt_len=64 \
        --completion_len=512 --num_minibatches=2 --chunk=1024

Builds the Qwen3-0.6B architecture (V = 151,936, D = 1024, 28 layers) with abstract parameters
only (``nnx.eval_shape``: ShapeDtypeStructs, no weights allocated), lowers and compiles the
jitted train step (``step.make_train_step``, AdamW, plain GRPO, no replay) for abstract inputs,
and prints XLA's ``memory_analysis()`` of the executable for ``logprob_chunk=0`` (the full
float32 [N, T, V] logits of every log-prob pass) and for ``logprob_chunk=--chunk``. Nothing
runs, so the numbers describe the backend this compiles for (CPU by default), whose buffer
assignment may differ from an accelerator's. ``--kl_coef > 0`` adds the reference pass.

Columns (GiB): argument (state, rollouts, reference params), output, alias (outputs written in
place of donated arguments), temp (XLA's scratch buffers: activations, logits, gradients) and
total = argument + output - alias + temp, the executable's peak footprint as XLA reports it.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
from absl import app, flags
from flax import nnx

from grpo_jax import losses, replay as replay_lib, step as step_lib
from grpo_jax.models import ModelConfig, Qwen3
from grpo_jax.types import Rollout

_PROMPTS = flags.DEFINE_integer("batch_prompts", 2, "B, prompts per step")
_GROUP = flags.DEFINE_integer("group_size", 4, "G, rollouts per prompt")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "P")
_COMPLETION_LEN = flags.DEFINE_integer("completion_len", 512, "T")
_MINIBATCHES = flags.DEFINE_integer("num_minibatches", 2, "minibatches per step")
_CHUNK = flags.DEFINE_integer("chunk", 1024, "logprob_chunk of the 'after' configuration")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                           "parameter and compute dtype")
_KL = flags.DEFINE_float("kl_coef", 0.0, "KL coefficient (> 0 adds the reference pass)")

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
  rollout = Rollout(prompt_ids_NxP=s((n, p), jnp.int32), prompt_mask_NxP=s((n, p), bool),
                    completion_ids_NxT=s((n, t), jnp.int32),
                    completion_mask_NxT=s((n, t), bool),
                    behaviour_logp_NxT=s((n, t), jnp.float32), scores_N=s((n,), jnp.float32),
                    success_N=s((n,), bool), prompt_id_N=s((n,), jnp.int32),
                    version_N=s((n,), jnp.int32))
  key = jax.eval_shape(lambda: jax.random.key(0))
  return graphdef, state, replay, rollout, (params if with_ref else None), key


def measure(chunk: int) -> dict:
  """Compile the train step with ``logprob_chunk=chunk``; its memory stats and timings."""
  b, g, p, t = _PROMPTS.value, _GROUP.value, _PROMPT_LEN.value, _COMPLETION_LEN.value
  cfg = qwen3_0_6b(_DTYPE.value)
  tx = optax.adamw(1e-6)
  graphdef, *args = abstract_inputs(cfg, tx, b, g, p, t, _KL.value > 0)
  config = step_lib.StepConfig(group_size=g, num_minibatches=_MINIBATCHES.value,
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


if __name__ == "__main__":
  app.run(main)
