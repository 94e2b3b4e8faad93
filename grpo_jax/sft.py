"""Supervised warm start on generated Countdown solutions: builds the embedded checkpoint.

    python -m grpo_jax.sft --config=configs/sft.py

Trains a Qwen3-architecture model from scratch with teacher forcing on (prompt, reference
answer) pairs, evaluates held-out mean@8 every ``eval.every`` steps, and stops once it reaches
``stop.target_accuracy``, so the RL starting policy leaves room to improve. Writes a Hugging Face
folder (config.json, model.safetensors, tokenizer) plus ``sft_summary.json``.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags

from grpo_jax import console
from grpo_jax.generate import logprobs as logprobs_lib
from grpo_jax.generate import tokenization
from grpo_jax.models import ModelConfig, Qwen3, save_pretrained
from grpo_jax.run import evaluate as evaluate_lib
from grpo_jax.tasks import countdown



def define_flags():
  """The CLI flag; defined only when run as a program, so importing this module is free."""
  config_flags.DEFINE_config_file("config", "configs/sft.py", "SFT configuration.")


def make_task(config) -> countdown.CountdownTask:
  """The generated Countdown task of ``config.task`` (CountdownSpec's fields)."""
  spec = countdown.CountdownSpec.from_group(config.task)
  return countdown.CountdownTask(spec.generator(), template=spec.template)


def make_model_config(config, vocab_size: int) -> ModelConfig:
  m = config.model
  multiple = m.vocab_multiple
  return ModelConfig(vocab_size=-(-vocab_size // multiple) * multiple,
                     hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                     num_layers=m.num_layers, num_heads=m.num_heads,
                     num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                     rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings)


def encode_examples(tokenizer, task, problems, prompt_len: int, completion_len: int):
  """Left-padded prompts and right-padded reference completions ending in EOS.

  Returns:
    dict of numpy arrays: prompt_ids_NxP, prompt_mask_NxP, completion_ids_NxT,
    completion_mask_NxT (True up to and including EOS).
  """
  prompt_ids, prompt_mask = tokenization.encode_prompts(
      tokenizer, [task.prompt(p) for p in problems], prompt_len)
  n = len(problems)
  comp_ids = np.full((n, completion_len), tokenizer.pad_token_id, np.int32)
  comp_mask = np.zeros((n, completion_len), bool)
  rows = tokenizer([task.reference_completion(p) for p in problems],
                   add_special_tokens=False)["input_ids"]
  for i, row in enumerate(rows):
    row = row + [tokenizer.eos_token_id]
    if len(row) > completion_len:
      raise ValueError(f"reference completion {i} has {len(row)} tokens > completion_len "
                       f"{completion_len}")
    comp_ids[i, :len(row)] = row
    comp_mask[i, :len(row)] = True
  return dict(prompt_ids_NxP=prompt_ids, prompt_mask_NxP=prompt_mask,
              completion_ids_NxT=comp_ids, completion_mask_NxT=comp_mask)


def sft_loss(graphdef, params, batch) -> jax.Array:
  """Mean negative log-likelihood per completion token (EOS included)."""
  model = nnx.merge(graphdef, params)
  logp = logprobs_lib.completion_logprobs(model, batch["prompt_ids_NxP"],
                                          batch["prompt_mask_NxP"], batch["completion_ids_NxT"])
  mask = batch["completion_mask_NxT"].astype(jnp.float32)
  return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_train_step(graphdef, tx):
  """Jitted (params, opt_state, batch) -> (params, opt_state, loss); params/state donated."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(functools.partial(sft_loss, graphdef))(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def run(config, output_dir: str | None = None) -> dict:
  """Trains, stops on the accuracy target, saves the folder; returns the summary dict."""
  output_dir = output_dir or config.output_dir
  task = make_task(config)
  tokenizer = tokenization.build_word_tokenizer(countdown.TEMPLATE_WORDS)
  model_config = make_model_config(config, len(tokenizer))
  model = Qwen3(model_config, rngs=nnx.Rngs(config.seed))
  graphdef, params = nnx.split(model)
  logging.info("model: %s (%d parameters)", model_config, model_config.num_params)

  tr = config.train
  schedule = optax.warmup_cosine_decay_schedule(0.0, tr.learning_rate, tr.warmup_steps,
                                                max(tr.max_steps, tr.warmup_steps + 1))
  tx = optax.chain(optax.clip_by_global_norm(tr.grad_clip),
                   optax.adamw(schedule, weight_decay=tr.weight_decay))
  opt_state = tx.init(params)
  train_step = make_train_step(graphdef, tx)

  ev = config.eval
  validation = [countdown.generate_problem(task.config, "test", ev.validation_offset + i)
                for i in range(ev.num_prompts)]
  eval_kw = dict(k=ev.samples, temperature=ev.temperature, prompt_len=tr.prompt_len,
                 completion_len=tr.completion_len, seed=config.seed)
  history = []
  start = time.time()
  step = 0
  for step in range(1, tr.max_steps + 1):
    problems = [task.train_problem((step - 1) * tr.batch_size + i) for i in range(tr.batch_size)]
    batch = encode_examples(tokenizer, task, problems, tr.prompt_len, tr.completion_len)
    params, opt_state, loss = train_step(params, opt_state, batch)
    if step % ev.every == 0 or step == tr.max_steps:
      metrics = evaluate_lib.evaluate(graphdef, params, tokenizer, task, validation, **eval_kw)
      metrics.update(step=step, loss=float(loss), seconds=time.time() - start)
      history.append(metrics)
      logging.info("step %d loss %.4f val mean@%d %.3f constant %.2f (%.0fs)", step, loss,
                   ev.samples, metrics["mean_at_k"], metrics["constant_fraction"],
                   metrics["seconds"])
      print(f"step {step} loss {float(loss):.4f} val mean@{ev.samples} "
            f"{metrics['mean_at_k']:.3f} constant {metrics['constant_fraction']:.2f} "
            f"({metrics['seconds']:.0f}s)", flush=True)
      if metrics["mean_at_k"] >= config.stop.target_accuracy:
        break
  train_seconds = time.time() - start

  final = evaluate_lib.evaluate(graphdef, params, tokenizer, task,
                                task.eval_problems(ev.final_prompts), **eval_kw)
  greedy = evaluate_lib.evaluate(graphdef, params, tokenizer, task,
                                 task.eval_problems(ev.final_prompts),
                                 **{**eval_kw, "k": 1, "temperature": 0.0})
  model = nnx.merge(graphdef, params)
  save_pretrained(model, output_dir, tokenizer=tokenizer)
  summary = dict(steps=step, train_seconds=round(train_seconds, 1),
                 num_params=model_config.num_params, final_eval=final,
                 greedy_accuracy=greedy["mean_at_k"], history=history,
                 config=json.loads(config.to_json()))
  with open(os.path.join(output_dir, "sft_summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  print(json.dumps({"steps": step, "train_seconds": summary["train_seconds"],
                    f"mean_at_{ev.samples}": final["mean_at_k"],
                    "constant_fraction": final["constant_fraction"],
                    "greedy_accuracy": summary["greedy_accuracy"], "output_dir": output_dir}))
  return summary


def main(argv):
  del argv
  console.quiet_unless_verbose()
  run(flags.FLAGS.config)


if __name__ == "__main__":
  define_flags()
  app.run(main)
