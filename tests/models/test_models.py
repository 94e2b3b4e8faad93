"""Qwen3-family model: parity with transformers, checkpoint I/O, KV cache, errors; the model
family registry and from_pretrained's dispatch through it."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from grpo_jax import assets, registry, sharding
from grpo_jax.models import (FAMILIES, CheckpointError, KVCache, ModelConfig, Qwen3,
                             from_pretrained, positions_from_mask, save_pretrained)
from grpo_jax.models import family as family_lib
from grpo_jax.models import flash, qwen3
from grpo_jax.models.qwen3_checkpoint import hf_name
from tests import optional

TOL = 1e-4  # the bound on max |logits - transformers logits|


def _max_abs(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize("name", ["qwen3", "qwen2"])
def test_logits_match_transformers_golden(name, golden, request):
  model = request.getfixturevalue(f"tiny_{name}")
  logits = model(jnp.asarray(golden["input_ids"]))
  assert logits.dtype == jnp.float32
  assert logits.shape == golden[f"{name}_logits"].shape == (2, 12, 128)
  assert _max_abs(logits, golden[f"{name}_logits"]) <= TOL


def test_left_padded_logits_match_transformers_golden(tiny_qwen3, golden):
  mask = golden["padded_attention_mask"].astype(bool)
  logits = tiny_qwen3(jnp.asarray(golden["padded_input_ids"]), jnp.asarray(mask))
  # Only real positions are defined; row 0 has 4 pads, row 1 none.
  assert _max_abs(np.asarray(logits)[mask], golden["qwen3_padded_logits"][mask]) <= TOL


def test_left_padding_does_not_change_real_positions(tiny_qwen3):
  ids = jnp.asarray(np.random.RandomState(1).randint(0, 128, (1, 7)), jnp.int32)
  plain = tiny_qwen3(ids)
  padded_ids = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), ids], axis=1)
  mask = jnp.arange(10)[None] >= 3
  padded = tiny_qwen3(padded_ids, mask)
  assert _max_abs(padded[:, 3:], plain) <= 1e-5


def test_positions_from_mask():
  mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], bool)
  # Row 0: cumsum 0,0,1,2,3 minus 1 -> -1,-1,0,1,2, pads clipped to 0.
  np.testing.assert_array_equal(positions_from_mask(mask), [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])


def test_live_parity_with_torch(tmp_path, data_dir):
  torch = optional.require_or_skip("torch")
  import transformers
  ids = np.random.RandomState(7).randint(0, 128, (3, 9)).astype(np.int32)
  for name in ("tiny_qwen3", "tiny_qwen2"):
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        data_dir / name, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
      expected = ref(torch.from_numpy(ids).long()).logits.numpy()
    ours = from_pretrained(os.fspath(data_dir / name))
    assert _max_abs(ours(jnp.asarray(ids)), expected) <= TOL
    # Our writer must produce a folder transformers loads to the same function.
    save_pretrained(ours, os.fspath(tmp_path / name))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / name, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
      again = reloaded(torch.from_numpy(ids).long()).logits.numpy()
    assert _max_abs(again, expected) <= TOL


@pytest.mark.parametrize("shard", [None, 60_000])
def test_save_load_round_trip_is_exact(tiny_qwen3, tmp_path, shard):
  """Stacked parameters ([L, ...]) are written as one tensor per layer and read back from
  them, also when a parameter's layers lie in different files of a sharded folder."""
  assert tiny_qwen3.layers.mlp.up_proj.kernel.shape == (2, 64, 128)
  save_pretrained(tiny_qwen3, os.fspath(tmp_path), max_shard_bytes=shard)
  if shard:
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert len({index["weight_map"][f"model.layers.{i}.mlp.up_proj.weight"] for i in (0, 1)}) == 2
  loaded = from_pretrained(os.fspath(tmp_path))
  assert loaded.config == tiny_qwen3.config
  a = nnx.to_flat_state(nnx.state(tiny_qwen3, nnx.Param))
  b = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
  for path, var in a:
    np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(b[path][...]))


def test_saved_folder_has_transformers_names_and_config(tiny_qwen2, tmp_path, data_dir):
  import transformers
  from safetensors import safe_open
  save_pretrained(tiny_qwen2, os.fspath(tmp_path))
  with safe_open(os.fspath(tmp_path / "model.safetensors"), "numpy") as ours, \
       safe_open(os.fspath(data_dir / "tiny_qwen2" / "model.safetensors"), "numpy") as ref:
    assert set(ours.keys()) == set(ref.keys())
    for key in ref.keys():
      assert ours.get_tensor(key).shape == ref.get_tensor(key).shape
  cfg = transformers.AutoConfig.from_pretrained(tmp_path)
  assert cfg.model_type == "qwen2" and cfg.architectures == ["Qwen2ForCausalLM"]


