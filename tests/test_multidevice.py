"""Sharded == single-device, on 8 fake CPU devices (mesh data=2 x fsdp=2 x tensor=2).

The computations run in a fresh process (``tests/multidevice_checks.py``, which sets
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` before JAX starts), started in the
background as the run collects this module (``tests/run_once.py``); these tests judge the
numbers it reports. The embedded 1M-parameter model: V = 1088, D = 128, 4 heads and 2 KV
heads of 32, F = 384, tied embeddings.
"""

import json

import pytest

from tests import run_once

pytestmark = pytest.mark.slow  # one subprocess, ~1.5 CPU-minutes of compilation


@pytest.fixture(scope="module")
def report():
  """The checks' JSON report: their subprocess starts when the run collects this module
  (``conftest.pytest_collection_finish``, once per run), at the suite's -O0 but for the
  sampler comparison, which compiles at XLA's usual level (multidevice_checks.optimised: under
  -O0 one draw in the batch flips)."""
  folder = run_once.wait("multidevice", timeout=1200)
  with open(folder / "report.json", encoding="utf-8") as f:
    return json.load(f)


def test_runs_on_eight_devices(report):
  assert report["devices"] == 8


def test_sharded_load_reads_each_device_block_only(report):
  load = report["load"]
  # The same bytes read and cast the same way, block by block: exactly equal.
  assert load["max_abs_diff"] == 0.0
  specs = load["specs"]
  layers = "['layers']"  # stacked: the layer axis first, never split
  assert specs["['embed_tokens']['embedding'].value"] == "P('tensor', 'fsdp')"  # [V, D]
  assert specs[f"{layers}['self_attn']['q_proj']['kernel'].value"] == "P(None, 'fsdp', 'tensor')"
  assert specs[f"{layers}['self_attn']['k_proj']['kernel'].value"] == "P(None, 'fsdp', 'tensor')"
  assert specs[f"{layers}['self_attn']['o_proj']['kernel'].value"] == "P(None, 'tensor', 'fsdp')"
  assert specs[f"{layers}['mlp']['down_proj']['kernel'].value"] == "P(None, 'tensor', 'fsdp')"
  assert specs[f"{layers}['self_attn']['q_norm']['scale'].value"] == "P(None, None)"
  # Every device's shard is a quarter of each layer's 2-D weight (fsdp=2 x tensor=2; replicated
  # over data=2): q_proj [L=4, D=128, H*Dh=128] -> [4, 64, 64]; embedding [1088, 128] ->
  # [544, 64].
  shards = load["shard_shapes"]
  assert shards[f"{layers}['self_attn']['q_proj']['kernel'].value"] == [[4, 64, 64]] * 8
  assert shards["['embed_tokens']['embedding'].value"] == [[544, 64]] * 8
  # What was read from the files: one block of each layer's tensor per device, each exactly
  # that layer's part of the device's shard (Hugging Face stores q_proj as [out, in], read as
  # the transposed block); every 2-D weight is split 4 ways, so no read of one is more than a
  # quarter of it.
  reads = load["reads"]
  blocks = lambda name: reads[name]["blocks"]
  assert blocks("model.layers.0.self_attn.q_proj.weight") == [[64, 64]] * 8
  assert blocks("model.layers.0.mlp.up_proj.weight") == [[192, 64]] * 8  # [F/2, D/2]
  assert blocks("model.embed_tokens.weight") == [[544, 64]] * 8
  # Norms are replicated: read whole, once (JAX asks once for a fully replicated array).
  assert blocks("model.layers.0.input_layernorm.weight") == [[128]]
  matrices = {name: r for name, r in reads.items() if len(r["shape"]) == 2}
  assert len(matrices) == 1 + 4 * 7  # embedding + 7 weights in each of 4 layers
  for name, r in matrices.items():
    assert all(a * b * 4 == r["shape"][0] * r["shape"][1] for a, b in r["blocks"]), name


