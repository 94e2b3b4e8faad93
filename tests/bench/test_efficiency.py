"""The sample-efficiency benchmark's bookkeeping: run names, curves, wall clock, the tables, and
the command with a step, rollout or completion-token budget."""

import json
import os
import re
import subprocess
import sys

import pytest

from grpo_jax.bench import curves, efficiency
from grpo_jax.run import report_writer
from tests.cli_output import THIRD_PARTY_LOG

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
def _write(path, records):
  path.mkdir(parents=True, exist_ok=True)
  with open(path / "metrics.jsonl", "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def test_run_names_of_presets():
  assert efficiency.run_name("popo") == "popo"
  assert efficiency.run_name("popo:filter") == "popo-filter"
  assert efficiency.run_name("popo:stale=10") == "popo-stale10"
  assert efficiency.run_name("popo:kl,smoke") == "popo-kl-smoke"
  assert efficiency.run_name("rollout_replay:paper+minibatches=4") == (
      "rollout_replay-paper-minibatches4")


def test_curve_wall_clock_and_table(tmp_path):
  # Two runs of one method: evaluations at steps 0 and 2; step records carry either wall_s
  # or (older runs) only completion tokens and tokens_per_s: 300 tokens / 10 tok/s = 30 s.
  a, b = tmp_path / "a", tmp_path / "b"
  _write(a, [{"step": 0, "eval/mean_at_8": 0.25, "rollouts": 0},
             {"step": 1, "loss": 0.1, "completion_tokens": 100, "tokens_per_s": 10.0,
              "wall_s": 12.0},
             {"step": 2, "loss": 0.1, "completion_tokens": 200, "tokens_per_s": 10.0,
              "wall_s": 21.0},
             {"step": 2, "eval/mean_at_8": 0.5, "rollouts": 16}])
  _write(b, [{"step": 0, "eval/mean_at_8": 0.25, "rollouts": 0},
             {"step": 2, "loss": 0.1, "completion_tokens": 300, "tokens_per_s": 10.0},
             {"step": 2, "eval/mean_at_8": 0.75, "rollouts": 16}])
  assert report_writer.curve(str(a)) == [(0, 0, 0.25), (2, 16, 0.5)]
  assert report_writer.wall_at_evals(str(a)) == [0.0, 21.0]
  assert report_writer.wall_at_evals(str(b)) == [0.0, 30.0]
  md = efficiency.table({"popo:filter": {0: report_writer.curve(str(a)),
                                         1: report_writer.curve(str(b))}},
                        {"popo:filter": [[0.0, 21.0], [0.0, 30.0]]})
  lines = md.splitlines()
  # Step 2: seeds 0.5 and 0.75 -> mean 0.625, population std 0.125; wall mean (21 + 30) / 2.
  assert lines[3] == "| 2 | 16 | 0.500 0.750 / **0.625** ± 0.125 |"
  assert lines[4] == "| wall s at the end | | 21 30 / **26** |"


def test_aes_rows_against_the_start_and_the_margin_over_grpo():
  # Every seed starts at accuracy 0.25, length 8 (the shared step-0 evaluation). AES(acc, L)
  # against it: dL = (8 - L) / 8, dAcc = (acc - 0.25) / 0.25, AES = dL + 3 dAcc (or - 5 |dAcc|).
  #   grpo seed 0: end 0.4, L 10 -> -0.25 + 3 * 0.6 = +1.550
  #   grpo seed 1: end 0.2, L 10 -> -0.25 - 5 * 0.2 = -1.250   (mean +0.150, std 1.400)
  #   x seed 0:    end 0.36, L 9 -> -0.125 + 3 * 0.44 = +1.195
  # Margins, paired by seed: grpo 0 and 0; x seed 0: 1.195 - 1.550 = -0.355.
  results = {"grpo": {0: [(0, 0, 0.25), (2, 16, 0.4)], 1: [(0, 0, 0.25), (2, 16, 0.2)]},
             "x": {0: [(0, 0, 0.25), (2, 16, 0.36)]}}
  lengths = {"grpo": [[8.0, 10.0], [8.0, 10.0]], "x": [[8.0, 9.0]]}
  start, margin = efficiency.aes_rows(results, lengths).splitlines()
  assert start == ("| AES vs the start (end) | | +1.550 -1.250 / **+0.150** ± 1.400 | "
                   "+1.195 / **+1.195** ± 0.000 |")
  assert margin == ("| AES margin over grpo (end, paired by seed) | | +0.000 +0.000 / "
                    "**+0.000** ± 0.000 | -0.355 / **-0.355** ± 0.000 |")
  assert efficiency.aes_rows({"x": results["x"]}, lengths) is None


def test_replay_table_means_over_steps(tmp_path):
  # replay_rows 0, 8 and 16 over three steps -> 8; replay_age_mean over the two steps that
  # replayed, 1 and 2 -> 1.5 (the first step's 0 is no age); a GRPO run logs none of them: its
  # cells stay empty, and runs without replay give no table at all.
  a, g = tmp_path / "popo", tmp_path / "grpo"
  _write(a, [{"step": 1, "loss": 0.0, "replay_rows": 0.0, "replay_age_mean": 0.0},
             {"step": 2, "loss": 0.0, "replay_rows": 8.0, "replay_age_mean": 1.0},
             {"step": 3, "loss": 0.0, "replay_rows": 16.0, "replay_age_mean": 2.0}])
  _write(g, [{"step": 1, "loss": 0.0}])
  assert report_writer.replay_table([str(a), str(g)]).splitlines() == [
      "| run | replay_rows | replay_age_mean |", "|---|---|---|", "| popo | 8 | 1.5 |",
      "| grpo |  |  |"]
  assert report_writer.replay_table([str(g)]) is None


def test_budget_table_and_rollouts_to_target():
  # Two seeds evaluated when their rollouts crossed 300 and 600 (overshooting the marks).
  s0 = [(0, 0, 0.2), (3, 300, 0.3), (6, 620, 0.5)]
  s1 = [(0, 0, 0.2), (2, 310, 0.4), (4, 640, 0.45)]
  assert curves.at_marks(s0, [0, 300, 600, 900]) == [(0, 0.2), (300, 0.3), (620, 0.5), None]
  lines = efficiency.budget_table({"sara": {0: s0, 1: s1}}, [0, 300, 600]).splitlines()
  # Mark 300: 0.3 and 0.4 -> mean 0.35, population std 0.05; mark 600: 0.5, 0.45 -> 0.475, 0.025.
  assert lines[3] == "| 300 | 0.300 0.400 / **0.350** ± 0.050 |"
  assert lines[4] == "| 600 | 0.500 0.450 / **0.475** ± 0.025 |"
  # Target 0.4: seed 0 crosses between (300, 0.3) and (620, 0.5): 300 + 0.1 / 0.2 * 320 = 460;
  # seed 1 between (0, 0.2) and (310, 0.4): 0 + 0.2 / 0.2 * 310 = 310. Mean 385, std 75.
  assert curves.to_target(s0, 0.4) == 460.0
  assert curves.to_target(s1, 0.4) == 310.0
  assert curves.to_target(s0, 0.2) == 0.0 and curves.to_target(
      s0, 0.9) is None
  assert efficiency.target_row({"sara": {0: s0, 1: s1}}, 0.4) == (
      "| rollouts to reach 0.400 | **385** ± 75 (2/2 seeds) |")
  assert efficiency.target_row({"x": {0: s0}}, 0.9) == (
      "| rollouts to reach 0.900 | never (0/1 seeds) |")


def test_cli_on_a_smoke_config_is_quiet_and_writes_the_table(tmp_path):
  """The command end to end on ``:smoke`` (mean@2, a start of accuracy 0): no third-party INFO
  lines (with ``--verbosity=0`` there are ~60), the table read at the config's k, and no AES
  rows, which are undefined against a start of 0 (before: an IndexError, then a ValueError).
  Run from a directory outside the repository: the method's file is found by its name."""
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, "-m", "grpo_jax.bench.efficiency", "--methods=grpo",
                         "--presets=smoke", "--seeds=1", "--steps=2", "--eval_every=2",
                         f"--out={out}"], cwd=tmp_path, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  text = proc.stdout + proc.stderr
  assert not THIRD_PARTY_LOG.search(text), THIRD_PARTY_LOG.search(text).group(0)
  md = (out / "efficiency.md").read_text()
  assert re.search(r"^\| 2 \| 8 \| [\d.]+ / \*\*[\d.]+\*\* ± [\d.]+ \|$", md, re.M), md
  assert "AES" not in md



