"""The supervised warm start runs end to end on the smoke preset and writes a loadable folder."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from configs import sft as sft_config
from grpo_jax import sft
from grpo_jax.models import from_pretrained
from grpo_jax.tasks import countdown


def test_encode_examples_shapes_and_eos(tmp_path):
  from grpo_jax.generate import tokenization
  tok = tokenization.build_word_tokenizer(countdown.TEMPLATE_WORDS)
  task = countdown.CountdownTask()
  problems = [countdown.Problem((3, 5, 7), 56, solution="(3+5)*7")]
  batch = sft.encode_examples(tok, task, problems, prompt_len=20, completion_len=12)
  # <answer> ( 3 + 5 ) * 7 </answer> = 9 tokens, + EOS = 10 masked tokens of 12.
  assert batch["completion_mask_NxT"].sum() == 10
  assert batch["completion_ids_NxT"][0, 9] == tok.eos_token_id
  assert batch["prompt_mask_NxP"].sum() == 18  # the short template is 18 tokens
  with pytest.raises(ValueError, match="completion_len"):
    sft.encode_examples(tok, task, problems, prompt_len=20, completion_len=8)


def test_smoke_run_writes_a_hugging_face_folder(tmp_path):
  config = sft_config.get_config("smoke")
  summary = sft.run(config, os.fspath(tmp_path))
  assert summary["steps"] == config.train.max_steps
  # The loss of the first logged step is finite and the history has both evaluations (3, 6).
  assert [h["step"] for h in summary["history"]] == [3, 6]
  model = from_pretrained(os.fspath(tmp_path))
  tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
  assert model.config.vocab_size >= len(tokenizer)
  assert model.config.vocab_size % config.model.vocab_multiple == 0
  logits = model(jnp.asarray([[tokenizer.eos_token_id]], jnp.int32))
  assert np.all(np.isfinite(np.asarray(logits)))
  saved = json.loads((tmp_path / "sft_summary.json").read_text())
  assert saved["steps"] == summary["steps"]


def test_unknown_preset_is_rejected():
  with pytest.raises(ValueError, match="unknown configs/sft.py preset"):
    sft_config.get_config("large")
