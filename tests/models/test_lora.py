"""LoRA: adapters start as a no-op, only they train, the reference is the base, exports load.

The tiny Qwen3 of tests/data (loaded afresh here: adapters change a model in place) with rank-2
adapters on every projection. Equalities that hold exactly are asserted exactly: an adapter
with B = 0 adds (x A) 0 = 0 to each projection, and y + 0 = y in floating point.
"""

import json
import os
import re

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import grpo, popo
from grpo_jax import configuration, schema, train
from grpo_jax.models import CheckpointError, adapter_folder, from_pretrained, lora
from grpo_jax.models import save_pretrained
from grpo_jax.rl import losses, step as step_lib
from grpo_jax.rl.replay import init_replay
from grpo_jax.rl.step_config import StepConfig
from grpo_jax.run import checkpoint as checkpoint_lib
from tests import optional
from tests.conftest import DATA
from tests.rl.test_step import G, MIXED, P, T, _rollout

TINY = os.fspath(DATA / "tiny_qwen3")
IDS = np.array([[7, 19, 33, 2, 90, 41, 8], [3, 3, 64, 100, 12, 5, 77]], np.int32)


def _adapted(seed_b=None, rank=2, alpha=4.0, targets=lora.DEFAULT_TARGETS):
  """The tiny model with adapters; ``seed_b`` draws B ~ 0.1 N(0, 1) (else B = 0)."""
  model = from_pretrained(TINY)
  lora.attach(model, lora.LoraConfig(rank, alpha, targets), nnx.Rngs(0))
  if seed_b is not None:
    for i, site in enumerate(lora.dense_layers(model)):
      if site.rank:
        site.set_factors(b=0.1 * jax.random.normal(jax.random.key(seed_b + i),
                                                   (site.rank, site.shape[1])))
  return model


def _logits(model):
  return np.asarray(model(jnp.asarray(IDS)))


@pytest.fixture(scope="module")
def base_logits():
  return _logits(from_pretrained(TINY))


def test_adapters_start_as_a_no_op_and_cover_the_projections(base_logits):
  model = _adapted()
  adapted = [site.path for site in lora.dense_layers(model) if site.rank]
  # 2 layers x (q, k, v, o, gate, up, down); the tied LM head is no dense layer.
  assert len(adapted) == 2 * 7 and all(p.split(".")[-1].endswith("proj") for p in adapted)
  np.testing.assert_array_equal(_logits(model), base_logits)
  a = model.layers.self_attn.q_proj.lora.lora_a  # stacked like the layers: [L, in, r]
  assert a.dtype == jnp.float32 and isinstance(a, nnx.LoRAParam) and a.shape == (2, 64, 2)
  # PEFT's A: uniform in +-1 / sqrt(in); the tiny model's width is 64 -> +-0.125.
  assert 0.1 < float(jnp.abs(a[...]).max()) <= 0.125


def test_targets_select_layers_and_a_target_matching_nothing_is_refused():
  model = _adapted(targets=r"self_attn\.(q|v)_proj$")
  assert [site.path for site in lora.dense_layers(model) if site.rank] == [
      "layers.0.self_attn.q_proj", "layers.0.self_attn.v_proj",
      "layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj"]
  with pytest.raises(ValueError, match="matches none of the dense layers"):
    _adapted(targets="attention_typo")


def _merged_logits(model):
  """Logits of ``model``'s adapters folded into the kernels per layer, by numpy in float64:
  W + scale A B for each adapted site, from its own rank's factors (no padding)."""
  plain = from_pretrained(TINY)
  for site, target in zip(lora.dense_layers(model), lora.dense_layers(plain)):
    if site.rank:
      a, b = (np.asarray(f, np.float64) for f in site.factors())
      kernel = np.asarray(target.dense.kernel[...])[site.index]  # every site here is stacked
      target.set_kernel(kernel + site.scale * (a @ b))
  return _logits(plain)


