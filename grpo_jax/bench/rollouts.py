"""Static batch vs partial rollouts on heavy-tailed completion lengths.

    python -m grpo_jax.bench.rollouts                      # T = 512, 1,024 and 2,048
    python -m grpo_jax.bench.rollouts --completion_len=1024

Each row's completion length is drawn from ``--lengths`` (``bench.lengths``: the default
log-normal of median 0.25 T with 4% of rows at T, ``uniform``, or a ``file`` of measured
lengths) and enforced by a benchmark-only stop rule (``pool.Pool.stop_at``; the model's EOS is
an id it never draws), so the lengths are the workload, not the model. Per T, on the embedded
model (``--model``), B = ``--groups`` groups of G = ``--group_size`` rows per step:

* ``static``: today's schedule (``producer.Producer(static=True)``): B groups prefilled
  together and decoded until the longest row ends.
* ``pipeline`` at each ``--staleness``: ``--slots`` rows in flight (default B x G, the static
  batch's memory), chunks of ``--chunk`` decode steps, a step ends as soon as B groups are
  complete, unfinished rows continue after the update (``--cache``: ``keep`` or ``reprefill``;
  ``--compare_cache`` runs the other one too at ``--default_staleness``, and the JSON gains its
  useful fraction and ``<cache>_generation_time_ratio``, its seconds per useful token over
  ``--cache``'s).

Measured over ``--steps`` steps after ``--warmup`` (compilation and the pipeline's fill
excluded, and the drain: rows still in flight at the end are followed, untimed, until trained
or discarded). Per mode: tokens generated, token positions computed (decode row-steps of every
slot, prefill and re-prefill positions), the useful-slot fraction (useful tokens over positions
computed; a useful token is one decoded inside the measured window whose row is trained, in the
window or in the drain: ``run_mode``), wall seconds per useful token of generation, and of the whole step
(generation plus one update, the same in both modes, timed apart: the forward and backward
pass of the train step's log-prob pass, ``policy.logprobs``, over B x G rows whose completions
have the workload's lengths, each prompt once per group, with an Adam step; padded,
``rl.packing=none``, and with ``--packing`` also packed, ``tokens``). The last line is one JSON
object; its ``static_useful_fraction``, ``pipeline_useful_fraction``,
``generation_speedup_per_useful_token`` and ``step_speedup_per_useful_token`` (static over
pipeline seconds per useful token: > 1 is faster) are at ``default_staleness``; with
``--packing`` also ``update_useful_fraction`` (the packed loss pass's real tokens over its
positions computed; ``update_useful_fraction_none`` the padded one's),
``update_speedup_per_token`` (padded over packed update time, the same real tokens) and
``step_speedup_per_useful_token_packed`` (the static sampler with the padded update over
partial rollouts with the packed one).

``sampler_vs_static_pool``: today's ``sampler.sample`` and the static pool each decode the
same B x G rows to exactly T tokens, timed once after a compiling call: the pool's per-row
cache writes against the sampler's one slice (the ratio is the sampler's time over the pool's);
and a run's static round (``static_round``, the pool drawing the sampler's tokens) the same way
(``round_over_sampler``).
"""

from __future__ import annotations

import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from grpo_jax import assets, console
from grpo_jax.bench import lengths as lengths_lib, synthetic_step
from grpo_jax.generate import producer as producer_lib, sampler as sampler_lib
from grpo_jax.generate import static_round
from grpo_jax.models import from_pretrained
from grpo_jax.rl import policy
from grpo_jax.rl.batch import Tokens
from grpo_jax.rl.step_config import StepConfig

FLAGS = flags.FLAGS
LENGTHS = ("lognormal", "uniform", "file")