def test_marks_on_the_token_axis(tmp_path):
  # A run whose steps generate 30, 25 and 40 completion tokens (cumulative 30, 55, 95),
  # evaluated after steps 0, 2 and 3; evaluation records carry rollouts but no tokens, which
  # come from the step record of the same step written just before (0 at step 0).
  w = tmp_path / "run"
  _write(w, [{"step": 0, "eval/mean_at_2": 0.1, "rollouts": 0},
             {"step": 1, "loss": 0.0, "rollouts": 4, "completion_tokens": 30},
             {"step": 2, "loss": 0.0, "rollouts": 8, "completion_tokens": 55},
             {"step": 2, "eval/mean_at_2": 0.3, "rollouts": 8},
             {"step": 3, "loss": 0.0, "rollouts": 12, "completion_tokens": 95},
             {"step": 3, "eval/mean_at_2": 0.5, "rollouts": 12}])
  c = curves.token_curve(str(w), k=2)
  assert c == [(0, 0, 0.1), (2, 55, 0.3), (3, 95, 0.5)]
  assert curves.budget_curve(str(w), 2, "rollouts") == [(0, 0, 0.1), (2, 8, 0.3),
                                                              (3, 12, 0.5)]
  # Marks 0, 25, 50, 75, 100 (budget 100, every 25): the first evaluation at or past each is
  # 0 -> (0, 0.1); 25 -> (55, 0.3), 50 -> (55, 0.3), 55 >= 50; 75 -> (95, 0.5); 100 -> none.
  assert curves.at_marks(c, [0, 25, 50, 75, 100]) == [(0, 0.1), (55, 0.3), (55, 0.3),
                                                          (95, 0.5), None]
  lines = efficiency.budget_table({"grpo": {0: c}}, [0, 25, 100],
                                  "completion_tokens").splitlines()
  assert lines[0] == "| completion tokens (mark) | grpo: seeds / mean ± std |"
  assert lines[3] == "| 25 | 0.300 / **0.300** ± 0.000 |" and lines[4] == "| 100 | — |"
  # Target 0.4: between (55, 0.3) and (95, 0.5): 55 + 0.1 / 0.2 * 40 = 75 tokens.
  assert efficiency.target_row({"grpo": {0: c}}, 0.4, "completion_tokens") == (
      "| completion tokens to reach 0.400 | **75** ± 0 (1/1 seeds) |")
  # An evaluation after step 0 without its step record (log_every > 1) is refused.
  _write(w, [{"step": 0, "eval/mean_at_2": 0.1, "rollouts": 0},
             {"step": 2, "eval/mean_at_2": 0.3, "rollouts": 8}])
  with pytest.raises(ValueError, match="step 2 has no step record"):
    curves.token_curve(str(w), k=2)


