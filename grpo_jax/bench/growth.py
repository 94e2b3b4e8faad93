"""How the GRPO step's cost grows with completion length, per attention kernel (and rows).

    python -m grpo_jax.bench.growth --out=growth.md      # ~18 min on this project's 2 cores

On the reference model (throughput's ``--init_random`` Qwen3: V 512, D 256, F 768, 4 layers, 4
query heads, 2 key/value heads, head dim 64, tied embeddings; random weights, built in memory),
float32, prompts of P = 32 tokens, G = 8 rollouts per prompt, EOS disabled (every completion
has exactly T tokens): for each kernel of ``--attention`` (``model.attention``: xla, blocked),
T in ``--lengths`` (512, 1024, 2048, 4096) at ``--length_sweep_rows`` (16) rows, and optionally
rows in ``--rows`` at ``--rows_sweep_length``. At each point:

* generation time: the median of ``--steps`` calls of the jitted sampler (``sampler.sample``),
  and per generated token;
* train-step time: the median of ``--steps`` calls of the real ``step.make_train_step`` (GRPO,
  KL 0.04: one no-grad reference pass, then one forward + backward and an AdamW update), on the
  last generated rollouts with random 0/1 rewards;
* peak memory, for the step and the sampler separately: argument + output + temp - alias
  bytes of ``jitted.lower(...).compile().memory_analysis()``. That is XLA's static buffer
  assignment: the most bytes the compiled program's buffers take at once, as planned at compile
  time (arguments, outputs, and the scratch space of its temporaries; outputs that reuse a
  donated argument's buffer counted once), not a measured resident size. An executable that
  plans more than ``--run_limit_gib`` is compiled but not run (its times NaN): the dense kernel
  plans 36.5 GiB at T = 4096 on 16 rows (58.6 GiB before the layer scan);
* model GFLOP of the step (``flops.step_phases``: generation + reference pass + forward +
  backward; attention counted dense).

Both executables are compiled before timing (the compile is not timed), so every timed call
runs compiled code. Then, per sweep and quantity, ``flops.fit_growth``: the exponent of a
log-log least-squares fit, linear and quadratic fits, and the verdict (its docstring states
the rule); and per kernel the long-completion ``targets``. Prints a markdown table (written to
``--out`` too) and one JSON line. Flags are defined only when this runs as a program
(``define_flags``).
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from grpo_jax import console
from grpo_jax.bench import flops as flops_lib
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.models import ModelConfig, Qwen3
from grpo_jax.rl import losses, replay as replay_lib
from grpo_jax.rl import step as step_lib
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.types import Rollout


def define_flags():
  """The command line's flags, defined when this runs as a program, not when it is imported
  (tests import ``measure`` and ``targets`` beside other benchmarks whose flags share names)."""
  # pylint: disable=global-statement
  global _LENGTHS, _ROWS, _LENGTH_ROWS, _ATTENTION, _BLOCK, _RUN_LIMIT, _ROWS_LENGTH
  global _PROMPT_LEN, _GROUP, _STEPS, _KL, _OUT, _VOCAB, _WIDTH, _FFN, _LAYERS
  _LENGTHS = flags.DEFINE_list("lengths", ["512", "1024", "2048", "4096"],
                               "completion lengths T")
  _ROWS = flags.DEFINE_list("rows", [], "rows N = prompts x group size (empty: no rows sweep)")
  _LENGTH_ROWS = flags.DEFINE_integer("length_sweep_rows", 16, "rows of the length sweep")
  _ATTENTION = flags.DEFINE_list("attention", ["xla", "blocked"],
                                 "attention kernels to measure (model.attention)")
  _BLOCK = flags.DEFINE_integer("attention_block", 256, "queries / keys per block of blocked")
  _RUN_LIMIT = flags.DEFINE_float(
      "run_limit_gib", 16.0, "a point whose compiled step or sampler plans more than this many "
      "GiB is compiled (its memory reported) but not run (times NaN)")
  _ROWS_LENGTH = flags.DEFINE_integer("rows_sweep_length", 64, "T of the rows sweep")
  _PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "P")
  _GROUP = flags.DEFINE_integer("group_size", 8, "G (rows must be multiples of it)")
  _STEPS = flags.DEFINE_integer("steps", 2, "timed calls per point (after compiling)")
  _KL = flags.DEFINE_float("kl_coef", 0.04, "KL coefficient of the train step")
  _OUT = flags.DEFINE_string("out", "", "also write the markdown here")
  _VOCAB = flags.DEFINE_integer("vocab", 512, "vocabulary size")
  _WIDTH = flags.DEFINE_integer("width", 256, "hidden size")
  _FFN = flags.DEFINE_integer("intermediate", 768, "SwiGLU width")
  _LAYERS = flags.DEFINE_integer("layers", 4, "layers")


MIB = 2 ** 20
QUANTITIES = (("gen_s", "generation s"), ("gen_ms_per_token", "generation ms / token"),
              ("train_s", "train step s"),
              ("sampler_bytes", "sampler peak bytes"), ("step_bytes", "step peak bytes"),
              ("step_gflop", "step model GFLOP"))


def peak_bytes(compiled) -> float:
  """argument + output + temp - alias bytes of a compiled executable (NaN when unknown)."""
  m = compiled.memory_analysis()
  if m is None:
    return float("nan")
  return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def _median_seconds(call, repeats: int) -> float:
  seconds = []
  for i in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(call(i))
    seconds.append(time.perf_counter() - t0)
  return float(np.median(seconds))


def measure(graphdef, params, rows: int, prompt_len: int, completion_len: int,
            group_size: int, kl_coef: float, repeats: int, run_limit_bytes: float = np.inf
            ) -> dict:
  """Times and compiled memory of the sampler and the train step at one shape.

  Args:
    graphdef, params: the model (``params`` is not donated: the step gets a copy).
    rows: N (a multiple of ``group_size``).
    prompt_len: P.
    completion_len: T.
    group_size: G.
    kl_coef: the step's KL coefficient.
    repeats: timed calls of each executable.
    run_limit_bytes: an executable planning more is compiled but not run; without a
      generated batch the step is compiled on random tokens, and its times are NaN.

  Returns:
    {"attention", "rows", "T", "gen_s", "gen_ms_per_token", "train_s", "sampler_bytes",
     "step_bytes", "step_gflop"}.
  """
  n, p, t, g = rows, prompt_len, completion_len, group_size
  config = nnx.merge(graphdef, params).config
  rng = np.random.RandomState(0)
  ids_NxP = jnp.asarray(np.repeat(rng.randint(0, config.vocab_size, (n // g, p)), g, axis=0),
                        jnp.int32)
  mask_NxP = jnp.ones((n, p), bool)
  sample = sampler_lib.make_sampler(graphdef, sampler_lib.SamplingConfig(
      max_new_tokens=t, eos_ids=(-1,), pad_id=0, temperature=1.0, prompt_group=g))
  sampler = sample.lower(params, ids_NxP, mask_NxP, jax.random.key(0)).compile()
  outs = []

  def generate(i):
    outs.append(sampler(params, ids_NxP, mask_NxP, jax.random.key(i)))
    return outs[-1]

  if peak_bytes(sampler) <= run_limit_bytes:
    gen_s = _median_seconds(generate, repeats)
    out = outs[-1]
  else:
    gen_s = float("nan")
    # Not run: every completion a full T random tokens (as EOS is disabled), log mu = 0.
    shapes = jax.eval_shape(sample, params, ids_NxP, mask_NxP, jax.random.key(0))
    out = jax.tree.map(lambda a: jnp.ones(a.shape, a.dtype) if a.dtype == bool
                       else jnp.zeros(a.shape, a.dtype), shapes)
    out = out.replace(completion_ids=jnp.asarray(rng.randint(1, config.vocab_size, (n, t)),
                                                 jnp.int32),
                      truncated=jnp.ones((n,), bool))
  scores_N = jnp.asarray(rng.randint(0, 2, n), jnp.float32)
  rollout = Rollout(prompt_ids=ids_NxP, prompt_mask=mask_NxP,
                    completion_ids=out.completion_ids, completion_mask=out.completion_mask,
                    behaviour_logp=out.behaviour_logp, scores=scores_N,
                    truncated=out.truncated,
                    success=scores_N > 0, prompt_id=jnp.zeros(n, jnp.int32),
                    version=jnp.zeros(out.completion_ids.shape, jnp.int32))
  tx = optax.adamw(1e-5)
  step_config = StepConfig(group_size=g, loss=losses.LossConfig(kl_coef=kl_coef),
                           num_minibatches=1, logprob_chunk=0)
  holder = {"state": step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx),
            "replay": replay_lib.init_replay(0, g, p, t)}
  step = step_lib.make_train_step(graphdef, tx, step_config).lower(
      holder["state"], holder["replay"], rollout, params, jax.random.key(0)).compile()

  def train(i):
    holder["state"], holder["replay"], metrics = step(holder["state"], holder["replay"],
                                                      rollout, params, jax.random.key(i))
    return metrics

  train_s = (_median_seconds(train, repeats) if peak_bytes(step) <= run_limit_bytes
             else float("nan"))
  gflop = sum(flops_lib.step_phases(config, n, p, t, kl=kl_coef > 0, prox_pass=False,
                                    prompt_group=g).values())
  return {"attention": config.attention, "rows": n, "T": t, "gen_s": gen_s,
          "gen_ms_per_token": 1e3 * gen_s / t, "train_s": train_s,
          "sampler_bytes": peak_bytes(sampler), "step_bytes": peak_bytes(step),
          "step_gflop": gflop / 1e9}


def fits(points: list[dict], x_name: str) -> dict:
  """``flops.fit_growth`` of every quantity of ``points`` against ``points[i][x_name]``
  (a quantity with a NaN point, one that was not run, has no fit)."""
  xs = [pt[x_name] for pt in points]
  return {q: flops_lib.fit_growth(xs, [pt[q] for pt in points]) for q, _ in QUANTITIES
          if np.all(np.isfinite([pt[q] for pt in points]))}


def targets(points: list[dict]) -> list[tuple[str, float, float, bool]]:
  """The long-completion targets of one kernel's length sweep: (what, value, bound, met).

  * step peak memory linear in T: the log-log exponent from T = 1024 to the longest, <= 1.15;
  * step time within 1.3x of its model-FLOP growth: (time ratio) / (GFLOP ratio) between the
    shortest and the longest T that ran, <= 1.3 (model FLOPs count the full score matrix,
    ``flops``; ``blocked`` skips the blocks above the diagonal, about half of them);
  * generation time per token at the longest T <= 1.5x that at the shortest.
  """
  pts = sorted(points, key=lambda pt: pt["T"])
  out = []
  long = [pt for pt in pts if pt["T"] >= 1024]
  if len(long) >= 2:
    e = flops_lib.fit_growth([pt["T"] for pt in long], [pt["step_bytes"] for pt in long])
    out.append((f"step peak memory exponent, T {long[0]['T']}-{long[-1]['T']}", e["exponent"],
                1.15, e["exponent"] <= 1.15))
  ran = [pt for pt in pts if np.isfinite(pt["train_s"])]
  if len(ran) >= 2:
    a, b = ran[0], ran[-1]
    r = (b["train_s"] / a["train_s"]) / (b["step_gflop"] / a["step_gflop"])
    out.append((f"step time growth / model-FLOP growth, T {a['T']}-{b['T']}", r, 1.3, r <= 1.3))
  ran = [pt for pt in pts if np.isfinite(pt["gen_s"])]
  if len(ran) >= 2:
    a, b = ran[0], ran[-1]
    r = b["gen_ms_per_token"] / a["gen_ms_per_token"]
    out.append((f"generation time per token, T {b['T']} / T {a['T']}", r, 1.5, r <= 1.5))
  return out


def markdown(points: list[dict], sweeps: dict, header: str, goals: dict) -> str:
  """The table of docs/results/growth.md: one row per point, one per (sweep, quantity) fit, then
  the targets of each kernel."""
  f3 = lambda v: "not run" if not np.isfinite(v) else f"{v:.3f}"
  lines = [header, "",
           "| attention | rows | T | gen s | gen ms / token | train step s | step GFLOP "
           "| sampler peak MiB | step peak MiB |", "|---|---|---|---|---|---|---|---|---|"]
  for pt in sorted(points, key=lambda pt: (pt["attention"], pt["rows"], pt["T"])):
    lines.append(f"| {pt['attention']} | {pt['rows']} | {pt['T']} | {f3(pt['gen_s'])} | "
                 f"{f3(pt['gen_ms_per_token'])} | {f3(pt['train_s'])} | "
                 f"{pt['step_gflop']:.4g} | {pt['sampler_bytes'] / MIB:.1f} | "
                 f"{pt['step_bytes'] / MIB:.1f} |")
  lines += ["", "| sweep | quantity | log-log exponent | linear b | quadratic c "
            "| x² share at max | growth |", "|---|---|---|---|---|---|---|"]
  for sweep, (x_name, by_quantity) in sweeps.items():
    for q, label in QUANTITIES:
      if q not in by_quantity:
        continue
      f = by_quantity[q]
      quad = "–" if f["quadratic"] is None else f"{f['quadratic'][2]:.3g}"
      share = "–" if f["quadratic_share"] is None else f"{100 * f['quadratic_share']:.0f}%"
      lines.append(f"| {sweep} ({x_name}) | {label} | {f['exponent']:.2f} | "
                   f"{f['linear'][1]:.3g} | {quad} | {share} | {f['growth']} |")
  lines += ["", "| attention | target | value | bound | met |", "|---|---|---|---|---|"]
  for impl, rows in goals.items():
    for what, value, bound, met in rows:
      lines.append(f"| {impl} | {what} | {value:.2f} | {bound} | {'yes' if met else 'no'} |")
  return "\n".join(lines) + "\n"


def main(argv):
  del argv
  console.quiet_unless_verbose()
  cfg = ModelConfig(vocab_size=_VOCAB.value, hidden_size=_WIDTH.value,
                    intermediate_size=_FFN.value, num_layers=_LAYERS.value, num_heads=4,
                    num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
  params = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(0)))[1]
  p, g, steps, kl = _PROMPT_LEN.value, _GROUP.value, _STEPS.value, _KL.value
  lengths = [int(x) for x in _LENGTHS.value]
  rows = [int(x) for x in _ROWS.value]
  shapes = ([(_LENGTH_ROWS.value, t) for t in lengths]
            + [(n, _ROWS_LENGTH.value) for n in rows])
  done, sweeps, goals = {}, {}, {}
  for impl in _ATTENTION.value:
    graphdef = nnx.graphdef(Qwen3(cfg.replace(attention=impl, attention_block=_BLOCK.value),
                                  rngs=nnx.Rngs(0)))
    for n, t in shapes:
      if (impl, n, t) in done:
        continue
      t0 = time.perf_counter()
      pt = done[(impl, n, t)] = measure(graphdef, params, n, p, t, g, kl, steps,
                                        _RUN_LIMIT.value * 2 ** 30)
      print(f"{impl} rows {n} T {t}: gen {pt['gen_s']:.3f}s train {pt['train_s']:.3f}s "
            f"sampler {pt['sampler_bytes'] / MIB:.1f} MiB step {pt['step_bytes'] / MIB:.1f} MiB "
            f"({time.perf_counter() - t0:.0f}s with compiling)", flush=True)
    length_points = [done[(impl, _LENGTH_ROWS.value, t)] for t in lengths]
    sweeps[f"{impl}: length, {_LENGTH_ROWS.value} rows"] = ("T", fits(length_points, "T"))
    if rows:
      sweeps[f"{impl}: rows, T={_ROWS_LENGTH.value}"] = (
          "rows", fits([done[(impl, n, _ROWS_LENGTH.value)] for n in rows], "rows"))
    goals[impl] = targets(length_points)
  header = (f"Cost growth, Qwen3 V{cfg.vocab_size} D{cfg.hidden_size} F{cfg.intermediate_size} "
            f"L{cfg.num_layers} ({cfg.num_params / 1e6:.2f}M params), {cfg.dtype}, backend "
            f"{jax.default_backend()}: P = {p}, G = {g}, KL {kl}, median of {steps} calls, "
            f"blocked attention in blocks of {_BLOCK.value}.")
  table = markdown(list(done.values()), sweeps, header, goals)
  print(table, flush=True)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(table)
  print(json.dumps({"model": dict(vocab=cfg.vocab_size, width=cfg.hidden_size,
                                  intermediate=cfg.intermediate_size, layers=cfg.num_layers),
                    "backend": jax.default_backend(), "prompt_len": p, "group_size": g,
                    "kl_coef": kl, "steps": steps, "points": list(done.values()),
                    "fits": {name: {"x": x_name, **by_q}
                             for name, (x_name, by_q) in sweeps.items()},
                    "targets": {impl: [dict(what=w, value=v, bound=b, met=m)
                                       for w, v, b, m in rows]
                                for impl, rows in goals.items()}}))


if __name__ == "__main__":
  define_flags()
  app.run(main)
