"""Evaluation summaries, computed by hand."""

import os

import numpy as np
import pytest

from grpo_jax.run.evaluate import group_metrics


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
  # standard error over prompts: per-prompt rates 1, 0, 0.5 around 0.5; sample variance
  # (0.25 + 0.25 + 0) / 2 = 0.25, std 0.5; over sqrt(3): 0.5 / 1.7320508 = 0.2886751
  assert m["mean_at_k_se"] == pytest.approx(0.2886751, abs=1e-7)


def test_the_standard_error_is_over_prompts_not_samples():
  """Two prompts, one always right, one always wrong (8 samples each): a per-sample binomial
  error would be sqrt(0.5 * 0.5 / 16) = 0.125; over prompts, the rates 1 and 0 have sample
  std sqrt(0.5) = 0.7071068, over sqrt(2): 0.5. One prompt: no estimate (NaN)."""
  m = group_metrics(np.array([[1] * 8, [0] * 8], bool))
  assert m["mean_at_k_se"] == pytest.approx(0.5)
  assert np.isnan(group_metrics(np.array([[1, 0]], bool))["mean_at_k_se"])


def test_pooled_sets_weight_means_by_size_and_add_variances():
  """Sets a (100 prompts, mean 0.2, se 0.03) and b (300, 0.6, 0.02): mean (100 * 0.2 + 300 *
  0.6) / 400 = 200 / 400 = 0.5; se sqrt((0.25 * 0.03)^2 + (0.75 * 0.02)^2) =
  sqrt(5.625e-5 + 2.25e-4) = sqrt(2.8125e-4) = 0.0167705."""
  pooled = evaluate_lib.pool({"a": {"mean_at_8": 0.2, "mean_at_8_se": 0.03},
                              "b": {"mean_at_8": 0.6, "mean_at_8_se": 0.02}},
                             {"a": 100, "b": 300})
  assert pooled["mean_at_8"] == pytest.approx(0.5)
  assert pooled["mean_at_8_se"] == pytest.approx(0.0167705, abs=1e-7)


# evaluate() with the embedded model: batch sizing, and that the size does not change results.

import jax
from flax import nnx

from grpo_jax import assets
from grpo_jax.generate import static_round
from grpo_jax.run import evaluate as evaluate_lib

TEXTS = ["Using the numbers [20, 15, 41], create an equation that equals 46.",
         "Using the numbers [49, 38, 33], create an equation that equals 44.",
         "Using the numbers [12, 7, 30], create an equation that equals 25."]


class AnswerTask:
  """Problem i prompts with TEXTS[i]; a completion scores 1 if it closes its answer tag."""

  def prompt(self, problem):
    return TEXTS[problem]

  def score(self, text, problem):
    del problem
    return float("</answer>" in text)

  def is_success(self, score):
    return score >= 1.0


@pytest.fixture(scope="module")
def embedded():
  import transformers
  from grpo_jax.models import from_pretrained
  tokenizer = transformers.AutoTokenizer.from_pretrained(assets.EMBEDDED_MODEL)
  return tokenizer, nnx.split(from_pretrained(assets.EMBEDDED_MODEL))


def _spy(monkeypatch, pad_to=None):
  """Replaces the cached round function (``static_round``) with one that records (eos_ids, rows, real-row outputs).

  With ``pad_to``, every batch is first padded to that many rows by repeating its last row and
  the outputs cut back to the batch's rows: the old always-pad behaviour.
  """
  real = static_round.cached_round_fn
  calls = []

  def cached(graphdef, config, mesh=None):
    fn = real(graphdef, config, mesh)

    def sample(params, ids, mask, rng):
      n = ids.shape[0]
      if pad_to:
        extra = pad_to - n
        ids = np.concatenate([ids, np.repeat(ids[-1:], extra, 0)])
        mask = np.concatenate([mask, np.repeat(mask[-1:], extra, 0)])
      out = jax.tree.map(lambda x: x[:n], fn(params, ids, mask, rng))
      calls.append((config.eos_ids, ids.shape[0], jax.device_get(out)))
      return out

    return sample

  monkeypatch.setattr(static_round, "cached_round_fn", cached)
  return calls


KW = dict(k=2, temperature=1.0, prompt_len=20, completion_len=8, seed=3)


