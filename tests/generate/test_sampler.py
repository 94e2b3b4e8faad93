"""Sampler: greedy = argmax of the full forward; behaviour log-probs = teacher-forced ones."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import assets
from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.generate import tokenization
from grpo_jax.generate.logprobs import completion_logprobs, token_logprobs
from grpo_jax.generate.sampler import SamplingConfig, filter_logits

N, P, T = 4, 6, 8
EOS = 5
PAD = 0


@pytest.fixture(scope="module")
def prompts():
  rng = np.random.RandomState(0)
  ids = rng.randint(6, 128, (N, P)).astype(np.int32)  # ids >= 6: no EOS inside prompts
  mask = np.ones((N, P), bool)
  mask[0, :3] = False  # left padding of different lengths
  mask[2, :5] = False
  ids[~mask] = PAD
  return jnp.asarray(ids), jnp.asarray(mask)


def test_greedy_equals_stepwise_argmax_of_full_forward(tiny_qwen3, split, prompts):
  ids, mask = prompts
  config = SamplingConfig(max_new_tokens=T, eos_ids=(EOS,), pad_id=PAD, temperature=0.0)
  out = sampler_lib.make_sampler(split[0], config)(split[1], ids, mask, jax.random.key(0))
  # Reference: a plain full forward over a fixed [N, P + T] buffer (one compilation); causal
  # attention means the not-yet-written slots cannot influence position P - 1 + t.
  forward = jax.jit(lambda params, seq, m: nnx.merge(split[0], params)(seq, m))
  seq = jnp.concatenate([ids, jnp.zeros((N, T), jnp.int32)], 1)
  seq_mask = jnp.concatenate([mask, jnp.ones((N, T), bool)], 1)
  expected = []
  for t in range(T):
    nxt = jnp.argmax(forward(split[1], seq, seq_mask)[:, P - 1 + t], -1).astype(jnp.int32)
    expected.append(nxt)
    seq = seq.at[:, P + t].set(nxt)
  expected = np.stack(expected, 1)
  got = np.asarray(out.completion_ids)
  mask_np = np.asarray(out.completion_mask)
  # Rows agree up to and including their EOS; after it the sampler writes PAD.
  np.testing.assert_array_equal(got[mask_np], expected[mask_np])
  assert np.all(got[~mask_np] == PAD)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_teacher_forced(tiny_qwen3, split, prompts, temperature):
  ids, mask = prompts
  config = SamplingConfig(max_new_tokens=T, eos_ids=(EOS,), pad_id=PAD, temperature=temperature)
  out = sampler_lib.make_sampler(split[0], config)(split[1], ids, mask, jax.random.key(1))
  teacher = completion_logprobs(tiny_qwen3, ids, mask, out.completion_ids, temperature)
  m = np.asarray(out.completion_mask)
  assert m.sum() > N  # something was generated
  diff = np.abs(np.asarray(teacher) - np.asarray(out.behaviour_logp))[m]
  assert diff.max() <= 1e-5
  assert np.all(np.asarray(out.behaviour_logp)[~m] == 0.0)


def test_eos_stops_a_row_and_masks_the_rest(split, prompts):
  ids, mask = prompts
  graphdef, params = split
  never = SamplingConfig(max_new_tokens=T, eos_ids=(127,), pad_id=PAD, temperature=0.0)
  free = sampler_lib.make_sampler(graphdef, never)(params, ids, mask, jax.random.key(2))
  # Declare the token row 0 emits at step 2 an EOS: row 0 must now stop at step 2 or earlier.
  eos = int(free.completion_ids[0, 2])
  config = SamplingConfig(max_new_tokens=T, eos_ids=(eos,), pad_id=PAD, temperature=0.0)
  out = sampler_lib.make_sampler(graphdef, config)(params, ids, mask, jax.random.key(2))
  tokens, m = np.asarray(out.completion_ids), np.asarray(out.completion_mask)
  assert out.lengths[0] <= 3 and not out.truncated[0]
  for row in range(N):
    hits = np.flatnonzero(tokens[row] == eos)
    if hits.size:
      k = hits[0]
      assert m[row, :k + 1].all() and not m[row, k + 1:].any()
      assert out.lengths[row] == k + 1 and not out.truncated[row]
      assert np.all(tokens[row, k + 1:] == PAD)
      # Before the EOS, greedy decoding is unchanged.
      np.testing.assert_array_equal(tokens[row, :k + 1], np.asarray(free.completion_ids)[row, :k + 1])
    else:
      assert m[row].all() and out.lengths[row] == T and out.truncated[row]


def test_eos_everywhere_stops_the_loop_at_step_zero():
  """A model whose output head always prefers token 3: every row ends after one token."""
  from grpo_jax.models import ModelConfig, Qwen3
  cfg = ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=False)
  model = Qwen3(cfg, rngs=nnx.Rngs(0))
  h = model.hidden_states(jnp.ones((1, 1), jnp.int32))[0][0, 0]
  # Column 3 of the head aligned with the hidden state: logit 3 = 100 * sum|h| >> others (0).
  model.lm_head.kernel[...] = jnp.zeros((16, 16)).at[:, 3].set(100.0 * jnp.sign(h))
  graphdef, params = nnx.split(model)
  config = SamplingConfig(max_new_tokens=5, eos_ids=(3,), pad_id=0, temperature=1.0)
  ids = jnp.ones((2, 2), jnp.int32)
  out = sampler_lib.make_sampler(graphdef, config)(params, ids, jnp.ones((2, 2), bool),
                                                   jax.random.key(0))
  np.testing.assert_array_equal(out.completion_ids, [[3, 0, 0, 0, 0]] * 2)
  np.testing.assert_array_equal(out.lengths, [1, 1])
  np.testing.assert_array_equal(out.truncated, [False, False])
  np.testing.assert_array_equal(out.completion_mask, [[True, False, False, False, False]] * 2)


def test_one_compilation_per_shape(split, prompts):
  ids, mask = prompts
  config = SamplingConfig(max_new_tokens=4, eos_ids=(EOS,), pad_id=PAD, temperature=1.0)
  fn = sampler_lib.make_sampler(split[0], config)
  for seed in range(3):
    jax.block_until_ready(fn(split[1], ids, mask, jax.random.key(seed)))
  assert fn._cache_size() == 1
  fn(split[1], ids[:2], mask[:2], jax.random.key(0))
  assert fn._cache_size() == 2


# (name, temperature, top_k, top_p): one sampler each, compiled once for the module.
FILTERS = [("top_k", 1.0, 3, 1.0), ("top_p", 0.7, 0, 0.5), ("both", 1.0, 5, 0.9)]


def _kept_set(logits_V: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
  """The filter rule written out independently of ``filter_logits``, in float64.

  top-k: the k largest scaled logits. top-p (on the distribution left after top-k): sort the
  probabilities in decreasing order and keep the smallest prefix whose mass reaches p (the top
  token always kept). Returns a bool mask over the vocabulary.
  """
  z = logits_V.astype(np.float64) / temperature
  kept = np.ones(z.shape, bool)
  if top_k:
    kept &= z >= np.sort(z)[::-1][top_k - 1]
  if top_p < 1.0:
    prob = np.where(kept, np.exp(z - z.max()), 0.0)
    prob /= prob.sum()
    order = np.argsort(-prob)
    cum = np.cumsum(prob[order])
    n_keep = int(np.argmax(cum >= top_p)) + 1  # first prefix whose mass reaches p
    keep_p = np.zeros(z.shape, bool)
    keep_p[order[:n_keep]] = True
    kept &= keep_p
  return kept


@pytest.fixture(scope="module", params=FILTERS, ids=[f[0] for f in FILTERS])
def filtered_run(request, split, prompts):
  """Samples once per filter setting, with teacher-forced full logits of the same tokens."""
  _, temperature, top_k, top_p = request.param
  ids, mask = prompts
  config = SamplingConfig(max_new_tokens=T, eos_ids=(EOS,), pad_id=PAD, temperature=temperature,
                          top_k=top_k, top_p=top_p)
  out = sampler_lib.make_sampler(split[0], config)(split[1], ids, mask, jax.random.key(3))
  # Full forward over prompt + completion: the logits at position P - 1 + t predict token t
  # (causal attention: PAD written after a row's end cannot reach earlier positions).
  seq = jnp.concatenate([ids, out.completion_ids], 1)
  seq_mask = jnp.concatenate([mask, jnp.ones((N, T), bool)], 1)
  logits = nnx.merge(*split)(seq, seq_mask)[:, P - 1:P - 1 + T]
  return request.param, jax.device_get(out), np.asarray(logits, np.float64)


def test_filtered_draws_lie_in_the_kept_set_and_logp_is_renormalised(filtered_run):
  (_, temperature, top_k, top_p), out, logits = filtered_run
  tokens, m, logp = np.asarray(out.completion_ids), np.asarray(out.completion_mask), np.asarray(out.behaviour_logp)
  assert m.sum() > 2 * N  # several decode steps per row were checked
  sizes = []
  for row, t in zip(*np.nonzero(m)):
    kept = _kept_set(logits[row, t], temperature, top_k, top_p)
    sizes.append(kept.sum())
    assert kept[tokens[row, t]], (row, t)
    # log_softmax over the kept set only: z_tok - logsumexp(z_kept).
    z = logits[row, t] / temperature
    expected = z[tokens[row, t]] - np.log(np.sum(np.exp(z[kept] - z.max()))) - z.max()
    np.testing.assert_allclose(logp[row, t], expected, atol=1e-5)
  # The filter really cut something (and the test did not degenerate to greedy).
  assert max(sizes) < logits.shape[-1] and max(sizes) > 1
  if top_k:
    assert max(sizes) <= top_k


def test_filter_logits_by_hand():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  cfg = SamplingConfig(max_new_tokens=1, eos_ids=(0,), pad_id=0, top_k=2)
  kept = np.isfinite(np.asarray(filter_logits(logits, cfg)))
  np.testing.assert_array_equal(kept, [[True, True, False, False]])
  # top_p 0.8: mass before each sorted token is 0, 0.5, 0.8, 0.95; keep where it is < 0.8,
  # i.e. the first two tokens (0.5 + 0.3 = 0.8 reaches p).
  cfg = SamplingConfig(max_new_tokens=1, eos_ids=(0,), pad_id=0, top_p=0.8)
  kept = np.isfinite(np.asarray(filter_logits(logits, cfg)))
  np.testing.assert_array_equal(kept, [[True, True, False, False]])
  # Renormalised log-prob of token 1 with top_k=2: log(0.3 / 0.8).
  cfg = SamplingConfig(max_new_tokens=1, eos_ids=(0,), pad_id=0, top_k=2)
  lp = token_logprobs(filter_logits(logits, cfg), jnp.array([1]))
  np.testing.assert_allclose(lp, np.log(0.3 / 0.8), rtol=1e-6)


def test_sampling_config_validation():
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(max_new_tokens=1, eos_ids=(0,), pad_id=0, top_p=0.0)
  with pytest.raises(ValueError, match="eos_ids"):
    SamplingConfig(max_new_tokens=1, eos_ids=(), pad_id=0)


@pytest.mark.parametrize("group,block", [(1, 2), (2, 4), (2, 2)])
def test_rows_in_blocks_give_the_unblocked_tokens(split, group, block):
  """8 rows (4 prompts, each twice in a row with group 2) sampled in blocks of ``block`` rows,
  one block's cache at a time: block b takes every (8 / block)-th group from b on and draws
  the uniforms the unblocked call gives those rows, so the tokens are the same (the log-probs
  up to the matmuls' rounding at another row count)."""
  rng = np.random.RandomState(3)
  ids = np.repeat(rng.randint(6, 128, (8 // group, P)).astype(np.int32), group, axis=0)
  mask = np.ones(ids.shape, bool)
  mask[:group, :2] = False  # the first prompt left padded
  ids[~mask] = PAD
  args = (split[1], jnp.asarray(ids), jnp.asarray(mask), jax.random.key(4))
  cfg = dict(max_new_tokens=T, eos_ids=(EOS,), pad_id=PAD, prompt_group=group)
  whole = sampler_lib.make_sampler(split[0], SamplingConfig(**cfg))(*args)
  blocked = sampler_lib.make_sampler(split[0], SamplingConfig(**cfg, row_block=block))(*args)
  for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
    np.testing.assert_array_equal(getattr(blocked, name), getattr(whole, name), err_msg=name)
  np.testing.assert_allclose(blocked.behaviour_logp, whole.behaviour_logp, atol=1e-5)
  assert len({tuple(r) for r in np.asarray(whole.completion_ids).tolist()}) > 1
  with pytest.raises(ValueError, match="row_block must be 0 or a positive multiple"):
    SamplingConfig(**{**cfg, "prompt_group": 2}, row_block=3)


def test_inverse_cdf_draws_follow_the_distribution():
  probs = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
  n = 20_000
  logp = jnp.log(jnp.asarray(np.tile(probs, (n, 1)), jnp.float32))
  u = sampler_lib.uniforms(jax.random.key(0), n)
  draws = np.asarray(sampler_lib._inverse_cdf_sample(u, logp))
  freq = np.bincount(draws, minlength=5) / n
  # Binomial std of a frequency: sqrt(p (1 - p) / n) <= sqrt(0.25 / 20000) = 0.0035; allow 5 std.
  np.testing.assert_allclose(freq, probs, atol=5 * 0.0036)
  assert freq[4] == 0.0  # a zero-probability (filtered) token is never drawn


# Stop tokens from generation_config.json, with the embedded model (EOS "<|endoftext|>" = 1).


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
  """A copy of the embedded model folder (no generation_config.json), its tokenizer and model."""
  import transformers
  from grpo_jax.models import from_pretrained
  folder = tmp_path_factory.mktemp("model") / "embedded"
  shutil.copytree(assets.EMBEDDED_MODEL, folder)
  assert not (folder / "generation_config.json").exists()
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  return folder, tokenizer, nnx.split(from_pretrained(str(folder)))


def _write_generation_config(folder, eos):
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))


def test_stop_token_ids_without_generation_config_are_the_tokenizers(embedded):
  folder, tokenizer, _ = embedded
  assert tokenizer.eos_token_id == 1
  assert sampler_lib.stop_token_ids(tokenizer, str(folder)) == (1,)
  assert sampler_lib.stop_token_ids(tokenizer) == (1,)
  config = sampler_lib.sampling_config_for(tokenizer, 4, model_path=str(folder))
  assert config.eos_ids == (1,) and config.pad_id == tokenizer.pad_token_id == 0


def test_stop_token_ids_int_and_malformed_generation_config(tmp_path, embedded):
  _, tokenizer, _ = embedded
  _write_generation_config(tmp_path, 7)  # a single int; the tokenizer's 1 comes first
  assert sampler_lib.stop_token_ids(tokenizer, str(tmp_path)) == (1, 7)
  (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7,')
  with pytest.raises(ValueError, match="generation_config.json"):
    sampler_lib.stop_token_ids(tokenizer, str(tmp_path))


def test_second_stop_token_from_generation_config_ends_a_row(embedded):
  folder, tokenizer, (graphdef, params) = embedded
  texts = ["Using the numbers [20, 15, 41], create an equation that equals 46.",
           "Using the numbers [49, 38, 33], create an equation that equals 44."]
  ids, mask = tokenization.encode_prompts(tokenizer, texts, 20)
  t_max = 8

  def greedy(config):
    out = sampler_lib.make_sampler(graphdef, config)(params, ids, mask, jax.random.key(0))
    return jax.device_get(out)

  free = greedy(sampler_lib.sampling_config_for(tokenizer, t_max, temperature=0.0,
                                                model_path=str(folder)))
  # The token row 0 emits greedily at step 2, not an EOS or PAD: declare it the second stop id.
  second = int(free.completion_ids[0, 2])
  assert second not in (0, 1) and free.lengths[0] > 3
  _write_generation_config(folder, [second, 1])
  try:
    # Tokenizer's id first, then the file's, the repeated 1 dropped.
    assert sampler_lib.stop_token_ids(tokenizer, str(folder)) == (1, second)
    config = sampler_lib.sampling_config_for(tokenizer, t_max, temperature=0.0,
                                             model_path=str(folder))
    assert config.eos_ids == (1, second)
    out = greedy(config)
  finally:
    (folder / "generation_config.json").unlink()
  tokens, m = np.asarray(out.completion_ids), np.asarray(out.completion_mask)
  free_tokens = np.asarray(free.completion_ids)
  for row in range(len(texts)):
    hits = np.flatnonzero(free_tokens[row] == second)
    stop = hits[0] if hits.size and hits[0] < free.lengths[row] else None
    if row == 0:
      assert stop is not None and stop <= 2
    if stop is None:  # unchanged
      np.testing.assert_array_equal(tokens[row], free_tokens[row])
      continue
    # Greedy prefix up to and including the stop token, then PAD (0) and a closed mask.
    np.testing.assert_array_equal(tokens[row, :stop + 1], free_tokens[row, :stop + 1])
    assert np.all(tokens[row, stop + 1:] == 0)
    assert m[row, :stop + 1].all() and not m[row, stop + 1:].any()
    assert out.lengths[row] == stop + 1 and not out.truncated[row]