def _sub_jaxprs(eqn):
  """The jaxprs inside an equation's parameters (scan, checkpoint, pjit, cond bodies)."""
  for param in eqn.params.values():
    for sub in param if isinstance(param, (list, tuple)) else (param,):
      if isinstance(sub, jax.extend.core.ClosedJaxpr):
        yield sub.jaxpr
      elif isinstance(sub, jax.extend.core.Jaxpr):
        yield sub


def _projections(jaxpr) -> int:
  """The 2-D matmuls (Dense layers and the LM head; attention's dots are batched) of a jaxpr,
  through its sub-jaxprs."""
  return sum((e.primitive.name == "dot_general" and e.outvars[0].aval.ndim == 2)
             + sum(_projections(sub) for sub in _sub_jaxprs(e)) for e in jaxpr.eqns)


def test_training_passes_scan_once_over_the_layers():
  """Without a cache the L layers are one ``scan`` of length L over the stacked parameters,
  whose body is one block (7 projections; in the grouped pass on prompts and continuations),
  checkpointed under remat; with a cache (the sampler's passes) they are unrolled."""
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  graphdef, params = nnx.split(Qwen3(cfg, rngs=nnx.Rngs(0)))
  ids, mask = jnp.zeros((2, 5), jnp.int32), jnp.ones((2, 5), bool)
  jaxpr = lambda fn: jax.make_jaxpr(lambda p: fn(nnx.merge(graphdef, p)))(params).jaxpr
  passes = {"hidden_states": (lambda m, remat: m.hidden_states(ids, mask, remat=remat), 7),
            "grouped": (lambda m, remat: m.grouped_hidden_states(ids[:1], mask[:1], ids, 2,
                                                                 remat=remat), 14)}
  for name, (fn, per_block) in passes.items():
    for remat in (False, True):
      top = jaxpr(lambda m: fn(m, remat))
      scans = [e for e in top.eqns if e.primitive.name == "scan"]
      assert len(scans) == 1 and scans[0].params["length"] == 3, name
      body = scans[0].params["jaxpr"].jaxpr
      assert _projections(top) == _projections(body) == per_block, name
      # The step is one jax.checkpoint (``remat2``) of the block: under remat it saves nothing
      # (only the step's inputs are kept), else the matmuls' outputs and the blocked kernels'
      # residuals (tests/models/test_memory_growth.py: without them, memory quadratic in T).
      assert [e.primitive.name for e in body.eqns] == ["remat2"], name
      policy = body.eqns[0].params["policy"]
      assert policy is (None if remat else qwen3.SCAN_POLICY), name
  x = jnp.ones((2, 3))
  saves = lambda fn: any(
      e.primitive.name in ("dot_general", "name") and qwen3.SCAN_POLICY(
          e.primitive, *[v.aval for v in e.invars], **e.params)
      for e in jax.make_jaxpr(fn)(x).jaxpr.eqns)
  assert saves(lambda x: x @ x.T)
  assert saves(lambda x: checkpoint_name(x, flash.RESIDUALS))
  assert not saves(lambda x: checkpoint_name(x, "other"))
  cached = jaxpr(lambda m: m.hidden_states(ids, mask, cache=m.init_cache(2, 8)))
  assert not any(e.primitive.name == "scan" for e in cached.eqns)
  assert _projections(cached) == 3 * 7


def test_hf_name_mapping():
  assert hf_name(("layers", 3, "self_attn", "q_proj", "kernel")) == (
      "model.layers.3.self_attn.q_proj.weight", True)
  assert hf_name(("layers", 0, "self_attn", "k_norm", "scale")) == (
      "model.layers.0.self_attn.k_norm.weight", False)
  assert hf_name(("embed_tokens", "embedding")) == ("model.embed_tokens.weight", False)
  assert hf_name(("lm_head", "kernel")) == ("lm_head.weight", True)