def test_sampler_output_is_identical_sharded_and_unsharded(report):
  s = report["sampler"]
  assert s["generated"] > 0
  assert s["tokens_equal"] and s["mask_equal"]
  # Same tokens drawn from the same uniforms; the log-probs differ only by the rounding of
  # the tensor-split matmuls' partial sums (float32: a few ulps of values around -1 to -10).
  assert s["logp_max_abs_diff"] <= 1e-5
  assert s["tokens_spec"] == "P()"  # replicated: every process can read every completion
  assert s["cache_size"] == 1  # two calls, other prompts, same shapes: one compilation


@pytest.mark.parametrize("method", ["grpo", "popo"])
def test_sharded_train_step_equals_single_device(report, method):
  r = report[method]
  assert r["state_step"] == 2
  # Two steps of SGD(0.003, momentum 0.9): the parameters moved by ~3e-3, and the sharded run
  # ends within 1e-5 of the single-device one (measured: 1 ulp of values near 1).
  assert r["params_moved"] > 1e-3
  assert r["params_max_abs_diff"] <= 1e-5
  # Every metric (loss, grad norm, ratios, drift, replay statistics) within 1e-5 relative.
  worst = max(r["metrics_rel_diff"], key=r["metrics_rel_diff"].get)
  assert r["metrics_rel_diff"][worst] <= 1e-5, worst
  # Stored rows are copies, their frozen advantages group statistics of 0/1 successes.
  assert r["replay_max_abs_diff"] <= 1e-6
  assert r["cache_size"] == 1  # the second step reused the first step's executable


def test_sharded_lora_step_equals_single_device(report):
  """LoRA under the (2, 2, 2) mesh: two SGD steps with a KL term to the base (adapters off)."""
  r = report["lora"]
  assert r["state_step"] == 2
  assert r["base_max_abs_diff"] == 0.0  # the base weights are never updated
  assert r["adapters_moved"] > 1e-4  # the adapters are (measured: ~3e-3)
  assert r["params_max_abs_diff"] <= 1e-5  # sharded == single device, as for full training
  worst = max(r["metrics_rel_diff"], key=r["metrics_rel_diff"].get)
  assert r["metrics_rel_diff"][worst] <= 1e-5, worst
  assert r["metrics_sharded"][0]["kl_ref"] > 0  # the reference is not the adapted policy
  # The adapters and their momentum are replicated; the base keeps its FSDP x tensor layout.
  replicated = lambda spec: set(spec.removeprefix("P(").rstrip(")").replace(",", " ").split()) <= {
      "None"}
  lora_specs = {k: v for k, v in r["param_specs"].items() if "lora" in k}
  factors = [k for k in lora_specs if "lora_a" in k or "lora_b" in k]
  assert len(factors) == 14  # 7 stacked projections x (A [L, in, r], B [L, r, out])
  assert all(map(replicated, lora_specs.values()))  # the factors and their scales
  assert not all(replicated(v) for k, v in r["param_specs"].items() if "lora" not in k)
  assert all("lora" in k for k in r["opt_state_specs"])  # optimiser state of adapters only
  assert r["cache_size"] == 1


def test_popo_replayed_under_the_mesh(report):
  # Step 2's group 0 is constant ([1, 1, 1, 1]): POPO refills that slot with one of the two
  # effective groups stored at step 1, i.e. G = 4 replayed rows.
  second = report["popo"]["metrics_sharded"][1]
  assert second["replay_rows"] == 4.0
  assert second["replay_slots_filled"] == 1.0


@pytest.mark.parametrize("method", ["grpo", "popo"])
def test_state_and_buffer_layouts(report, method):
  r = report[method]
  params, opt = r["param_specs"], r["opt_state_specs"]
  # The momentum trace follows its parameter's layout, path by path.
  for path, spec in opt.items():
    param_path = path[path.index("]") + 1:].replace(".trace", "", 1)
    assert params[param_path] == spec, path
  assert len(opt) == len(params)
  if method == "popo":
    replay = r["replay_specs"]
    # Entries [C, ...] split like the batch; scalars (write position, count) replicated.
    assert replay[".rollouts.completion_ids"] == "P(('data', 'fsdp'),)"
    assert replay[".valid"] == "P(('data', 'fsdp'),)"
    assert replay[".write_pos"] == "P()"


