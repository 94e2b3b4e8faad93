"""Sampler throughput: completion tokens per second of the jitted prefill + decode loop.

    python -m grpo_jax.bench.sampler_throughput --num_rows=128 --completion_len=64

Prompts are random tokens of exactly ``--prompt_len``; with ``--ignore_eos`` (default) every
row generates exactly ``--completion_len`` tokens, so tokens/s is rows * T / seconds. Compile
time is reported separately and excluded from the median.
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from grpo_jax import assets
from grpo_jax import console
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.models import from_pretrained

_MODEL = flags.DEFINE_string("model", assets.EMBEDDED_MODEL, "Hugging Face model folder.")
_ROWS = flags.DEFINE_integer("num_rows", 128, "N, rows sampled together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 24, "P, prompt tokens per row.")
_COMPLETION_LEN = flags.DEFINE_integer("completion_len", 64, "T, tokens generated per row.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed calls after the compiling one.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "param/compute dtype.")
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", True, "generate all T tokens in every row.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "sampling temperature.")


def main(argv):
  del argv
  console.quiet_unless_verbose()
  model = from_pretrained(_MODEL.value, param_dtype=_DTYPE.value, dtype=_DTYPE.value)
  graphdef, params = nnx.split(model)
  vocab = model.config.vocab_size
  eos = (-1,) if _IGNORE_EOS.value else (1,)
  config = sampler_lib.SamplingConfig(max_new_tokens=_COMPLETION_LEN.value, eos_ids=eos,
                                      pad_id=0, temperature=_TEMPERATURE.value)
  sample = sampler_lib.make_sampler(graphdef, config)
  rng = np.random.RandomState(0)
  ids = rng.randint(0, vocab, (_ROWS.value, _PROMPT_LEN.value)).astype(np.int32)
  mask = np.ones_like(ids, bool)
  start = time.perf_counter()
  out = jax.block_until_ready(sample(params, ids, mask, jax.random.key(0)))
  compile_s = time.perf_counter() - start
  times, tokens = [], []
  for i in range(_REPEATS.value):
    start = time.perf_counter()
    out = jax.block_until_ready(sample(params, ids, mask, jax.random.key(i + 1)))
    times.append(time.perf_counter() - start)
    tokens.append(int(np.asarray(out.lengths).sum()))
  median = float(np.median(times))
  print(json.dumps({
      "model": _MODEL.value, "backend": jax.default_backend(), "dtype": _DTYPE.value,
      "rows": _ROWS.value, "prompt_len": _PROMPT_LEN.value, "completion_len": _COMPLETION_LEN.value,
      "first_call_s": round(compile_s, 3), "median_s": round(median, 4),
      "completion_tokens_per_s": round(float(np.median(tokens)) / median, 1)}))


if __name__ == "__main__":
  app.run(main)