def _adapter_updates(model):
  """(gradients of a loss in the adapters, the adapters after one AdamW step with decay)."""
  graphdef, params = nnx.split(model)
  adapters, base = lora.split(params)
  loss = lambda a: jnp.sum(nnx.merge(graphdef, lora.combine(a, base))(jnp.asarray(IDS)) ** 2)
  grads = jax.grad(loss)(adapters)
  tx = optax.adamw(1e-2, weight_decay=0.1)
  updates, _ = tx.update(grads, tx.init(adapters), adapters)
  return grads, optax.apply_updates(adapters, updates)


def test_per_layer_targets_leave_the_other_layers_inert():
  """Targets match per layer: ``layers.1`` adapts layer 1 only; layer 0's slice of the stacked
  adapters has rank 0, scale 0 and zero factors, which neither change the output nor train."""
  model = _adapted(seed_b=6, rank=3, alpha=6.0, targets=r"layers\.1\..*_proj$")
  q = model.layers.self_attn.q_proj.lora
  assert q.ranks == (0, 3) and q.lora_a.shape == (2, 64, 3)
  np.testing.assert_array_equal(np.asarray(q.scale[...]), [0.0, 2.0])
  assert [site.path for site in lora.dense_layers(model) if site.rank] == [
      f"layers.1.{m}" for m in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj",
                                "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj",
                                "self_attn.v_proj")]
  np.testing.assert_allclose(_logits(model), _merged_logits(model), atol=1e-5, rtol=0)
  grads, stepped = _adapter_updates(model)
  for tree in (grads, stepped):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      assert not np.any(np.asarray(x)[0]), jax.tree_util.keystr(path)  # layer 0: zero
  assert all(np.any(np.asarray(x)[1]) for x in jax.tree.leaves(grads))  # layer 1 trains


def test_mixed_ranks_pad_inertly_and_round_trip_exactly(tmp_path):
  """Layers of one stack with different ranks (as PEFT's rank_pattern gives) are padded to the
  largest with zero columns of A and rows of B: the function is each layer's own W + scale A B,
  the padding gets zero gradients and stays zero, and an adapter folder keeps each module's
  rank and alpha through save -> load -> save."""
  model = from_pretrained(TINY)
  plans = {"layers.0.self_attn.q_proj": lora.Plan(2, 1.5),
           "layers.1.self_attn.q_proj": lora.Plan(4, 0.75),
           "layers.1.mlp.down_proj": lora.Plan(3, 4.0 / 3.0)}
  lora.adapt(model, plans, nnx.Rngs(0))
  sites = {site.path: site for site in lora.dense_layers(model)}
  for i, path in enumerate(plans):
    sites[path].set_factors(b=0.1 * jax.random.normal(jax.random.key(i),
                                                      (plans[path].rank, sites[path].shape[1])))
  q = model.layers.self_attn.q_proj.lora
  assert q.ranks == (2, 4) and q.lora_a.shape == (2, 64, 4) and q.lora_b.shape == (2, 4, 128)
  assert not np.any(np.asarray(q.lora_a[...])[0, :, 2:]) and not np.any(q.lora_b[...][0, 2:])
  logits = _logits(model)
  np.testing.assert_allclose(logits, _merged_logits(model), atol=1e-5, rtol=0)
  grads, stepped = _adapter_updates(model)
  for tree in (grads, stepped):
    factors = tree["layers"]["self_attn"]["q_proj"]["lora"]
    a, b = (np.asarray(factors[name][...]) for name in ("lora_a", "lora_b"))
    assert not np.any(a[0, :, 2:]) and not np.any(b[0, 2:])  # layer 0's padding: rank 2 of 4
  assert np.any(np.asarray(grads["layers"]["self_attn"]["q_proj"]["lora"]["lora_b"][...])[0, :2])
  out, again = os.fspath(tmp_path / "adapter"), os.fspath(tmp_path / "again")
  adapter_folder.save_adapter(model, out, base_model=TINY)
  config = json.load(open(os.path.join(out, adapter_folder.CONFIG)))
  assert sorted(config["target_modules"]) == sorted(f"model.{p}" for p in plans)
  # r: the most common rank, the first met on a tie; the others by their escaped full names.
  assert config["r"] == 2 and config["rank_pattern"] == {
      re.escape("model.layers.1.mlp.down_proj"): 3,
      re.escape("model.layers.1.self_attn.q_proj"): 4}
  back = from_pretrained(out)
  np.testing.assert_array_equal(_logits(back), logits)
  for site in lora.dense_layers(back):
    if site.rank:
      ours = sites[site.path]
      assert (site.rank, site.scale) == (ours.rank, ours.scale), site.path
      for x, y in zip(site.factors(), ours.factors()):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  adapter_folder.save_adapter(back, again, base_model=TINY)
  assert json.load(open(os.path.join(again, adapter_folder.CONFIG))) == config