def test_kv_cached_decoding_matches_full_forward(tiny_qwen3):
  rng = np.random.RandomState(3)
  p, t = 6, 5
  ids = jnp.asarray(rng.randint(0, 128, (2, p + t)), jnp.int32)
  prompt_mask = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
  full_mask = jnp.concatenate([prompt_mask, jnp.ones((2, t), bool)], axis=1)
  full = tiny_qwen3(ids, full_mask)

  graphdef, params = nnx.split(tiny_qwen3)

  @jax.jit
  def run(params, tokens, mask, positions, cache):
    model = nnx.merge(graphdef, params)
    h, cache = model.hidden_states(tokens, mask, positions, cache)
    return model.logits(h[:, -1]), cache

  cache = KVCache.init(tiny_qwen3.config, 2, p + t)
  logits, cache = run(params, ids[:, :p], prompt_mask, positions_from_mask(prompt_mask), cache)
  step_logits = [logits]
  next_pos = prompt_mask.sum(-1)
  for i in range(t - 1):
    logits, cache = run(params, ids[:, p + i: p + i + 1], jnp.ones((2, 1), bool),
                        (next_pos + i)[:, None], cache)
    step_logits.append(logits)
  cached = jnp.stack(step_logits, axis=1)  # predictions for positions p-1 .. p+t-2
  assert int(cache.index) == p + t - 1
  assert _max_abs(cached, full[:, p - 1: p + t - 1]) <= 1e-5


def test_bfloat16_model_runs_and_tracks_float32(data_dir, golden, tiny_qwen3):
  bf16 = from_pretrained(os.fspath(data_dir / "tiny_qwen3"), param_dtype="bfloat16",
                         dtype="bfloat16")
  assert bf16.embed_tokens.embedding[...].dtype == jnp.bfloat16
  logits = bf16(jnp.asarray(golden["input_ids"]))
  assert logits.dtype == jnp.float32
  # bf16 keeps ~3 significant digits; logits are O(5), so errors of a few 0.1 are expected,
  # while a wiring bug gives errors of the logits' own size.
  ref = tiny_qwen3(jnp.asarray(golden["input_ids"]))
  assert _max_abs(logits, ref) < 0.5
  assert np.mean(np.argmax(logits, -1) == np.argmax(ref, -1)) > 0.9


def test_random_init_shapes_and_param_count():
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
  model = Qwen3(cfg, rngs=nnx.Rngs(0))
  counted = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  # embed 64*32=2048; per layer: q 32*32=1024, k 32*16=512, v 512, o 32*32=1024,
  # q/k norm 2*8=16, mlp 3*32*48=4608, two norms 64 -> 7760; 2 layers 15520;
  # final norm 32; lm_head 32*64=2048. Total 2048+15520+32+2048 = 19648.
  assert counted == cfg.num_params == 19648
  assert model(jnp.zeros((1, 4), jnp.int32)).shape == (1, 4, 64)


def test_missing_folder_and_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="not found"):
    from_pretrained(os.fspath(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match="config.json"):
    from_pretrained(os.fspath(tmp_path))


def test_unreadable_config_is_named(tmp_path, data_dir):
  shutil.copytree(data_dir / "tiny_qwen3", tmp_path / "m")
  (tmp_path / "m" / "config.json").write_text('{"model_type": "qwen3", ')  # torn
  with pytest.raises(CheckpointError, match=r"config.json is not readable JSON"):
    from_pretrained(os.fspath(tmp_path / "m"))
  (tmp_path / "m" / "config.json").write_text("[]")
  with pytest.raises(CheckpointError, match=r"config.json holds a list, not a JSON object"):
    from_pretrained(os.fspath(tmp_path / "m"))


def test_unsupported_architecture_is_named(tmp_path, data_dir):
  shutil.copytree(data_dir / "tiny_qwen2", tmp_path / "m")
  cfg = json.loads((tmp_path / "m" / "config.json").read_text())
  cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
  (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match="gpt2.*supported model types: qwen3, qwen2"):
    from_pretrained(os.fspath(tmp_path / "m"))


def test_missing_tensor_is_named(tmp_path, tiny_qwen2):
  from safetensors.numpy import load_file, save_file
  save_pretrained(tiny_qwen2, os.fspath(tmp_path))
  tensors = load_file(os.fspath(tmp_path / "model.safetensors"))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, os.fspath(tmp_path / "model.safetensors"))
  with pytest.raises(CheckpointError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj"):
    from_pretrained(os.fspath(tmp_path))


def test_misshaped_tensor_is_named(tmp_path, tiny_qwen2):
  """A stacked parameter is checked layer by layer: the message names that layer's tensor."""
  from safetensors.numpy import load_file, save_file
  save_pretrained(tiny_qwen2, os.fspath(tmp_path))
  tensors = load_file(os.fspath(tmp_path / "model.safetensors"))
  tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][1:]
  save_file(tensors, os.fspath(tmp_path / "model.safetensors"))
  with pytest.raises(CheckpointError, match=(r"tensor model\.layers\.1\.mlp\.up_proj\.weight in "
                                             r".* has shape \(64, 127\), expected \(64, 128\)")):
    from_pretrained(os.fspath(tmp_path))