def test_small_evaluation_samples_only_its_rows(monkeypatch, embedded):
  tokenizer, (graphdef, params) = embedded
  calls = _spy(monkeypatch)
  m = evaluate_lib.evaluate(graphdef, params, tokenizer, AnswerTask(), [0, 1],
                            rows_per_batch=512, **KW)
  # 2 problems x k = 2 samples = 4 rows < 512: one batch of 4 rows, not 512.
  assert [rows for _, rows, _ in calls] == [4]
  assert calls[0][0] == (1,)  # no model_path: the tokenizer's EOS only
  lengths = calls[0][2].lengths
  assert m["mean_length"] == pytest.approx(lengths.mean())
  # 3 problems x 2 = 6 rows with rows_per_batch 5 -> rounded down to 4 (whole groups): batches
  # of 4 rows, the second holding 2 real rows padded to 4.
  calls.clear()
  m = evaluate_lib.evaluate(graphdef, params, tokenizer, AnswerTask(), [0, 1, 2],
                            rows_per_batch=5, **KW)
  assert [rows for _, rows, _ in calls] == [4, 4]
  assert m["mean_length"] == pytest.approx(
      np.concatenate([calls[0][2].lengths, calls[1][2].lengths[:2]]).mean())


def test_batch_size_does_not_change_the_results(monkeypatch, embedded):
  """A 4-row batch gives the same rows as the same batch padded to 64 (old behaviour).

  Token t of every row is drawn from uniforms of shape [rows, 1] under fold_in(key, t), and
  (partitionable threefry, the JAX default) the first rows of those do not depend on the row
  count, and the model computes rows independently (up to float rounding). So padding does not
  change the real rows' tokens, hence not the metrics.
  """
  tokenizer, (graphdef, params) = embedded
  calls = _spy(monkeypatch)
  small = evaluate_lib.evaluate(graphdef, params, tokenizer, AnswerTask(), [0, 1], **KW)
  padded_calls = _spy(monkeypatch, pad_to=64)
  padded = evaluate_lib.evaluate(graphdef, params, tokenizer, AnswerTask(), [0, 1], **KW)
  assert calls[0][1] == 4 and padded_calls[0][1] == 64
  for name in ("completion_ids", "completion_mask", "lengths"):
    np.testing.assert_array_equal(getattr(calls[0][2], name), getattr(padded_calls[0][2], name))
  # The CPU matmuls round differently for 4 and 64 rows (~1e-6 in the log-probs); a draw could
  # only flip if its uniform fell within that of a CDF step, which these seeds do not.
  np.testing.assert_allclose(calls[0][2].behaviour_logp, padded_calls[0][2].behaviour_logp, atol=1e-5)
  assert small == padded
  # Sampled at temperature 1, the 4 rows are not all the same completion.
  assert len({tuple(r) for r in np.asarray(calls[0][2].completion_ids).tolist()}) > 1


def test_model_path_adds_generation_config_stop_tokens(monkeypatch, tmp_path, embedded):
  tokenizer, (graphdef, params) = embedded
  # Only generation_config.json is read from model_path; 7 is "!" in the embedded vocabulary.
  (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 7]}')
  calls = _spy(monkeypatch)
  evaluate_lib.evaluate(graphdef, params, tokenizer, AnswerTask(), [0], model_path=str(tmp_path),
                        **{**KW, "k": 1})
  assert calls[0][0] == (1, 7)


def test_aes_by_hand():
  from grpo_jax.run.evaluate import aes  # pylint: disable=g-import-not-at-top
  # dL = (10 - 8) / 10 = 0.2, dAcc = (0.4 - 0.32) / 0.32 = 0.25 >= 0 -> 0.2 + 3 * 0.25 = 0.95.
  assert aes(0.4, 8.0, 0.32, 10.0) == pytest.approx(0.95)
  # dL = 0, dAcc = (0.3 - 0.4) / 0.4 = -0.25 -> 0 - 5 * 0.25 = -1.25 (the penalty is larger).
  assert aes(0.3, 10.0, 0.4, 10.0) == pytest.approx(-1.25)
  # Longer answers cost: dL = (10 - 12) / 10 = -0.2, dAcc = 0 -> -0.2.
  assert aes(0.4, 12.0, 0.4, 10.0) == pytest.approx(-0.2)
  with pytest.raises(ValueError, match="positive baseline"):
    aes(0.4, 8.0, 0.0, 10.0)


def test_reward_functions_get_the_token_ids_in_evaluation(embedded):
  """tests/data/trl_rewards.py:length_penalty is -0.01 per completion token: evaluated, its
  mean score is -0.01 x the mean length, as in training (with no ids it would be 0)."""
  from grpo_jax.rewards import functions as rewards, scoring  # pylint: disable=g-import-not-at-top
  tokenizer, (graphdef, params) = embedded
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                      "trl_rewards.py")

  class Prompts(AnswerTask):
    def reward_inputs(self, problems):
      return [TEXTS[p] for p in problems], {}

  scorer = scoring.Scorer(Prompts(), [rewards.load(f"{path}:length_penalty")])
  m = evaluate_lib.evaluate(graphdef, params, tokenizer, Prompts(), [0, 1], scorer=scorer, **KW)
  assert m["mean_length"] > 0
  assert m["mean_score"] == pytest.approx(-0.01 * m["mean_length"], rel=1e-6)