def test_reference_is_the_base_model_exactly(base_logits):
  model = _adapted(seed_b=1)
  graphdef, params = nnx.split(model)
  assert np.abs(_logits(model) - base_logits).max() > 1e-3  # the adapters change the model
  off = nnx.merge(graphdef, lora.without_adapters(params))
  np.testing.assert_array_equal(_logits(off), base_logits)
  # The base arrays are shared, not copied.
  _, base_in = lora.split(params)
  _, base_off = lora.split(lora.without_adapters(params))
  assert all(x is y for x, y in zip(jax.tree.leaves(base_in), jax.tree.leaves(base_off)))


def _step(graphdef, kl_coef=0.0):
  tx = optax.adam(1e-2)
  config = StepConfig(group_size=G, num_minibatches=1,
                               loss=losses.LossConfig(kl_coef=kl_coef))
  return tx, step_lib.make_train_step(graphdef, tx, config)


def test_a_step_trains_only_the_adapters_with_the_base_as_reference():
  graphdef, params = nnx.split(_adapted())
  full_graphdef, full_params = nnx.split(from_pretrained(TINY))
  rollout = _rollout((full_graphdef, full_params), MIXED)
  tx, fn = _step(graphdef, kl_coef=0.1)
  state = step_lib.init_train_state(jax.tree.map(jnp.copy, params), tx)
  # The optimiser state is of the adapters only: Adam's mu and nu of 7 stacked x (A, B).
  assert len(jax.tree.leaves(state.opt_state)) == 1 + 2 * 14
  new, _, m = fn(state, init_replay(0, G, P, T), rollout, None, jax.random.key(0))
  adapters0, base0 = lora.split(params)
  adapters1, base1 = lora.split(new.params)
  for x, y in zip(jax.tree.leaves(base0), jax.tree.leaves(base1)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  b_moved = [float(jnp.abs(y - x).max()) for (p, x), y in zip(
      jax.tree_util.tree_flatten_with_path(adapters0)[0], jax.tree.leaves(adapters1))
      if "lora_b" in jax.tree_util.keystr(p)]
  # Adam's first step moves every B entry with a non-zero gradient by ~lr = 1e-2.
  assert min(b_moved) > 5e-3
  # At the start policy == base: the KL to the reference is 0 and the loss equals the full
  # model's loss on the same rows (the same function), to float32 rounding of the extra adds.
  assert float(m["kl_ref"]) == 0.0
  full_tx, full_fn = _step(full_graphdef, kl_coef=0.1)
  full_state = step_lib.init_train_state(jax.tree.map(jnp.copy, full_params), full_tx)
  ref = jax.tree.map(jnp.copy, full_params)
  _, _, full_m = full_fn(full_state, init_replay(0, G, P, T), rollout, ref, jax.random.key(0))
  np.testing.assert_allclose(float(m["loss"]), float(full_m["loss"]), rtol=1e-6, atol=1e-8)
  # One step later the adapted policy has left the base: the KL is positive.
  _, _, m2 = fn(new, init_replay(0, G, P, T), rollout, None, jax.random.key(1))
  assert float(m2["kl_ref"]) > 0.0


def test_checkpoint_holds_the_adapters_only_and_restores_exactly(tmp_path):
  graphdef, params = nnx.split(_adapted(seed_b=2))
  tx = optax.adam(1e-3)
  state = step_lib.init_train_state(params, tx)
  replay = init_replay(0, G, P, T)
  ckpt = checkpoint_lib.Checkpointer(os.fspath(tmp_path), keep=1)
  ckpt.save(3, state, replay, {"data_position": 0})
  raw = ckpt.manager.restore(3).state["train"]
  saved = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
      raw["params"])[0]}
  assert saved and all("lora" in k for k in saved)
  # Into a template with the same base and other adapters: the saved adapters come back.
  template = step_lib.init_train_state(nnx.split(_adapted(seed_b=9))[1], tx)
  restored, _, _ = ckpt.restore(3, template, replay)
  ckpt.close()
  for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  del graphdef