def define_flags() -> None:
  """The command's flags (defined only when this module is the program)."""
  flags.DEFINE_string("model", assets.EMBEDDED_MODEL, "Hugging Face model folder.")
  flags.DEFINE_integer("completion_len", 0, "T; 0 runs 512, 1,024 and 2,048.")
  flags.DEFINE_integer("prompt_len", 32, "P, prompt tokens per row.")
  flags.DEFINE_integer("groups", 16, "B, groups trained per step.")
  flags.DEFINE_integer("group_size", 8, "G, rows per group.")
  flags.DEFINE_integer("slots", 0, "rows in flight in the pipeline; 0 = B x G.")
  flags.DEFINE_integer("chunk", 16, "pipeline decode steps between two harvests.")
  flags.DEFINE_list("staleness", ["1", "2", "4"], "pipeline max_staleness values.")
  flags.DEFINE_integer("default_staleness", 4, "the staleness the JSON's headline is at.")
  flags.DEFINE_enum("cache", "keep", ["keep", "reprefill"], "a continued row's KV cache.")
  flags.DEFINE_bool("compare_cache", False, "also run the pipeline at --default_staleness "
                    "with the other --cache, in the same process.")
  flags.DEFINE_enum("lengths", "lognormal", LENGTHS, "completion-length distribution.")
  flags.DEFINE_string("lengths_file", None, "measured lengths (``--lengths=file``).")
  flags.DEFINE_float("median", 0.25, "log-normal median, a fraction of T.")
  flags.DEFINE_float("at_limit", 0.04, "log-normal share of rows reaching T.")
  flags.DEFINE_integer("warmup", 3, "steps before the measured ones (the pipeline adds its "
                       "staleness).")
  flags.DEFINE_integer("steps", 4, "measured steps per mode.")
  flags.DEFINE_bool("check_sampler", True, "time sampler.sample against the static pool.")
  flags.DEFINE_bool("packing", True, "also time the update with rl.packing=tokens.")
  flags.DEFINE_list("train_step_methods", ["grpo", "popo"],
                    "configs whose own train step is timed padded and packed on the workload's "
                    "lengths (a quarter of the groups ineffective); empty: none.")
  flags.DEFINE_integer("seed", 0, "lengths, prompts and keys.")


def length_sampler(kind: str, t: int, rng: np.random.Generator, *, median: float = 0.25,
                   at_limit: float = 0.04, measured=None):
  """``draw(n) -> int32 [n]`` completion lengths in [1, T]."""
  if kind == "lognormal":
    return lambda n: lengths_lib.lognormal(rng, (n,), t, median, at_limit)
  if kind == "uniform":
    return lambda n: lengths_lib.uniform(rng, (n,), t)
  if kind == "file":
    return lambda n: lengths_lib.from_file(rng, (n,), t, measured)
  raise ValueError(f"--lengths must be one of {LENGTHS}, got {kind!r}")