def test_checkpoint_restores_exactly_onto_another_mesh_and_one_device(report):
  r = report["restore"]
  assert r["nonzero_leaves"] > r["leaves"] // 2  # a real state, not zeros
  # Restoring copies bytes: exact, onto (data=1, fsdp=2, tensor=4) and onto one device.
  assert r["other_mesh_max_abs_diff"] == 0.0
  assert r["one_device_max_abs_diff"] == 0.0
  assert r["other_mesh_specs_match_template"]
  assert r["restored_mesh_shapes"] == ["{'data': 1, 'fsdp': 2, 'tensor': 4}"]
  assert r["one_device_devices"] == 1
  assert r["host"] == {"data_position": 4}


def test_partial_rollouts_pool_sharded_equals_one_device(report):
  """The slot pool split over the batch axes (data x fsdp = 4 shards of 8 slots) draws the
  same groups as on one device, its last step after a checkpoint round trip (the state back
  on the mesh, the cache rebuilt): the same tags in the same order, tokens, versions and
  lengths bit for bit, log-probs to float32 rounding (measured 5.5e-6), and the same counts;
  its rows stay split, the cache's key/value heads over tensor."""
  pool = report["pool"]
  assert pool["tags"][0] == pool["tags"][1] and len(pool["tags"][0]) == 3
  assert pool["tokens_equal"] and pool["counts_equal"]
  assert pool["logp_max_abs_diff"] < 1e-5
  spec = pool["specs"]
  rows, heads = "P(('data', 'fsdp')", "P(('data', 'fsdp'), 'tensor'"
  assert all(spec[f].startswith(rows) for f in (".tokens", ".live", ".cache.index", ".key"))
  assert spec[".cache.k[0]"].startswith(heads) and spec[".cache.v[3]"].startswith(heads)


def test_packed_update_under_the_mesh(report):
  """POPO with ``rl.packing=tokens`` on the (2, 2, 2) mesh: each of the 4 batch shards packs its
  own rows (a minibatch of 4 rows is one row a device). Two SGD steps end where one device's
  packed run and the mesh's padded run end (measured: 1 ulp, 1.2e-7), with every metric but the
  layouts' useful fractions within 1e-5 relative; replayed rows in step 2."""
  r = report["popo_packed"]
  assert r["state_step"] == 2 and r["cache_size"] == 1
  assert r["params_moved"] > 1e-3
  assert r["params_max_abs_diff"] <= 1e-5  # vs one device, packed
  assert r["vs_padded_params_max_abs_diff"] <= 1e-5  # vs the mesh, padded
  layout = lambda name: name.endswith("useful_fraction")  # the passes' fractions differ
  for name, diff in r["metrics_rel_diff"].items():
    assert layout(name) or diff <= 1e-5, name
  for packed, padded in zip(r["metrics_sharded"], r["padded_metrics_sharded"]):
    for name, value in padded.items():
      if not layout(name):
        assert abs(packed[name] - value) <= 1e-5 * max(1.0, abs(value)), name
  assert r["metrics_sharded"][1]["replay_rows"] == 4.0
  # Step 1 updates the 8 fresh rows, one per device in each minibatch: a device's packed row
  # holds its one row (its prompt, its completion) and nothing else, so the pass computes 8
  # packed rows of C = P + T = 20 slots for the rows' real tokens (measured: 152, 0.95). Packed
  # across the devices instead, the 4 rows of a group would share their prompt.
  first = r["metrics_sharded"][0]["update_useful_fraction"]
  assert first == pytest.approx(r["fresh_real_tokens"][0] / (8 * r["capacity"]))