def test_merged_export_loads_in_transformers(tmp_path):
  torch = optional.require_or_skip("torch")
  transformers = optional.require_or_skip("transformers")
  model = _adapted(seed_b=3)
  save_pretrained(model, os.fspath(tmp_path))
  hf = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(tmp_path),
                                                         dtype=torch.float32)
  theirs = hf(torch.tensor(IDS.astype(np.int64))).logits.detach().numpy()
  np.testing.assert_allclose(theirs, _logits(model), atol=1e-4, rtol=0)
  # The merged folder is a plain model: loading it gives no adapters and the same logits.
  plain = from_pretrained(os.fspath(tmp_path))
  assert not any(site.rank for site in lora.dense_layers(plain))
  np.testing.assert_allclose(_logits(plain), _logits(model), atol=1e-5, rtol=0)
  # The model that was saved keeps its adapters.
  assert any(site.rank for site in lora.dense_layers(model))


def test_adapter_folder_loads_back_and_in_peft(tmp_path):
  model = _adapted(seed_b=4)
  out = os.fspath(tmp_path / "adapter")
  adapter_folder.save_adapter(model, out, base_model=TINY)
  config = json.load(open(os.path.join(out, adapter_folder.CONFIG)))
  assert config["r"] == 2 and config["lora_alpha"] == 4.0 and len(config["target_modules"]) == 14
  back = from_pretrained(out)  # the base from the folder's record
  np.testing.assert_array_equal(_logits(back), _logits(model))
  torch, transformers, peft = map(optional.require_or_skip, ("torch", "transformers", "peft"))
  base = transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
  theirs = peft.PeftModel.from_pretrained(base, out)(torch.tensor(IDS.astype(np.int64)))
  np.testing.assert_allclose(theirs.logits.detach().numpy(), _logits(model), atol=1e-4, rtol=0)


def test_adapter_folder_without_its_base_is_one_line(tmp_path):
  out = os.fspath(tmp_path / "adapter")
  adapter_folder.save_adapter(_adapted(), out, base_model="/nowhere/Qwen3-8B")
  with pytest.raises(CheckpointError, match="is not a local folder; pass the base"):
    from_pretrained(out)
  np.testing.assert_array_equal(_logits(from_pretrained(out, base=TINY)),
                                _logits(_adapted()))


