"""Host side of an iteration: overlong penalty, prompt stream, scoring, group-major layout."""

import jax
import numpy as np
import pytest
import transformers
from flax import nnx

from grpo_jax import assets
from grpo_jax.allocation import rounds
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.generate import tokenization
from grpo_jax.generate.prompts import PromptStream
from grpo_jax.rewards.functions import overlong_penalty
from grpo_jax.rewards.scoring import score_completions


@pytest.fixture(scope="module")
def tokenizer():
  return transformers.AutoTokenizer.from_pretrained(assets.EMBEDDED_MODEL)


class FakeTask:
  """Problem i is its index; its prompt is ``lengths[i]`` number tokens (a dict), or
  ``lengths[i % len(lengths)]`` (a list).

  The embedded tokenizer gives every integer 0..999 one token, so "7 7 7" is 3 tokens.
  ``score`` is ``values[problem]`` (a task whose score depends only on the prompt) and raises
  for completions containing ``bad``; success is a score of at least 1.
  """

  def __init__(self, lengths, values=None):
    self.lengths = lengths
    self.values = values or {}

  def train_problem(self, index):
    return index

  def prompt(self, problem):
    if isinstance(self.lengths, dict):
      return " ".join(["7"] * self.lengths[problem])
    return " ".join(["7"] * self.lengths[problem % len(self.lengths)])

  def score(self, text, problem):
    if "bad" in text:
      raise RuntimeError("verifier crashed")
    return self.values.get(problem, 0.0)

  def is_success(self, score):
    return score >= 1.0


def test_overlong_penalty_by_hand():
  lengths = np.array([5, 12, 13, 15, 16, 16])
  truncated = np.array([False, False, False, False, False, True])
  # max_len 16, buffer 4: no penalty up to 16 - 4 = 12 tokens, then (12 - length) / 4:
  #   5 -> 0; 12 -> 0 / 4 = 0; 13 -> -1 / 4 = -0.25; 15 -> -3 / 4 = -0.75;
  #   16 with EOS -> -4 / 4 = -1.0; 16 truncated (no EOS) -> -1.
  expected = np.array([0.0, 0.0, -0.25, -0.75, -1.0, -1.0])
  np.testing.assert_allclose(overlong_penalty(lengths, truncated, 16, 4), expected)
  # factor 0.5 halves every entry: 0, 0, -0.125, -0.375, -0.5, -0.5.
  np.testing.assert_allclose(overlong_penalty(lengths, truncated, 16, 4, factor=0.5),
                             [0.0, 0.0, -0.125, -0.375, -0.5, -0.5])
  # A truncated row is -1 whatever its length: max_len 16, buffer 8 (free up to 8 tokens),
  # length 10 with EOS -> (8 - 10) / 8 = -0.25; the same length truncated -> -1.
  np.testing.assert_allclose(overlong_penalty([10, 10], [False, True], 16, 8), [-0.25, -1.0])
  # buffer 0 disables it, even for truncated rows.
  np.testing.assert_array_equal(overlong_penalty(lengths, truncated, 16, 0), np.zeros(6))


def test_prompt_stream_skips_and_counts_long_prompts(tokenizer):
  # Prompt lengths by position: 3, 9, 4, 10, 2, 3, 9, ... with P = 5: positions 1 and 3 do not fit.
  task = FakeTask([3, 9, 4, 10, 2])
  assert tokenization.prompt_lengths(tokenizer, [task.prompt(1)])[0] == 9
  stream = PromptStream(task, tokenizer, prompt_len=5)
  batch = stream.next_batch(2)
  assert [pos for pos, _, _ in batch] == [0, 2]  # position 1 (9 tokens) skipped
  assert [text for _, _, text in batch] == ["7 7 7", "7 7 7 7"]
  assert [problem for _, problem, _ in batch] == [0, 2]
  assert stream.position == 3 and stream.skipped == 1
  batch = stream.next_batch(2)
  assert [pos for pos, _, _ in batch] == [4, 5]  # position 3 (10 tokens) skipped
  assert stream.position == 6 and stream.skipped == 2
  # A prompt of exactly P tokens fits (<=).
  exact = PromptStream(FakeTask([5]), tokenizer, prompt_len=5)
  assert [pos for pos, _, _ in exact.next_batch(1)] == [0] and exact.skipped == 0


def test_prompt_stream_gives_up_after_max_skips(tokenizer):
  stream = PromptStream(FakeTask([9]), tokenizer, prompt_len=5)  # nothing fits
  with pytest.raises(ValueError, match=r"more than 3 consecutive prompts.*prompt_len=5"):
    stream.next_batch(1, max_skips=3)
  # Skips 1, 2, 3 are allowed; the 4th exceeds max_skips = 3 and raises.
  assert stream.skipped == 4
  # One fitting prompt every 4 positions: 6 skips in the call, but never more than 3 in a row,
  # so max_skips = 3 is not exceeded (it bounds consecutive skips, as its message says).
  stream = PromptStream(FakeTask([9, 9, 9, 2]), tokenizer, prompt_len=5)
  assert [pos for pos, _, _ in stream.next_batch(2, max_skips=3)] == [3, 7]
  assert stream.skipped == 6