def test_cli_token_budget_stops_each_run_and_tabulates_token_marks(tmp_path):
  """``--tokens=40`` on ``:smoke`` (2 prompts x 2 rollouts of at most 8 tokens: 4 to 32 tokens a
  step, so at least 2 steps): the run stops at the first step that reaches 40 tokens, is
  evaluated each time 10 more were generated (40 / 4), and the table's rows are the token marks
  0, 10, ..., 40, each the first evaluation at or past the mark."""
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, "-m", "grpo_jax.bench.efficiency", "--methods=grpo",
                         "--presets=smoke", "--seeds=1", "--tokens=40", f"--out={out}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  workdir = out / "grpo-smoke-tokens40_seed0"  # not the rollout-budget run's folder
  written = [json.loads(line) for line in
             (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
  steps = [r for r in written if "loss" in r]
  assert len(steps) >= 2 and steps[-1]["completion_tokens"] >= 40 > steps[-2]["completion_tokens"]
  tokens = {0: 0, **{r["step"]: r["completion_tokens"] for r in steps}}
  evals = [(tokens[r["step"]], r["eval/mean_at_2"]) for r in written if "eval/mean_at_2" in r]
  md = (out / "efficiency.md").read_text().splitlines()
  assert md[0] == "| completion tokens (mark) | grpo: seeds / mean ± std |", md
  for mark, line in zip(range(0, 41, 10), md[2:7]):
    t, acc = next(e for e in evals if e[0] >= mark)
    assert line == f"| {mark} | {acc:.3f} / **{acc:.3f}** ± 0.000 |", (mark, t, md)
  assert md[7].startswith("| completion tokens to reach "), md


def test_cli_refuses_rollouts_with_tokens(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "grpo_jax.bench.efficiency", "--rollouts=64",
                         "--tokens=64", f"--out={tmp_path}"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, check=False)
  # absl prints the usage (the module's docstring and flags), then the error as its last line.
  assert proc.returncode != 0
  assert proc.stderr.strip().splitlines()[-1] == (
      "--rollouts and --tokens are exclusive: give one budget per run"), proc.stderr[-2000:]
  assert not os.listdir(tmp_path)  # refused before any run started