@pytest.mark.parametrize("lora_kwargs", [
    # Per-module ranks and alphas (a suffix, a regex and a full name), layers_to_transform.
    dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
         layers_to_transform=[1, 0], rank_pattern={"v_proj": 4, r"layers\.1\..*down_proj": 3},
         alpha_pattern={"model.layers.0.self_attn.q_proj": 16, "o_proj": 1}),
    # rsLoRA (alpha / sqrt(r)) with an alpha pattern, a regex target (the output layer
    # included) and exclude_modules.
    dict(r=4, lora_alpha=3, use_rslora=True, target_modules=r".*\.(q_proj|up_proj)|lm_head",
         exclude_modules=["layers.0.mlp.up_proj"], alpha_pattern={"up_proj": 9}),
], ids=["rank_alpha_patterns", "rslora"])
def test_a_peft_folder_with_per_module_rank_and_alpha_gives_peft_logits(tmp_path, lora_kwargs):
  """A folder PEFT wrote with rank_pattern / alpha_pattern / use_rslora loads with PEFT's
  per-module rank and scale (its logits), and saves back to a folder PEFT reads alike."""
  torch, transformers, peft = map(optional.require_or_skip, ("torch", "transformers", "peft"))
  base = lambda: transformers.AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
  ids = torch.tensor(IDS.astype(np.int64))
  torch.manual_seed(0)
  theirs = peft.get_peft_model(base(), peft.LoraConfig(**lora_kwargs))
  with torch.no_grad():
    for name, p in theirs.named_parameters():
      if "lora_B" in name:
        p.copy_(0.1 * torch.randn_like(p))  # else B = 0 and any scale gives the base
  out, again = os.fspath(tmp_path / "peft"), os.fspath(tmp_path / "again")
  theirs.save_pretrained(out)
  theirs_logits = theirs(ids).logits.detach().numpy()
  ours = from_pretrained(out)
  np.testing.assert_allclose(_logits(ours), theirs_logits, atol=1e-4, rtol=0)
  adapter_folder.save_adapter(ours, again, base_model=TINY)
  np.testing.assert_array_equal(_logits(from_pretrained(again)), _logits(ours))
  back = peft.PeftModel.from_pretrained(base(), again)(ids).logits.detach().numpy()
  np.testing.assert_allclose(back, theirs_logits, atol=1e-5, rtol=0)


_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _edited_folder(tmp_path, **changes):
  """The tiny model's rank-2, alpha-4 adapters on every projection, saved, with ``changes``
  written into its adapter_config.json (None deletes a key)."""
  out = os.fspath(tmp_path / "adapter")
  adapter_folder.save_adapter(_adapted(seed_b=5), out, base_model=TINY)
  path = os.path.join(out, adapter_folder.CONFIG)
  with open(path) as f:
    config = json.load(f) | changes
  with open(path, "w") as f:
    json.dump({k: v for k, v in config.items() if v is not None}, f)
  return out


@pytest.mark.parametrize("changes,expected", [
    (dict(alpha_pattern={"q_proj": 8, r"layers\.1\.mlp\.down_proj": 1}),
     {"self_attn.q_proj": 4.0, "layers.1.mlp.down_proj": 0.5, "": 2.0}),
    (dict(use_rslora=True), {"": 4.0 / np.sqrt(2)}),
    (dict(use_rslora=True, alpha_pattern={"k_proj": 2}), {"k_proj": 2.0 / np.sqrt(2),
                                                          "": 4.0 / np.sqrt(2)}),
])
def test_adapter_folder_alpha_pattern_and_rslora_set_each_layers_scale(tmp_path, changes,
                                                                       expected):
  """Without torch: each layer gets PEFT's scale (the first ``expected`` key its path
  contains; "" for the rest), and its logits are those of the same adapters at those scales."""
  model = from_pretrained(_edited_folder(tmp_path, **changes))
  reference = _adapted(seed_b=5)
  for site, ref in zip(lora.dense_layers(model), lora.dense_layers(reference)):
    assert (site.path, site.rank) == (ref.path, ref.rank)
    if not site.rank:  # lm_head
      continue
    scale = next(v for k, v in expected.items() if k in site.path)
    assert site.scale == np.float32(scale), site.path  # PEFT's scale, stored in float32
    ref.dense.lora.scale[...] = site.dense.lora.scale[...]
  np.testing.assert_array_equal(_logits(model), _logits(reference))


