"""Embedded word-level tokenizer and the prompt / completion helpers."""

import numpy as np
import pytest
import transformers

from grpo_jax.generate import tokenization
from grpo_jax.tasks import countdown


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok")
  tokenization.build_word_tokenizer(countdown.TEMPLATE_WORDS).save_pretrained(path)
  # Load back through the same path a real Qwen3 tokenizer takes.
  return transformers.AutoTokenizer.from_pretrained(path)


def test_special_ids_and_single_token_tags(tokenizer):
  assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
  for tag in tokenization.TAGS:
    assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1
  assert tokenizer.tokenize("37") == ["37"]
  assert tokenizer.convert_tokens_to_ids("1000") == tokenizer.unk_token_id  # out of range


def test_prompt_tokens(tokenizer):
  text = countdown.prompt(countdown.Problem((44, 19, 35), 98))
  # Using the numbers [ 44 , 19 , 35 ] , create an equation that equals 98 . -> 18 tokens.
  assert len(tokenizer.tokenize(text)) == 18
  assert tokenizer.unk_token not in tokenizer.tokenize(text)


def test_reference_completion_survives_encode_decode_and_scores(tokenizer):
  problem = countdown.Problem((3, 5, 7), 56, solution="(3+5)*7")
  ids = tokenizer(countdown.reference_completion(problem), add_special_tokens=False)["input_ids"]
  ids = np.array([ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]])
  mask = np.ones_like(ids, bool)
  mask[0, -1] = False
  (text,) = tokenization.decode_completions(tokenizer, ids, mask)
  assert text == "<answer> ( 3 + 5 ) * 7 </answer>"  # EOS skipped, pad masked out
  assert countdown.score(text, problem.nums, problem.target) == 1.0


def test_encode_prompts_left_pads(tokenizer):
  ids, mask = tokenization.encode_prompts(tokenizer, ["Using the numbers", "the"], 4)
  assert ids.dtype == np.int32 and ids.shape == (2, 4)
  np.testing.assert_array_equal(mask, [[False, True, True, True], [False, False, False, True]])
  assert ids[1, 0] == tokenizer.pad_token_id
  assert ids[1, 3] == tokenizer.convert_tokens_to_ids("the")


def test_encode_prompts_too_long_names_the_prompt(tokenizer):
  with pytest.raises(tokenization.PromptTooLongError, match="prompt 1 has 3 tokens"):
    tokenization.encode_prompts(tokenizer, ["the", "the the the"], 2)
