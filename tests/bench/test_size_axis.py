"""The size axis: gains at two model sizes and their paired difference, checked by hand on two
small made-up sweeps."""

import os

import pytest

from grpo_jax.bench import size_axis
from tests.bench.summaries import write_sweep

A = {"task.countdown.max_number": 50}
B = {"task.countdown.max_number": 100}


def _summary(method, setting_values, final, seeds=(0, 1, 2)):
  return {"method": method, "setting_values": setting_values, "seeds": list(seeds),
          "final": final}



@pytest.fixture
def sizes(tmp_path):
  small = write_sweep(tmp_path, "small", [
      _summary("grpo", A, [0.30, 0.32, 0.34]),
      _summary("popo", A, [0.31, 0.33, 0.35]),      # gains 0.01, 0.01, 0.01
      _summary("rr", A, [0.30, 0.32, 0.34]),        # gains 0, 0, 0
      _summary("grpo", B, [0.10, 0.10, 0.10, 0.11, 0.12], seeds=(0, 1, 2, 3, 4)),
      _summary("popo", B, [0.10, 0.11, 0.12, 0.20, 0.20], seeds=(0, 1, 2, 3, 4)),
      _summary("headroom", A, [0.5, 0.5, 0.5])])    # not run at the larger size
  large = write_sweep(tmp_path, "large", [
      _summary("grpo", A, [0.40, 0.41, 0.42]),
      _summary("popo", A, [0.43, 0.45, 0.44]),      # gains 0.03, 0.04, 0.02
      _summary("rr", A, [0.45, 0.46, 0.48]),        # gains 0.05, 0.05, 0.06
      _summary("grpo", B, [0.2, 0.2, 0.2]),
      _summary("popo", B, [0.2, 0.21, 0.22])])      # gains 0, 0.01, 0.02: as at the small size
  return [("1M", small), ("4M", large)]


def _rows(sizes):
  return {(r["method"], r["setting"]): r for r in size_axis.compare(
      [(label, size_axis.finals(folder)) for label, folder in sizes])}


def test_difference_of_gains_paired_by_seed_by_hand(sizes):
  rows = _rows(sizes)
  popo = rows[("popo", "numbers to 50")]
  # d = (0.03, 0.04, 0.02) - 0.01 = (0.02, 0.03, 0.01): mean 0.02, sample std 0.01,
  # SE 0.01 / sqrt(3) = 0.0057735; t = 3.4641 on 2 df, where P(T > t) = (1 - t / sqrt(t^2 + 2))
  # / 2 = (1 - 3.4641 / 3.7417) / 2 = 0.03709, so p = 0.07418: not resolved
  assert popo["diff"] == pytest.approx(0.02)
  assert popo["diff_se"] == pytest.approx(0.0057735, rel=1e-4)
  assert popo["p"] == pytest.approx(0.07418, rel=1e-3)
  assert not popo["resolved"]
  assert (popo["gain_small"], popo["gain_large"]) == pytest.approx((0.01, 0.03))
  assert (popo["base_small"], popo["base_large"]) == pytest.approx((0.32, 0.41))
  # resolvable: t(0.975, 2) = 4.3027 SEs = 0.02484; detectable at 80% power adds
  # t(0.8, 2) = 1.0607 SEs: 5.3634 x 0.0057735 = 0.03097
  assert popo["resolvable"] == pytest.approx(0.02484, rel=1e-3)
  assert popo["detectable"] == pytest.approx(0.03097, rel=1e-3)
  rr = rows[("rr", "numbers to 50")]
  # d = (0.05, 0.05, 0.06): mean 0.053333, std 0.0057735, SE 0.0033333, t = 16.0 on 2 df:
  # p = 1 - 16 / sqrt(258) = 0.003884: resolved
  assert rr["diff"] == pytest.approx(0.053333, rel=1e-4)
  assert rr["p"] == pytest.approx(0.003884, rel=1e-3)
  assert rr["resolved"]