@pytest.mark.parametrize("changes,key", [
    (dict(use_dora=True), "use_dora"),
    (dict(bias="all"), "bias"),
    (dict(lora_bias=True), "lora_bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(init_lora_weights="pissa"), "init_lora_weights"),
    (dict(init_lora_weights="olora"), "init_lora_weights"),
    (dict(layer_replication=[[0, 2], [1, 2]]), "layer_replication"),
    (dict(trainable_token_indices=[3]), "trainable_token_indices"),
    (dict(target_parameters=["mlp.experts.down_proj"]), "target_parameters"),
    (dict(alora_invocation_tokens=[5, 6]), "alora_invocation_tokens"),
    (dict(peft_type="LOHA"), "peft_type"),
    (dict(some_future_setting={"on": True}), "some_future_setting"),
    (dict(target_modules=None), "target_modules"),
    (dict(target_modules=["q_proj", "k_proj"]), "target_modules"),  # weights for the others
    (dict(target_modules=list(_SUFFIXES), layers_to_transform=[0]), "layers_to_transform"),
    (dict(exclude_modules=["down_proj"]), "exclude_modules"),
    (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),  # 4 != the tensors' rank 2
    (dict(alpha_pattern={"(q_proj": 4}), "alpha_pattern"),
])
def test_adapter_folder_settings_it_cannot_honour_are_refused_in_one_line(tmp_path, changes,
                                                                          key):
  out = _edited_folder(tmp_path, **changes)
  with pytest.raises(CheckpointError, match=f"^{re.escape(out)}: .*{key}") as e:
    from_pretrained(out)
  assert "\n" not in str(e.value)


def test_adapter_folder_settings_that_do_not_change_the_function_are_accepted(tmp_path):
  """Inits that leave the base as it is, dropout (off when loaded), fan_in_fan_out (PEFT
  resets it on torch.nn.Linear), matching by suffix, all-linear on a model whose adapters
  cover every linear layer but the output layer, and PEFT's bookkeeping fields."""
  expected = _logits(_adapted(seed_b=5))
  for changes in (dict(init_lora_weights="gaussian", lora_dropout=0.1, fan_in_fan_out=True,
                       target_modules=list(_SUFFIXES),
                       runtime_config={"ephemeral_gpu_offload": False}, peft_version="0.21.0",
                       layers_to_transform=[0, 1], layers_pattern="layers"),
                  dict(init_lora_weights=False, target_modules="all-linear",
                       loftq_config={}, megatron_core="megatron.core")):
    np.testing.assert_array_equal(_logits(from_pretrained(_edited_folder(tmp_path, **changes))),
                                  expected)


def test_optional_packages_fail_under_ci_and_skip_elsewhere():
  """The PEFT checks above cannot pass unseen in CI: a package missing there fails them."""
  assert optional.require_or_skip("json", {"CI": "true"}) is json
  for ci in ("true", "TRUE", "True"):
    with pytest.raises(pytest.fail.Exception, match="CI=true requires 'no_such_module_x'"):
      optional.require_or_skip("no_such_module_x", {"CI": ci})
  for environ in ({}, {"CI": "false"}, {"CI": ""}):
    with pytest.raises(pytest.skip.Exception, match="could not import 'no_such_module_x'"):
      optional.require_or_skip("no_such_module_x", environ)


def test_lora_presets_scale_the_learning_rate_after_model_presets():
  plain = grpo.get_config("").opt.learning_rate
  c = grpo.get_config("lora")
  assert (c.model.lora.rank, c.model.lora.alpha) == (32, 32.0)
  assert c.opt.learning_rate == pytest.approx(plain * schema.LORA_LR_SCALE)
  # The model preset's rate (1e-6) is the one scaled, wherever :lora stands.
  for arg in ("lora=8,qwen3_4b", "qwen3_4b,lora=8"):
    c = popo.get_config(arg)
    assert c.model.lora.rank == 8 and c.opt.learning_rate == pytest.approx(1e-5)


@pytest.mark.parametrize("field,value,message", [
    ("rank", -1, "must be an int >= 0"),
    ("alpha", 0.0, "must be > 0"),
    ("dropout", 0.05, "only 0 is supported"),
    ("targets", "(q_proj", "is not a regular expression"),
])
def test_invalid_lora_values_name_the_field(field, value, message):
  c = grpo.get_config("lora")
  c.model.lora[field] = value
  with pytest.raises(configuration.ConfigError, match=f"config.model.lora.{field}: .*{message}"):
    configuration.validate(c)


def test_targets_matching_nothing_fail_before_anything_is_written(tmp_path):
  c = grpo.get_config("smoke,lora=2")
  c.model.lora.targets = "no_such_layer"
  with pytest.raises(configuration.ConfigError, match="config.model.lora: .* matches none"):
    train.train_and_evaluate(c, os.fspath(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run")


@hypothesis.settings(max_examples=5, deadline=None)
@hypothesis.given(rank=st.integers(1, 200), alpha=st.floats(1e-3, 1e3),
                  targets=st.sampled_from([lora.DEFAULT_TARGETS, "q_proj", r"mlp\.",
                                           r"layers\.1\..*_proj$", "lm_head", "."]))
def test_any_accepted_lora_setting_builds_a_no_op_model(base_logits, rank, alpha, targets):
  """Every rank, alpha and target pattern the validator accepts gives a model (a rank above
  the layer's width included) that starts exactly at the base, with adapters that train:
  B's gradient is not zero."""
  model = _adapted(rank=rank, alpha=alpha, targets=targets)
  np.testing.assert_array_equal(_logits(model), base_logits)
  graphdef, params = nnx.split(model)
  adapters, base = lora.split(params)
  loss = lambda a: jnp.sum(nnx.merge(graphdef, lora.combine(a, base))(jnp.asarray(IDS)) ** 2)
  grads = jax.grad(loss)(adapters)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 0


def test_a_lora_run_exports_merged_and_as_an_adapter_folder(tmp_path):
  """``:lora`` trains the embedded model, checkpoints the adapters only and exports both
  formats, which load back to the same function; the wrong config is one line."""
  from grpo_jax import export  # pylint: disable=g-import-not-at-top
  c = popo.get_config("smoke,lora=4")
  # The resume test's overrides (tests/run/test_train.py), so the steps come from the cache.
  c.rl.reward_signal = c.rl.effective_signal = "score"
  c.eval.update(every=100, greedy=False)
  c.checkpoint.every = 2
  workdir = os.fspath(tmp_path / "run")
  train.train_and_evaluate(c, workdir)
  merged, adapter = os.fspath(tmp_path / "merged"), os.fspath(tmp_path / "adapter")
  assert export.export(c, workdir, merged) == 2
  assert export.export(c, workdir, adapter, "adapter") == 2
  assert sorted(os.listdir(adapter))[:2] == ["adapter_config.json", "adapter_model.safetensors"]
  ids = jnp.asarray(IDS % 1000)
  a, b = from_pretrained(merged)(ids), from_pretrained(adapter)(ids)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
  trained = from_pretrained(adapter)
  assert max(float(jnp.abs(site.factors()[1]).max())
             for site in lora.dense_layers(trained) if site.rank) > 0  # it trained
  with pytest.raises(CheckpointError, match="does not fit this config"):
    export.export(popo.get_config("smoke"), workdir, os.fspath(tmp_path / "x"))
  with pytest.raises(configuration.ConfigError, match="needs a LoRA run"):
    export.export(popo.get_config("smoke"), workdir, os.fspath(tmp_path / "x"), "adapter")
  # Export runs no attention: a run configured for an accelerator's kernel exports on any host.
  for kernel in ("cudnn", "splash"):
    c.model.attention = kernel
    assert export.export(c, workdir, os.fspath(tmp_path / kernel), "adapter") == 2