def prompt_source(vocab: int, p: int, g: int, draw, seed: int):
  """``prompts()`` for a ``Producer``: random prompts of 1..P tokens, lengths from ``draw``."""
  rng = np.random.default_rng(seed + 1)
  key = jax.random.key(seed)
  serial = [0]

  def prompts():
    i = serial[0]
    serial[0] += 1
    real = int(rng.integers(p // 2, p + 1))
    ids = np.zeros(p, np.int32)
    ids[p - real:] = rng.integers(2, vocab, real)
    mask = np.arange(p) >= p - real
    return (i, ids, mask, draw(g), producer_lib.key_data(jax.random.fold_in(key, i), g))
  return prompts


def run_mode(producer: producer_lib.Producer, params, b: int, warmup: int, steps: int) -> dict:
  """``steps`` timed steps (generation, then ``advance``) after ``warmup`` untimed ones, then
  untimed drain steps until no group that could hold a token of the window is left.

  Useful tokens are the tokens decoded inside the timed window (version, the updates before
  the token was drawn, in the window's versions) of rows that are trained, in the window or
  while draining: a token decoded during the warm-up and trained in the window is not
  credited (``useful_fraction`` can never exceed 1), and a row in flight when the window ends
  is credited with its window tokens once it is trained (at most ``max_staleness`` + 1 steps
  later: by then it is trained or discarded). The steady state's share, without the bias of a
  short window's edges. ``tokens_trained_all`` counts every token of the rows handed out in
  the window, wherever it was decoded.
  """
  for _ in range(warmup):
    producer.take(params, b)
    producer.advance(params)
  start_counts = producer_lib.Counts(**vars(producer.counts))
  start_version = producer.version
  seconds, taken = 0.0, []
  for _ in range(steps):
    t0 = time.perf_counter()
    groups = producer.take(params, b)
    producer.advance(params)  # a discard (and a re-prefill) belong to the generation
    jax.block_until_ready(producer.pool.tokens)
    seconds += time.perf_counter() - t0
    taken += groups
  c = producer.counts.minus(start_counts)
  in_flight, end_version = producer.in_flight(), producer.version
  trained_all = c.tokens_trained
  # The drain: a group admitted before the window ended may hold window tokens; it leaves
  # (trained or discarded) within max_staleness + 1 steps.
  for _ in range(producer.max_staleness + 1):
    oldest = producer.oldest_held()
    if oldest is None or oldest >= end_version:
      break
    taken += producer.take(params, b)
    producer.advance(params)
  window = lambda g: (g.versions >= start_version) & (g.versions < end_version)
  trained = sum(int(np.sum(window(g)[g.tokens_mask()])) for g in taken)
  return {"generation_s": round(seconds, 3), "tokens_generated": c.tokens_generated,
          "tokens_trained": trained, "tokens_trained_all": trained_all,
          "positions": c.positions,
          "decode_positions": c.decode_positions, "prefill_positions": c.prefill_positions,
          "reprefill_positions": c.reprefill_positions,
          "useful_fraction": round(trained / max(c.positions, 1), 4),
          "groups_trained": c.groups_trained, "groups_discarded": c.groups_discarded,
          "in_flight_at_end": in_flight,
          "generation_us_per_useful_token": round(1e6 * seconds / max(trained, 1), 3)}


def update_seconds(graphdef, params, ids, mask, completions, completion_mask, group: int,
                   packing: str = "none", rows_per_pass: int = 16) -> tuple[float, float]:
  """(wall seconds of one update after a compiling one, the loss pass's useful-token
  fraction): forward and backward of the train step's log-prob pass (``policy.logprobs``,
  each prompt once per group of ``group`` rows, ``rl.packing=packing``) over the rows,
  ``rows_per_pass`` at a time with the gradients summed (the dense attention's scores of all
  128 rows at T = 2,048 would not fit this machine's memory), an Adam step. The rows'
  completions end where ``completion_mask`` says (the workload's lengths)."""
  tx = optax.adam(1e-5)
  n = ids.shape[0]
  per = math.gcd(n, rows_per_pass)  # rows a pass: divides the rows
  chunks = lambda a: a.reshape((n // per, per) + a.shape[1:])
  config = StepConfig(group_size=group, packing=packing, num_minibatches=1, logprob_chunk=0)

  def loss(p, part):
    tokens = Tokens(*part)
    logp, _ = policy.logprobs(graphdef, p, tokens, config, grouped=True)
    return -jnp.sum(logp * tokens.completion_mask) / n

  @jax.jit
  def step(p, opt):
    add = lambda g, part: (jax.tree.map(jnp.add, g, jax.grad(loss)(p, part)), None)
    grads, _ = jax.lax.scan(add, jax.tree.map(jnp.zeros_like, p),
                            tuple(map(chunks, (ids, mask, completions, completion_mask))))
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt

  p, opt = params, tx.init(params)
  times = []
  for _ in range(2):  # the first call compiles
    t0 = time.perf_counter()
    p, opt = jax.block_until_ready(step(p, opt))
    times.append(time.perf_counter() - t0)
  counts = [policy.pass_tokens(Tokens(*part), config, True) for part in zip(
      *map(chunks, (ids, mask, completions, completion_mask)))]
  real, computed = (float(sum(c[i] for c in counts)) for i in range(2))
  return times[-1], real / computed


def train_step_compare(method: str, graphdef, params, model_config, b: int, g: int, p: int,
                       t: int, completion_mask) -> dict:
  """The run's own train step (``configs/<method>.py``, the embedded preset at these shapes,
  minibatches of 16 rows) over B x G rows whose completions end where ``completion_mask``
  says (the workload's lengths), padded and packed
  (``synthetic_step.timed_step``: compiled, called once, the second call timed). A quarter
  of the groups are ineffective (all 0), so POPO fills their slots from the groups the first
  call stored and its step runs the pi_prox pass over the replayed rows. Returns per packing
  the step's seconds and its metrics' useful fractions and replayed rows, and the padded over
  packed time (the same rows and real tokens: the speedup per real token)."""
  from grpo_jax.schema import files
  n = b * g
  out = {}
  for packing in ("none", "tokens"):
    config = files.load(method)
    config.rollout.update(batch_prompts=b, group_size=g, prompt_len=p, completion_len=t)
    config.rl.update(num_minibatches=max(1, n // 16), packing=packing)
    rollout = synthetic_step.rollout(n, g, p, t, model_config.vocab_size,
                                                   ineffective=0.25,
                                                   completion_mask=completion_mask)
    timed = synthetic_step.timed_step(graphdef, params, config, rollout)
    m = timed["metrics"]
    out[packing] = {"train_s": round(timed["train_s"], 3),
                    "update_useful_fraction": round(m["update_useful_fraction"], 4),
                    "replay_rows": m.get("replay_rows", 0.0), "loss": m["loss"]}
  out["speedup_per_token"] = round(out["none"]["train_s"] / out["tokens"]["train_s"], 3)
  return out


def sampler_check(graphdef, params, model_config, config, rows: int, p: int) -> dict:
  """The sampler's loop, the static pool and a run's static round (``static_round``) on the
  same rows, every row to T (see module doc)."""
  t = config.max_new_tokens
  rng = np.random.default_rng(0)
  ids = rng.integers(2, model_config.vocab_size, (rows, p)).astype(np.int32)
  mask = np.ones((rows, p), bool)
  sample = sampler_lib.make_sampler(graphdef, config)
  flat = lambda: (0, ids[0], mask[0], np.full(config.prompt_group, t, np.int32),
                  producer_lib.key_data(jax.random.key(0), config.prompt_group))
  round_fn = static_round.make_round_fn(graphdef, config)
  times = {}
  for name in ("sampler", "pool", "round"):
    for i in range(2):
      t0 = time.perf_counter()
      if name == "sampler":
        jax.block_until_ready(sample(params, ids, mask, jax.random.key(i)).completion_ids)
      elif name == "round":
        jax.block_until_ready(round_fn(params, ids, mask, jax.random.key(i)).completion_ids)
      else:
        producer = producer_lib.Producer(graphdef, config, model_config, slots=rows, prompt_len=p,
                                    chunk=t, max_staleness=0, prompts=flat, static=True)
        producer.take(params, rows // config.prompt_group)
      times[name] = time.perf_counter() - t0
  return {"sampler_s": round(times["sampler"], 3), "static_pool_s": round(times["pool"], 3),
          "sampler_over_pool": round(times["sampler"] / times["pool"], 3),
          "static_round_s": round(times["round"], 3),
          "round_over_sampler": round(times["round"] / times["sampler"], 3)}


def bench_length(t: int, graphdef, params, model_config) -> dict:
  """Every mode at completion length T."""
  b, g, p = FLAGS.groups, FLAGS.group_size, FLAGS.prompt_len
  slots = FLAGS.slots or b * g
  measured = lengths_lib.read_lengths(FLAGS.lengths_file) if FLAGS.lengths == "file" else None
  config = sampler_lib.SamplingConfig(max_new_tokens=t, eos_ids=(model_config.vocab_size,),
                                      pad_id=0, temperature=1.0, prompt_group=g)

  def producer(static, staleness, cache=FLAGS.cache):
    rng = np.random.default_rng(FLAGS.seed)
    draw = length_sampler(FLAGS.lengths, t, rng, median=FLAGS.median, at_limit=FLAGS.at_limit,
                          measured=measured)
    return producer_lib.Producer(
        graphdef, config, model_config, slots=b * g if static else slots, prompt_len=p,
        chunk=FLAGS.chunk, max_staleness=staleness, static=static,
        reprefill=cache == "reprefill",
        prompts=prompt_source(model_config.vocab_size, p, g, draw, FLAGS.seed))

  out = {"completion_len": t, "static": run_mode(producer(True, 0), params, b, FLAGS.warmup,
                                                 FLAGS.steps)}
  print(json.dumps({"completion_len": t, "static": out["static"]}), flush=True)
  for s in sorted(int(v) for v in FLAGS.staleness):
    key = f"pipeline_staleness_{s}"
    out[key] = run_mode(producer(False, s), params, b, FLAGS.warmup + s, FLAGS.steps)
    print(json.dumps({"completion_len": t, key: out[key]}), flush=True)  # kept if later fails
  if FLAGS.compare_cache:
    s, other = FLAGS.default_staleness, {"keep": "reprefill", "reprefill": "keep"}[FLAGS.cache]
    key = f"pipeline_staleness_{s}_{other}"
    out[key] = run_mode(producer(False, s, other), params, b, FLAGS.warmup + s, FLAGS.steps)
    print(json.dumps({"completion_len": t, key: out[key]}), flush=True)
  rng = np.random.default_rng(0)
  ids = np.repeat(rng.integers(2, model_config.vocab_size, (b, p)), g, axis=0).astype(np.int32)
  completions = rng.integers(2, model_config.vocab_size, (b * g, t)).astype(np.int32)
  lengths = length_sampler(FLAGS.lengths, t, rng, median=FLAGS.median, at_limit=FLAGS.at_limit,
                           measured=measured)(b * g)
  completion_mask = np.arange(t)[None] < np.asarray(lengths)[:, None]
  args = (graphdef, params, ids, np.ones((b * g, p), bool), completions, completion_mask, g)
  update, update_fraction = update_seconds(*args, packing="none")
  out["update_s"], out["update_useful_fraction_none"] = round(update, 4), round(
      update_fraction, 4)
  packed = None
  if FLAGS.packing:
    packed, packed_fraction = update_seconds(*args, packing="tokens")
    out["update_packed_s"] = round(packed, 4)
    out["update_useful_fraction"] = round(packed_fraction, 4)
  for key, mode in list(out.items()):
    if isinstance(mode, dict):
      mode["step_us_per_useful_token"] = round(
          1e6 * (mode["generation_s"] + FLAGS.steps * update) / max(mode["tokens_trained"], 1),
          3)
      if packed is not None:
        mode["packed_step_us_per_useful_token"] = round(
            1e6 * (mode["generation_s"] + FLAGS.steps * packed)
            / max(mode["tokens_trained"], 1), 3)
  for method in FLAGS.train_step_methods:
    out[f"train_step_{method}"] = train_step_compare(method, graphdef, params, model_config, b,
                                                     g, p, t, completion_mask)
    print(json.dumps({"completion_len": t, method: out[f"train_step_{method}"]}), flush=True)
  if FLAGS.check_sampler:
    out["sampler_vs_static_pool"] = sampler_check(graphdef, params, model_config, config,
                                                  b * g, p)
  return out


def headline(results: list[dict], staleness: int) -> dict:
  """The JSON's summary at ``staleness`` over the lengths run (the largest T's figures first)."""
  last = results[-1]
  static, pipe = last["static"], last.get(f"pipeline_staleness_{staleness}")
  if pipe is None:
    raise ValueError(f"--default_staleness={staleness} is not among --staleness")
  ratio = lambda k: round(static[k] / pipe[k], 3)
  out = {"completion_len": last["completion_len"], "default_staleness": staleness,
         "static_useful_fraction": static["useful_fraction"],
         "pipeline_useful_fraction": pipe["useful_fraction"],
         "generation_speedup_per_useful_token": ratio("generation_us_per_useful_token"),
         "step_speedup_per_useful_token": ratio("step_us_per_useful_token")}
  if "update_packed_s" in last:  # --packing: the update at the real tokens
    out["update_useful_fraction_none"] = last["update_useful_fraction_none"]
    out["update_useful_fraction"] = last["update_useful_fraction"]
    # The same rows and real tokens in both: the time ratio is the ratio per real token.
    out["update_speedup_per_token"] = round(last["update_s"] / last["update_packed_s"], 3)
    # Partial rollouts and the packed update against the static sampler and padded update.
    out["step_speedup_per_useful_token_packed"] = round(
        static["step_us_per_useful_token"] / pipe["packed_step_us_per_useful_token"], 3)
  for key in (k for k in last if k.startswith("train_step_")):  # --train_step_methods
    method = key[len("train_step_"):]
    out[f"{method}_step_useful_fraction"] = last[key]["tokens"]["update_useful_fraction"]
    out[f"{method}_step_useful_fraction_none"] = last[key]["none"]["update_useful_fraction"]
    out[f"{method}_step_speedup_per_token"] = last[key]["speedup_per_token"]
  for key in (f"pipeline_staleness_{staleness}_{c}" for c in ("keep", "reprefill")):
    if key in last:  # --compare_cache: the other cache's generation time over this one's
      cache = key.rsplit("_", 1)[1]
      out[f"{cache}_useful_fraction"] = last[key]["useful_fraction"]
      out[f"{cache}_generation_time_ratio"] = round(
          last[key]["generation_us_per_useful_token"] / pipe["generation_us_per_useful_token"],
          3)
  return out


def main(argv):
  del argv
  console.quiet_unless_verbose()
  if FLAGS.lengths == "file" and not FLAGS.lengths_file:
    raise app.UsageError("--lengths=file needs --lengths_file")
  if FLAGS.default_staleness not in [int(v) for v in FLAGS.staleness]:
    raise app.UsageError(f"--default_staleness={FLAGS.default_staleness} is not among "
                         f"--staleness={','.join(FLAGS.staleness)}")
  model = from_pretrained(FLAGS.model)
  graphdef, params = nnx.split(model)
  lengths = [FLAGS.completion_len] if FLAGS.completion_len else [512, 1024, 2048]
  results = []
  for t in lengths:
    results.append(bench_length(t, graphdef, params, model.config))
    print(json.dumps(results[-1]), flush=True)
  summary = headline(results, FLAGS.default_staleness)
  summary["by_length"] = {
      r["completion_len"]: {k: {"useful_fraction": v["useful_fraction"],
                                "generation_us_per_useful_token":
                                    v["generation_us_per_useful_token"]}
                            for k, v in r.items() if isinstance(v, dict) and "useful_fraction"
                            in v} for r in results}
  if FLAGS.lengths == "lognormal":  # the static fraction's bound: every batch reaching T
    summary["expected_mean_length_over_T"] = round(lengths_lib.expected_capped_mean(
        summary["completion_len"], FLAGS.median, FLAGS.at_limit), 4)
  print(json.dumps(summary))


if __name__ == "__main__":
  define_flags()
  app.run(main)