def test_score_completions_counts_verifier_errors():
  task = FakeTask([1], values={0: 1.0, 1: 0.5, 2: 2.0})
  scores, errors = score_completions(task, ["ok", "bad answer", "fine", "bad"], [0, 1, 2, 0])
  # Rows 1 and 3 raise -> 0 and flagged; rows 0 and 2 score values[0] = 1, values[2] = 2.
  np.testing.assert_array_equal(scores, [1.0, 0.0, 2.0, 0.0])
  np.testing.assert_array_equal(errors, [False, True, False, True])
  assert scores.dtype == np.float32
  scores, errors = score_completions(task, ["ok"], [1])
  np.testing.assert_array_equal(scores, [0.5])
  assert not errors.any()


def test_a_round_is_group_major_with_overlong_penalty(tokenizer):
  from grpo_jax.models import from_pretrained
  graphdef, params = nnx.split(from_pretrained(assets.EMBEDDED_MODEL))
  b, g, p, t = 2, 3, 6, 4
  # Problem 7 has a 2-token prompt, problem 11 a 5-token one (so tiling would be visible).
  task = FakeTask({7: 2, 11: 5}, values={7: 0.5, 11: 1.0})
  prompts = [rounds.Prompt(7, 7, task.prompt(7)), rounds.Prompt(11, 11, task.prompt(11))]
  config = sampler_lib.sampling_config_for(tokenizer, t, temperature=1.0)
  sample_fn = sampler_lib.make_sampler(graphdef, config)
  sampler = rounds.RoundSampler(sample_fn, tokenizer, task, slots=b * g, prompt_len=p,
                                overlong_buffer=2, overlong_factor=0.5)
  per_prompt, _ = sampler.run(params, [(q, g) for q in prompts], jax.random.key(0))
  rollout, empty = rounds.assemble(list(zip(prompts, per_prompt)), b, g, version=5)
  stats = rounds.row_stats(rounds.Rows.concat(per_prompt))
  assert empty == 0
  r = jax.device_get(rollout)
  assert r.num_rows == b * g == 6
  # Rows 0-2 are prompt 7, rows 3-5 prompt 11 (repeat, not tile: tiling gives 7, 11, 7, ...).
  np.testing.assert_array_equal(r.prompt_id, [7, 7, 7, 11, 11, 11])
  np.testing.assert_array_equal(r.prompt_mask.sum(1), [2, 2, 2, 5, 5, 5])
  ids_7, _ = tokenization.encode_prompts(tokenizer, [task.prompt(7)], p)
  ids_11, _ = tokenization.encode_prompts(tokenizer, [task.prompt(11)], p)
  np.testing.assert_array_equal(r.prompt_ids, np.concatenate([ids_7] * 3 + [ids_11] * 3))
  np.testing.assert_array_equal(r.version, np.full(r.completion_ids.shape, 5))
  # Scores: task value of the row's prompt plus 0.5 * the soft overlong penalty with T = 4,
  # buffer 2: length <= 2 -> 0, length 3 -> (2 - 3) / 2 = -0.5, length 4 with EOS -> -1,
  # truncated -> -1; all times 0.5.
  lengths = r.completion_mask.sum(1)
  truncated = ~np.isin(np.take_along_axis(r.completion_ids, np.maximum(lengths - 1, 0)[:, None],
                                          1)[:, 0], config.eos_ids)
  by_hand = {1: 0.0, 2: 0.0, 3: -0.5, 4: -1.0}
  penalty = np.array([-1.0 if tr else by_hand[n] for n, tr in zip(lengths, truncated)]) * 0.5
  base = np.array([0.5] * 3 + [1.0] * 3)
  np.testing.assert_allclose(r.scores, base + penalty, atol=1e-6)
  assert truncated.any()  # the 4-token budget cuts the embedded model's answers short
  # Success is judged on the task score, before the penalty.
  np.testing.assert_array_equal(r.success, [False] * 3 + [True] * 3)
  assert stats["rollouts"] == 6 and stats["completion_tokens"] == int(lengths.sum())
  assert stats["reward_errors"] == 0
  assert stats["truncated_fraction"] == pytest.approx(truncated.mean())
  # score_base "accuracy" (DAPO's reward): +1 for a success, -1 otherwise, then the same
  # penalty; the task's own graded values (0.5 for prompt 7's rows) are not used.
  dapo = rounds.RoundSampler(sample_fn, tokenizer, task, slots=b * g, prompt_len=p,
                             overlong_buffer=2, overlong_factor=0.5, score_base="accuracy")
  per_prompt, _ = dapo.run(params, [(q, g) for q in prompts], jax.random.key(0))
  rows = rounds.Rows.concat(per_prompt)
  np.testing.assert_array_equal(rows.rollout.completion_ids, r.completion_ids)  # same samples
  np.testing.assert_allclose(rows.rollout.scores, np.array([-1.0] * 3 + [1.0] * 3) + penalty,
                             atol=1e-6)
  with pytest.raises(ValueError, match="score_base"):
    rounds.RoundSampler(sample_fn, tokenizer, task, slots=b * g, prompt_len=p,
                        score_base="format")