def test_model_config_validation():
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=3,
                num_kv_heads=2, head_dim=4)
  with pytest.raises(ValueError, match="dtype"):
    ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                num_kv_heads=1, head_dim=4, dtype="int8")


def test_families_are_registered_by_model_type():
  assert {"qwen3", "qwen2"} <= set(FAMILIES.names())
  assert FAMILIES.get("qwen2") is FAMILIES.get("qwen3")  # one model, two config.json types
  cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=4)
  assert cfg.model_type == "qwen3" and cfg.replace(qk_norm=False).model_type == "qwen2"


def test_unknown_model_type_is_one_line_naming_the_known_ones(tmp_path, data_dir):
  shutil.copytree(data_dir / "tiny_qwen3", tmp_path / "m")
  cfg = json.loads((tmp_path / "m" / "config.json").read_text())
  cfg.update(model_type="no_such_family", architectures=["NoSuchForCausalLM"])
  (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError) as error:
    from_pretrained(os.fspath(tmp_path / "m"))
  message = str(error.value)
  assert "\n" not in message and "'no_such_family'" in message
  assert message.endswith("supported model types: " + ", ".join(FAMILIES.names()))


def _toy_family(built: list) -> family_lib.Family:
  """The qwen3 family under another model_type, recording each model it builds."""
  qwen3 = FAMILIES.get("qwen3")

  def config_from_hf(hf, **dtypes):
    return qwen3.config_from_hf({**hf, "model_type": "qwen3"}, **dtypes)

  def build(config, *, rngs):
    built.append(config)
    return qwen3.build(config, rngs=rngs)

  return dataclasses.replace(qwen3, config_from_hf=config_from_hf, build=build)


def test_a_registered_family_is_found_by_from_pretrained(tmp_path, data_dir, tiny_qwen3,
                                                         monkeypatch):
  built = []
  families = registry.Registry("model family")
  families.register("toy")(_toy_family(built))
  monkeypatch.setattr(family_lib, "FAMILIES", families)
  shutil.copytree(data_dir / "tiny_qwen3", tmp_path / "m")
  cfg = json.loads((tmp_path / "m" / "config.json").read_text())
  (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "toy"}))
  model = from_pretrained(os.fspath(tmp_path / "m"))
  assert built == [model.config] == [tiny_qwen3.config]
  ids = jnp.arange(12, dtype=jnp.int32)[None] % 128
  np.testing.assert_array_equal(model(ids), tiny_qwen3(ids))
  # The dispatch knows only what is registered: qwen3 is not, here.
  with pytest.raises(CheckpointError, match=r"model_type='qwen3'.*supported model types: toy$"):
    from_pretrained(os.fspath(data_dir / "tiny_qwen3"))
  assert family_lib.param_axes() == dict(FAMILIES.get("qwen3").param_axes)


@pytest.mark.parametrize("name", ["embedded", "tiny_qwen2"])
def test_qwen3_family_param_axes_cover_every_parameter(name, tiny_qwen2):
  """Every parameter (embedded Qwen3: q/k norm, tied; tiny Qwen2: q/k/v bias, LM head) has
  its logical axes in the family's table, one per dimension: none is replicated by omission."""
  model = from_pretrained(assets.EMBEDDED_MODEL) if name == "embedded" else tiny_qwen2
  axes = FAMILIES.get(model.config.model_type).param_axes
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    key = tuple(str(p) for p in path[-2:])
    assert key in axes, f"{'.'.join(map(str, path))} has no entry in the family's param_axes"
    assert len(axes[key]) == var[...].ndim, key
    assert sharding.param_logical_axes(path, var[...].ndim, axes) == axes[key]


def test_families_that_disagree_on_a_parameter_are_an_error(monkeypatch):
  qwen3 = FAMILIES.get("qwen3")
  other = dataclasses.replace(qwen3, param_axes={("q_proj", "kernel"): ("heads", "embed")})
  families = registry.Registry("model family")
  families.register("qwen3")(qwen3)
  families.register("other")(other)
  monkeypatch.setattr(family_lib, "FAMILIES", families)
  with pytest.raises(ValueError, match=r"'qwen3' and 'other' give parameter q_proj.kernel"):
    family_lib.param_axes()


@pytest.mark.parametrize("module", ["generate.logprobs", "generate.sampler", "sharding"])
def test_generic_modules_do_not_import_a_model_family(module):
  """They use the CausalLM interface (and the families' registry), never a family's module."""
  import ast
  import importlib
  source = open(importlib.import_module(f"grpo_jax.{module}").__file__).read()
  imported = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
  imported |= {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import)
               for a in n.names}
  assert not {m for m in imported if m and m.startswith("grpo_jax.models.qwen3")}
