"""Prompt encoding / completion decoding, and the embedded word-level tokenizer.

The helpers work with any transformers tokenizer (a real Qwen3 one included). The embedded
tokenizer is a ``tokenizers`` WordLevel model wrapped in ``PreTrainedTokenizerFast`` and saved
in Hugging Face format, so it loads through ``transformers.AutoTokenizer`` exactly like a real
one. Its vocabulary: special tokens, the answer/think tags as single tokens, the words of the
Countdown templates, punctuation and arithmetic symbols, and every integer 0..999 as one token
(a ~1M-parameter model cannot learn multi-digit arithmetic from digits in CPU-minutes).
"""

from __future__ import annotations

import string
from typing import Sequence

import numpy as np

PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<unk>"
TAGS = ("<answer>", "</answer>", "<think>", "</think>")
MAX_NUMBER_TOKEN = 999


class PromptTooLongError(ValueError):
  """A prompt does not fit the configured prompt length."""


def build_word_tokenizer(words: Sequence[str], max_number: int = MAX_NUMBER_TOKEN):
  """The embedded tokenizer: a transformers ``PreTrainedTokenizerFast``.

  Args:
    words: alphabetic words to give their own tokens (e.g. ``countdown.TEMPLATE_WORDS``).
    max_number: integers 0..max_number each get one token; larger ones map to ``<unk>``.

  Returns:
    A tokenizer with pad, eos and unk set; ids are stable for the same inputs.
  """
  from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  vocab_list = [PAD, EOS, UNK, *TAGS]
  vocab_list += sorted(set(string.punctuation))
  vocab_list += sorted(set(words))
  vocab_list += [str(i) for i in range(max_number + 1)]
  vocab = {tok: i for i, tok in enumerate(dict.fromkeys(vocab_list))}
  tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.WhitespaceSplit(),
      pre_tokenizers.Split(Regex(r"\d+|[A-Za-z]+|[^A-Za-z\d]"), behavior="isolated"),
  ])
  tok.add_special_tokens([AddedToken(t, special=True) for t in (PAD, EOS, UNK)])
  # Tags are ordinary (non-special) added tokens: matched before pre-tokenisation so they stay
  # single tokens, and kept by decode(skip_special_tokens=True) so the verifier sees them.
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD,
                                              eos_token=EOS, unk_token=UNK,
                                              padding_side="left")


def encode_prompts(tokenizer, texts: Sequence[str], length: int) -> tuple[np.ndarray, np.ndarray]:
  """Tokenises prompts and left-pads them to a fixed length.

  Args:
    tokenizer: a transformers tokenizer with a pad (or eos) token.
    texts: N prompt strings.
    length: P, the fixed prompt length (fixed shapes: one compilation).

  Returns:
    (ids_NxP int32, mask_NxP bool), real tokens right-aligned.

  Raises:
    PromptTooLongError: a prompt has more than ``length`` tokens (names the first one).
  """
  pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  ids = np.full((len(texts), length), pad_id, np.int32)
  mask = np.zeros((len(texts), length), bool)
  # Each distinct text is tokenised once: a round repeats every prompt G times (an evaluation
  # k times), and a text's tokens do not depend on the other texts of the call.
  unique = list(dict.fromkeys(texts))
  encoded = dict(zip(unique, tokenizer(unique, add_special_tokens=False)["input_ids"]))
  for i, row in enumerate(encoded[text] for text in texts):
    if len(row) > length:
      raise PromptTooLongError(f"prompt {i} has {len(row)} tokens, more than the prompt length "
                               f"{length}: raise the prompt length or shorten the template "
                               f"(prompt starts: {texts[i][:60]!r})")
    if not row:
      raise PromptTooLongError(f"prompt {i} is empty after tokenisation")
    ids[i, length - len(row):] = row
    mask[i, length - len(row):] = True
  return ids, mask


def prompt_lengths(tokenizer, texts: Sequence[str]) -> np.ndarray:
  """Token count of each prompt (no special tokens added)."""
  return np.array([len(r) for r in tokenizer(list(texts), add_special_tokens=False)["input_ids"]])


def decode_completions(tokenizer, tokens_NxT, mask_NxT) -> list[str]:
  """Text of each completion, masked tokens dropped, special tokens (EOS, pad) skipped."""
  tokens, mask = np.asarray(tokens_NxT), np.asarray(mask_NxT, bool)
  rows = [row[m].tolist() for row, m in zip(tokens, mask)]
  return tokenizer.batch_decode(rows, skip_special_tokens=True)
