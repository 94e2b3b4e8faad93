"""The rollout benchmark's length workloads (grpo_jax/bench/lengths.py): the log-normal's median
and tail as specified, what a static batch wastes, measured lengths read from a file."""

import numpy as np
import pytest

from grpo_jax.bench import lengths


def test_lognormal_has_its_median_and_its_share_at_the_limit():
  """200,000 draws at T = 1,024: the median 0.25 T = 256 (within 1%), and 4% of rows at T
  (binomial standard error sqrt(0.04 x 0.96 / 2e5) = 4.4e-4: within 0.002, 4.5 SE)."""
  t = 1024
  drawn = lengths.lognormal(np.random.default_rng(0), (200_000,), t)
  assert drawn.dtype == np.int32 and drawn.min() >= 1 and drawn.max() == t
  assert abs(np.median(drawn) - 256) <= 0.01 * 256
  assert abs(np.mean(drawn == t) - 0.04) <= 0.002


def test_sigma_by_hand():
  # ln 4 / Phi^-1(0.96) = 1.386294 / 1.750686 = 0.791858.
  assert lengths.lognormal_sigma() == pytest.approx(0.791858, abs=1e-6)
  with pytest.raises(ValueError, match="median must be in"):
    lengths.lognormal_sigma(median=1.5)


def test_static_useful_fraction_by_hand():
  # Batch 1: lengths 1, 2, 3 -> 6 tokens in 3 rows x 3 steps; batch 2: 4, 4, 4 -> 12 in 3 x 4.
  # (6 + 12) / (9 + 12) = 18 / 21.
  assert lengths.static_useful_fraction([[1, 2, 3], [4, 4, 4]]) == pytest.approx(18 / 21)


def test_a_static_batch_of_256_rows_produces_a_token_in_a_third_of_its_row_steps():
  """With 256 rows a batch almost always has a row at T (1 - 0.96^256 = 1 - 3e-5), so the
  fraction is the mean length over T. For the continuous log-normal (mu = ln 256, sigma =
  0.79186, sigma^2 = 0.62704): E[X; X < T] = 256 e^0.31352 Phi((ln 4 - 0.62704) / 0.79186)
  = 350.27 x Phi(0.95882) = 350.27 x 0.8312 = 291.15, plus T x 0.04 = 40.96: 332.11 / 1024 =
  0.3243; the ceiling adds about half a token. 400 batches agree within 0.005."""
  t = 1024
  expected = lengths.expected_capped_mean(t)
  assert expected == pytest.approx(0.3243, abs=5e-4)
  batches = lengths.lognormal(np.random.default_rng(1), (400, 256), t)
  assert lengths.static_useful_fraction(batches) == pytest.approx(expected + 0.5 / t, abs=5e-3)


def test_uniform_and_measured_lengths(tmp_path):
  drawn = lengths.uniform(np.random.default_rng(0), (10_000,), 8)
  assert set(np.unique(drawn)) == set(range(1, 9))
  path = tmp_path / "lengths.txt"
  path.write_text("3\n40\n\n7\n")
  measured = lengths.read_lengths(str(path))
  assert measured.tolist() == [3, 40, 7]
  resampled = lengths.from_file(np.random.default_rng(0), (1000,), 16, measured)
  assert set(np.unique(resampled)) == {3, 7, 16}  # 40 is capped at T = 16
  (tmp_path / "list.json").write_text("[5, 6]")
  assert lengths.read_lengths(str(tmp_path / "list.json")).tolist() == [5, 6]


@pytest.mark.parametrize("text,message", [
    ("3\nabc\n", r"line 2 is 'abc', not a positive integer length"),
    ("[1, 0]", r"item 2 is 0, not a positive integer length"),
    ("[1, 2", r"not a JSON list of lengths"),
    ("\n", r"no lengths"),
])
def test_a_bad_lengths_file_is_one_line_naming_it(tmp_path, text, message):
  path = tmp_path / "bad.txt"
  path.write_text(text)
  with pytest.raises(ValueError, match=message) as e:
    lengths.read_lengths(str(path))
  assert "\n" not in str(e.value) and str(path) in str(e.value)
