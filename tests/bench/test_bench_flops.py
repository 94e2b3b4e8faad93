"""Model FLOP counts (bench/flops.py), the GEMM peak (bench/peak.py), the growth fits, and the
throughput / growth command lines."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from grpo_jax.bench import flops, growth, peak
from grpo_jax.generate import logprobs, sampler as sampler_lib
from grpo_jax.models import ModelConfig, Qwen3

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# By hand: V = 10, D = 4, F = 6, L = 2, H = 2, K = 1, Dh = 2.
HAND = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=2)
# Weight matmuls per token and layer, in multiply-adds:
#   q D x H*Dh = 4 * 4 = 16, k and v D x K*Dh = 4 * 2 = 8 each, o H*Dh x D = 16,
#   gate, up D x F and down F x D = 3 * 4 * 6 = 72; sum 120 MACs = 240 FLOPs per layer,
#   480 FLOPs per token over the 2 layers.
MATMUL_PER_TOKEN = 480
# Attention per (query, key slot) and layer: scores H * Dh = 4 MACs + values H * Dh = 4 MACs,
# 8 MACs = 16 FLOPs; 32 FLOPs over the 2 layers.
ATTENTION_PER_PAIR = 32
# LM head per position: D * V = 40 MACs = 80 FLOPs.
HEAD_PER_POSITION = 80


def test_per_token_pieces_by_hand():
  assert flops.matmul_flops_per_token(HAND) == MATMUL_PER_TOKEN
  assert flops.attention_flops(HAND, 1, 1) == ATTENTION_PER_PAIR
  assert flops.attention_flops(HAND, 3, 5) == 15 * ATTENTION_PER_PAIR
  assert flops.lm_head_flops(HAND, 3) == 3 * HEAD_PER_POSITION
  # The LM head costs the same tied or not; K only enters the k/v projections.
  assert flops.lm_head_flops(HAND.replace(tie_word_embeddings=True), 3) == 240
  assert flops.attention_flops(HAND.replace(num_kv_heads=2), 3, 5) == 15 * ATTENTION_PER_PAIR


def test_forward_and_train_flops_by_hand():
  # Rows 2, P = 2, T = 3, so S = 5 tokens per row; LM head at the T = 3 completion positions.
  # Per row: 5 tokens * 480 = 2400 (matmuls) + 5 * 5 slots * 32 = 800 (full masked S x S
  # attention, not the causal 15 pairs) + 3 * 80 = 240 (head) = 3440; 2 rows: 6880.
  assert flops.forward_flops(HAND, 2, 2, 3, lm_head_positions=3) == 6880
  # The LM head at every position (Qwen3.__call__): 2 * (2400 + 800 + 5 * 80) = 7200.
  assert flops.forward_flops(HAND, 2, 2, 3, lm_head_positions=5) == 7200
  # Forward + backward: 3 x 6880.
  assert flops.train_flops(HAND, 2, 2, 3, lm_head_positions=3) == 20640


def test_generation_flops_by_hand():
  # Rows 2, P = 2, T = 3: a cache of P + T = 5 slots.
  # Prefill per row: 2 tokens * 480 = 960 + 2 queries * 5 slots * 32 = 320 + head at the last
  # position 80 = 1360.
  # Decode, T - 1 = 2 steps per row, each 480 + 1 * 5 * 32 = 160 + 80 = 720: 1440.
  # Per row 2800; 2 rows: 5600.
  assert flops.generation_flops(HAND, 2, 2, 3) == 5600
  # T = 1: the prefill alone (cache of 3 slots): 2 * (960 + 2 * 3 * 32 + 80) = 2464.
  assert flops.generation_flops(HAND, 2, 2, 1) == 2464


def test_shared_prompt_flops_by_hand():
  # Rows 4 in 2 groups of 2, P = 2, T = 3. Grouped log-prob pass: 2 prompts of 2 tokens,
  # 2 * 480 = 960 + 2 x 2 attention 4 * 32 = 128 -> 1088 each, 2176 for both; per row
  # T' = T - 1 = 2 completion tokens: 2 * 480 = 960 + 2 queries x (2 + 2) keys * 32 = 256 +
  # head at T = 3 positions 240 = 1456, 4 rows 5824. Total 2176 + 5824 = 8000.
  assert flops.forward_flops(HAND, 4, 2, 3, lm_head_positions=3, prompt_group=2) == 8000
  # (per row unshared: 4 * 3440 = 13760)
  assert flops.forward_flops(HAND, 4, 2, 3, lm_head_positions=3) == 13760
  assert flops.train_flops(HAND, 4, 2, 3, lm_head_positions=3, prompt_group=2) == 24000
  # Rows not a multiple of the group: counted per row.
  assert flops.forward_flops(HAND, 3, 2, 3, lm_head_positions=3, prompt_group=2) == 3 * 3440
  # Generation: prefill of 2 prompts (1360 each) + 4 rows x 1440 decode = 2720 + 5760 = 8480.
  assert flops.generation_flops(HAND, 4, 2, 3, prompt_group=2) == 8480
  phases = flops.step_phases(HAND, 4, 2, 3, kl=True, prox_pass=False, prompt_group=2)
  assert phases == {"generation": 8480, "reference": 8000, "prox": 0,
                    "forward_backward": 24000}


def test_step_phases_by_hand():
  phases = flops.step_phases(HAND, 2, 2, 3, kl=True, prox_pass=True, epochs=2)
  # Reference and prox: one forward each (6880); 2 epochs of forward + backward: 2 * 20640.
  assert phases == {"generation": 5600, "reference": 6880, "prox": 6880,
                    "forward_backward": 41280}
  plain = flops.step_phases(HAND, 2, 2, 3, kl=False, prox_pass=False)
  assert plain == {"generation": 5600, "reference": 0, "prox": 0, "forward_backward": 20640}


# --- against XLA's own count ------------------------------------------------------------------
# XLA's cost_analysis() counts every dot as 2 * M * N * K (exactly what flops.py counts) plus
# one FLOP per element of every elementwise op and reduction, which flops.py leaves out. So its
# count is never below ours, and above it by the elementwise share: at the tiny model's shapes
# (D 64, Dh 32, F 128, V 128: little matmul work per element) 3-4% measured (norms, RoPE,
# softmax over the S x S scores, SiLU, logsumexp over V); at the reference model's 0.7%. 10%
# bounds it with room for another XLA release counting a transcendental differently, and is
# still far tighter than any counting mistake here (a missing layer, the causal half of the
# attention, the LM head at every position instead of T) would pass.
XLA_SLACK = 1.10


def _xla_flops(fn, *args) -> float:
  return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


@pytest.mark.parametrize("rows, p, t", [(2, 8, 8), (4, 16, 32)])
def test_forward_flops_match_xla_cost_analysis(split, rows, p, t):
  graphdef, params = split
  config = nnx.merge(graphdef, params).config
  ids_NxP = jnp.zeros((rows, p), jnp.int32)
  mask_NxP = jnp.ones((rows, p), bool)
  comp_NxT = jnp.zeros((rows, t), jnp.int32)

  def logp(prm):
    return logprobs.completion_logprobs(nnx.merge(graphdef, prm), ids_NxP, mask_NxP, comp_NxT)

  # The layers are one scan, whose body XLA's cost analysis counts once (as the sampler's
  # loop below): its count is that of a one-layer model, which checks the block's count and
  # everything around it; the layer count's factor is checked by hand above.
  one_layer = config.replace(num_layers=1)
  ours = flops.forward_flops(one_layer, rows, p, t, lm_head_positions=t)
  assert ours <= _xla_flops(logp, params) <= XLA_SLACK * ours
  # Forward + backward of a scalar of the log-probs: 3x the forward, as XLA counts it too.
  ours = flops.train_flops(one_layer, rows, p, t, lm_head_positions=t)
  grad = jax.grad(lambda prm: jnp.mean(logp(prm)))
  assert ours <= _xla_flops(grad, params) <= XLA_SLACK * ours


def test_generation_flops_match_xla_cost_analysis(split):
  # XLA's cost analysis counts the body of a while loop once (it cannot know the trip count),
  # so the sampler's count is the prefill plus ONE decode step: generation_flops less T - 2
  # decode steps. That checks the prefill (P queries over P + T slots, head at one position)
  # and a decode step (1 query over P + T slots) separately.
  graphdef, params = split
  config = nnx.merge(graphdef, params).config
  rows, p, t = 2, 8, 8
  sample = sampler_lib.make_sampler(graphdef, sampler_lib.SamplingConfig(
      max_new_tokens=t, eos_ids=(-1,), pad_id=0))
  xla = float(sample.lower(params, jnp.zeros((rows, p), jnp.int32), jnp.ones((rows, p), bool),
                           jax.random.key(0)).compile().cost_analysis()["flops"])
  decode_step = rows * (flops.matmul_flops_per_token(config)
                        + flops.attention_flops(config, 1, p + t) + flops.lm_head_flops(config, 1))
  ours = flops.generation_flops(config, rows, p, t) - (t - 2) * decode_step
  assert ours <= xla <= XLA_SLACK * ours


# --- peak ---------------------------------------------------------------------------------------

def test_chip_peaks():
  assert peak.chip_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
  assert peak.chip_peak("NVIDIA H200", "bfloat16") == 989e12
  # float32: TF32 tensor cores under JAX's default precision, CUDA cores at full precision.
  assert peak.chip_peak("NVIDIA H100 80GB HBM3", "float32") == 494.7e12
  assert peak.chip_peak("NVIDIA H100 80GB HBM3", "float32", "highest") == 67e12
  assert peak.chip_peak("NVIDIA A100-SXM4-80GB", "float32", "float32") == 19.5e12
  assert peak.chip_peak("NVIDIA A100-SXM4-40GB", "bfloat16") == 312e12
  assert peak.chip_peak("TPU v4", "bfloat16") == 275e12
  assert peak.chip_peak("TPU v5 lite", "bfloat16") == 197e12
  assert peak.chip_peak("TPU v5", "bfloat16") == 459e12
  assert peak.chip_peak("TPU v6 lite", "bfloat16") == 918e12
  # Unknown parts and dtypes: None (the caller measures).
  assert peak.chip_peak("NVIDIA H100 PCIe", "bfloat16") is None
  assert peak.chip_peak("TPU v4", "float32") is None
  assert peak.chip_peak("cpu", "float32") is None


def test_gemm_peak_on_cpu_is_measured():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU only")
  value, source = peak.peak_and_source("float32", size=128, repeats=2)
  assert source == "measured"
  assert math.isfinite(value) and value > 0
  assert peak.gemm_peak("bfloat16", size=128, repeats=1) > 0


# --- growth fits --------------------------------------------------------------------------------

def test_fit_growth_of_exact_power_laws():
  xs = [64, 128, 256, 512]
  lin = flops.fit_growth(xs, [3 * x for x in xs])
  assert lin["exponent"] == pytest.approx(1.0)
  assert lin["linear"] == pytest.approx((0.0, 3.0), abs=1e-9)
  assert lin["quadratic"] == pytest.approx((0.0, 3.0, 0.0), abs=1e-9)
  assert abs(lin["quadratic_share"]) < 1e-9
  assert lin["growth"] == "linear"
  quad = flops.fit_growth(xs, [x * x for x in xs])
  assert quad["exponent"] == pytest.approx(2.0)
  assert quad["quadratic"] == pytest.approx((0.0, 0.0, 1.0), abs=1e-6)
  assert quad["quadratic_share"] == pytest.approx(1.0)
  assert quad["growth"] == "quadratic"
  assert flops.fit_growth(xs, [x ** 3 for x in xs])["growth"] == "super-quadratic"


def test_fit_growth_rule_edges():
  xs = [64, 128, 256, 512]
  # Affine with a large constant: exponent well below 1, still linear.
  affine = flops.fit_growth(xs, [1000 + x for x in xs])
  assert affine["exponent"] < 0.5 and affine["growth"] == "linear"
  # A linear cost with a quadratic part of 1/4 at the largest x: exponent < 1.3, yet quadratic.
  mixed = flops.fit_growth(xs, [3 * 512 * x + x * x for x in xs])
  assert mixed["exponent"] < 1.3
  assert mixed["quadratic_share"] == pytest.approx(512 ** 2 / (3 * 512 ** 2 + 512 ** 2))
  assert mixed["growth"] == "quadratic"
  # x^1.5: past the linear exponent, and the quadratic fit's x^2 term is sizable.
  assert flops.fit_growth(xs, [x ** 1.5 for x in xs])["growth"] in ("quadratic", "super-linear")
  assert flops.fit_growth(xs, [5.0, 4.0, 3.0, 2.0])["growth"] == "non-increasing"
  # Two points: no quadratic fit.
  two = flops.fit_growth([8, 16], [1.0, 2.0])
  assert two["quadratic"] is None and two["quadratic_share"] is None
  assert two["growth"] == "linear"
  with pytest.raises(ValueError):
    flops.fit_growth([8, 8], [1.0, 2.0])
  with pytest.raises(ValueError):
    flops.fit_growth([8, 16], [0.0, 2.0])


# --- command lines ------------------------------------------------------------------------------

def _run(args, tmp_path) -> str:
  env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


TINY = ["--vocab=64", "--width=32", "--intermediate=64", "--layers=1"]


@pytest.mark.slow
def test_throughput_phases_command_line(tmp_path):
  out = _run(["grpo_jax.bench.throughput", "--init_random", f"--model={tmp_path / 'm'}", *TINY,
              "--num_prompts=2", "--group_size=2", "--prompt_len=4", "--completion_len=4",
              "--steps=2", "--peak_size=256", "--methods=grpo,rollout_replay", "--rows_equal"],
             tmp_path)
  result = json.loads(out.strip().splitlines()[-1])
  # --rows_equal: rollout replay trains on N + N/2 rows (4 + 2 at B = G = 2), so it is also
  # timed against a GRPO step on 6 rows.
  assert "grpo_rows6 train" in out
  assert (result["grpo_fed_rows"], result["rollout_replay_fed_rows"],
          result["grpo_rows6_fed_rows"]) == (4, 4, 6)  # fresh rows in; 6 for the equal GRPO
  assert result["rollout_replay_over_grpo_equal_rows"] == pytest.approx(
      result["rollout_replay_train_s_median"] / result["grpo_rows6_train_s_median"], rel=0.05)
  for key in ("step_s_median", "gen_s_median", "train_s_median"):  # the earlier fields
    assert key in result
  assert result["dtype"] == "float32" and result["peak_source"] == "measured"
  for phase in ("gen", "logprob", "fwd_bwd", "train", "step"):
    for field in ("gflop", "gflops_per_s", "util"):
      value = result[f"{phase}_{field}"]
      assert math.isfinite(value) and value > 0, (phase, field, value)
  assert result["logprob_s_median"] > 0 and result["fwd_bwd_s_median"] > 0
  assert result["peak_float32_gflops"] > 0 and result["peak_bfloat16_gflops"] > 0
  config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
  # The passes run shared prompts by default (2 prompts for 4 rows): counted as run.
  assert result["fwd_bwd_gflop"] == pytest.approx(
      flops.train_flops(config, 4, 4, 4, lm_head_positions=4, prompt_group=2) / 1e9, rel=1e-3)
  assert "utilisation" in out


@pytest.mark.slow
def test_growth_command_line(tmp_path):
  md = tmp_path / "growth.md"
  out = _run(["grpo_jax.bench.growth", *TINY, "--attention=blocked", "--attention_block=8",
              "--lengths=8,16,24", "--rows=", "--length_sweep_rows=4", "--group_size=2",
              "--prompt_len=4", "--steps=1", f"--out={md}"], tmp_path)
  result = json.loads(out.strip().splitlines()[-1])
  assert len(result["points"]) == 3
  for pt in result["points"]:
    assert pt["attention"] == "blocked"
    assert pt["sampler_bytes"] > 0 and pt["step_bytes"] > pt["sampler_bytes"] / 10
    assert pt["gen_ms_per_token"] == pytest.approx(1e3 * pt["gen_s"] / pt["T"])
  fits = result["fits"]["blocked: length, 4 rows"]
  assert fits["x"] == "T" and fits["step_gflop"]["quadratic"] is not None
  # Two of the three targets need T >= 1024 points or not: time and generation are there.
  assert [t["bound"] for t in result["targets"]["blocked"]] == [1.3, 1.5]
  table = md.read_text()
  assert "| blocked | 4 | 24 |" in table and "| blocked: length, 4 rows (T) |" in table


def test_growth_targets_by_hand():
  pt = lambda t, step_bytes, train_s, gflop, gen_s: dict(
      T=t, step_bytes=step_bytes, train_s=train_s, step_gflop=gflop, gen_s=gen_s,
      gen_ms_per_token=1e3 * gen_s / t)
  # Memory 1, 2, 4 GB at T = 1k, 2k, 4k: exponent 1. Time x10 for FLOPs x8 from 512 to 4k:
  # 10 / 8 = 1.25. Generation 1 s at 512 (1.953 ms/token), 12 s at 4k (2.93 ms): 1.5.
  points = [pt(512, 0.5e9, 1.0, 100.0, 1.0), pt(1024, 1e9, 2.0, 200.0, 2.0),
            pt(2048, 2e9, 4.0, 400.0, 5.0), pt(4096, 4e9, 10.0, 800.0, 12.0)]
  (mem, v1, b1, ok1), (time_, v2, b2, ok2), (gen, v3, b3, ok3) = growth.targets(points)
  assert "1024-4096" in mem and v1 == pytest.approx(1.0) and ok1 and b1 == 1.15
  assert v2 == pytest.approx(1.25) and ok2
  assert v3 == pytest.approx(1.5) and ok3
  # A point that did not run (NaN times) is left out of the time targets, not of memory.
  points[-1].update(train_s=float("nan"), gen_s=float("nan"), gen_ms_per_token=float("nan"),
                    step_bytes=16e9)
  rows = growth.targets(points)
  # 1, 2, 16 GB at log2 T = 10, 11, 12: least-squares slope of log2 bytes (0, 1, 4) is
  # ((-1)(-5/3) + 0 + (1)(7/3)) / 2 = 2.
  assert rows[0][1] == pytest.approx(2.0) and not rows[0][3]
  assert "512-2048" in rows[1][0] and rows[1][1] == pytest.approx((4 / 1) / (400 / 100))


def test_growth_point_over_the_run_limit_is_compiled_not_run():
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True,
                    attention="blocked", attention_block=4)
  graphdef, params = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(0)))
  pt = growth.measure(graphdef, params, 4, 4, 8, 2, 0.0, 1, run_limit_bytes=0)
  assert math.isnan(pt["gen_s"]) and math.isnan(pt["train_s"])
  assert pt["step_bytes"] > 0 and pt["sampler_bytes"] > 0 and pt["attention"] == "blocked"