def test_only_seeds_of_all_four_runs_pair_and_settings_pool(sizes):
  rows = _rows(sizes)
  b = rows[("popo", "numbers to 100")]
  # seeds 3 and 4 ran only at the small size: left out; the gains match, d = (0, 0, 0)
  assert b["seeds"] == [0, 1, 2] and b["n"] == 3
  assert b["diff"] == pytest.approx(0.0, abs=1e-12)
  assert not b["resolved"]
  pooled = rows[("popo", size_axis.ALL)]
  # d = (0.02, 0.03, 0.01, 0, 0, 0): mean 0.01, deviations squared (1 + 4 + 0 + 1 + 1 + 1)e-4
  # over 5 = 1.6e-4, std 0.012649, SE 0.005164, t = 1.936 on 5 df; t(0.95, 5) = 2.015 puts
  # p just above 0.10
  assert pooled["n"] == 6
  assert pooled["diff"] == pytest.approx(0.01, abs=1e-12)
  assert pooled["diff_se"] == pytest.approx(0.005164, rel=1e-3)
  assert 0.10 < pooled["p"] < 0.12
  # one setting only: no pooled row; a method missing at the larger size: no row at all
  assert ("rr", size_axis.ALL) not in rows
  assert not any(m == "headroom" for m, _ in rows)
  assert not any(m == "grpo" for m, _ in rows)


def test_one_pair_has_no_spread_and_never_resolves():
  d = size_axis.difference([0.05])
  assert d["n"] == 1 and d["diff"] == 0.05 and not d["resolved"]
  assert all(d[k] != d[k] for k in ("diff_se", "p", "resolvable"))  # NaN


def test_write_makes_the_table_with_resolved_bold_and_the_figure(sizes, tmp_path):
  paths = size_axis.write(sizes, os.fspath(tmp_path / "size"))
  assert [os.path.basename(p) for p in paths] == ["size.md", "size.png"]
  md = open(paths[0]).read()
  # rr: gain 0.0 -> 5.3 points, d 5.3 ± 0.3 (bold), p 0.004, n 3
  assert "| rr | numbers to 50 (1M → 4M) | 0.320 → 0.410 | +0.0 | +5.3 | **+5.3 ± 0.3** | " \
         "0.004 | 3 |" in md
  assert "| popo | numbers to 50 (1M → 4M) | 0.320 → 0.410 | +1.0 | +3.0 | +2.0 ± 0.6 |" in md


@pytest.mark.parametrize("specs,match", [
    (["1M=a"], "two or more sizes"),
    (["1M=a", "1M=b"], "named twice"),
    (["1M"], "is not LABEL=FOLDER"),
])
def test_bad_sizes_flag_says_what_is_wrong(specs, match):
  with pytest.raises(ValueError, match=match):
    size_axis.parse_sizes(specs)


def test_three_sizes_compare_every_pair(sizes, tmp_path):
  # a third size at numbers to 50 only: popo's gains 0.06, 0.05, 0.07
  big = write_sweep(tmp_path, "big", [_summary("grpo", A, [0.50, 0.50, 0.50]),
                                 _summary("popo", A, [0.56, 0.55, 0.57])])
  rows = size_axis.compare([(label, size_axis.finals(folder))
                            for label, folder in sizes + [("16M", big)]])
  pairs = {(r["method"], r["setting"], r["small"], r["large"]): r for r in rows}
  assert {k[2:] for k in pairs} == {("1M", "4M"), ("1M", "16M"), ("4M", "16M")}
  # 4M -> 16M: d = (0.06 - 0.03, 0.05 - 0.04, 0.07 - 0.02) = (0.03, 0.01, 0.05), mean 0.03
  assert pairs[("popo", "numbers to 50", "4M", "16M")]["diff"] == pytest.approx(0.03)
  # 1M -> 16M: d = (0.05, 0.04, 0.06), mean 0.05; one setting there, so no pooled row
  assert pairs[("popo", "numbers to 50", "1M", "16M")]["diff"] == pytest.approx(0.05)
  assert ("popo", size_axis.ALL, "1M", "16M") not in pairs
  assert ("popo", size_axis.ALL, "1M", "4M") in pairs
