"""Evaluation summaries, computed by hand."""

import numpy as np
import pytest

from grpo_jax.evaluate import group_metrics


def test_group_metrics_by_hand():
  success = np.array([[1, 1], [0, 0], [1, 0]], bool)
  m = group_metrics(success, lengths_NxK=np.array([[2, 4], [6, 8], [10, 12]]))
  # mean@2: per-prompt means 1, 0, 0.5 -> (1 + 0 + 0.5) / 3 = 0.5
  assert m["mean_at_k"] == pytest.approx(0.5)
  # pass@2: prompts 0 and 2 have a success -> 2/3
  assert m["pass_at_k"] == pytest.approx(2 / 3)
  # all correct: prompt 0 (1/3); all wrong: prompt 1 (1/3); constant 2/3
  assert m["all_correct_fraction"] == pytest.approx(1 / 3)
  assert m["all_wrong_fraction"] == pytest.approx(1 / 3)
  assert m["constant_fraction"] == pytest.approx(2 / 3)
  # lengths: (2+4+6+8+10+12) / 6 = 42 / 6 = 7
  assert m["mean_length"] == pytest.approx(7.0)
