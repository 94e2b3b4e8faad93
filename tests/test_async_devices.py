"""Generation on its own devices, on 8 fake CPU devices: the first 4 generate (a data 2 x
tensor 2 mesh), the other 4 train (data 2 x fsdp 2).

The runs happen in a fresh process (``tests/async_checks.py``), started in the background as
the run collects this module (``tests/run_once.py``); these tests judge what it reports. The
smoke config: 2 prompts x 2 rollouts a step, T = 8, the embedded model.
"""

import json

import pytest

from tests import run_once

pytestmark = pytest.mark.slow  # one subprocess, ~2 CPU-minutes


@pytest.fixture(scope="module")
def report():
  folder = run_once.wait("async", timeout=1200)
  with open(folder / "report.json", encoding="utf-8") as f:
    return json.load(f)


@pytest.mark.parametrize("layout", ["other_shape", "same_shape"])
def test_parameters_reach_the_generation_mesh_device_to_device_only(report, layout):
  sent = report["transfer"][layout]
  # Float32 parameters cast to float32 and copied: exactly equal, on the generation devices
  # 0-3, each leaf in the generation mesh's own layout.
  assert sent["max_abs_diff"] == 0.0 and sent["layouts_match"]
  assert sent["devices"] == [0, 1, 2, 3]
  # The copy is a device-to-device transfer (forbidding those stops it) and no host transfer
  # is allowed on the way (host parameters are refused, not copied in).
  assert "Disallowed device-to-device transfer" in sent["device_to_device_guard"]
  assert "Disallowed host-to-device transfer" in sent["host_guard"]


def test_under_lora_only_the_adapters_are_sent(report):
  t = report["transfer"]
  # Embedded model, rank-4 adapters on its 7 dense projections (q, k, v, o, gate, up, down;
  # stacked over layers): an A and a B each = 14 leaves of the 34 the state holds.
  assert t["lora_leaves"] == 14 and t["sent_leaves"] == 14 and t["all_leaves"] == 34


@pytest.mark.parametrize("run", ["grpo_lockstep", "popo_free"])
def test_each_side_keeps_to_its_devices_and_the_bound_holds(report, run):
  bound = {"grpo_lockstep": 1, "popo_free": 2}[run]
  for part in ("straight", "resumed"):
    r = report[run][part]
    assert r["state_devices"] == [4, 5, 6, 7]
    assert r["generator_devices"] == [0, 1, 2, 3] and r["pool_devices"] == [0, 1, 2, 3]
    steps = r["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["rollout/staleness_max"] <= bound for s in steps)
  if run == "grpo_lockstep":
    # Every step after the first trains tokens drawn while the previous update ran (2 chunks
    # of each, at staleness 1); how much the free schedule draws then depends on timing.
    assert all(s["rollout/staleness_max"] == 1 for s in report[run]["straight"]["steps"][1:])
  # Four updates, four parameter sets received; the resumed run received its last two.
  assert report[run]["straight"]["transfers"] == 4 and report[run]["resumed"]["transfers"] == 2


def test_lockstep_resume_is_bit_for_bit_and_free_resume_loses_nothing(report):
  lock = report["grpo_lockstep"]
  assert lock["state_max_abs_diff"] == 0.0
  keys = ("rollouts", "completion_tokens", "alloc/groups_discarded", "rollout/staleness_max",
          "rollout/generator_version")
  assert ([[s[k] for k in keys] for s in lock["straight"]["steps"]]
          == [[s[k] for k in keys] for s in lock["resumed"]["steps"]])
  free = report["popo_free"]
  # Free-running with the default keep cache: the resumed rows attend to keys rebuilt under
  # the resumed parameters, so the state is close, not equal; the counts continue where the
  # checkpoint left them (every rollout counted once: 4 a step) and rows stayed in flight.
  assert [s["rollouts"] for s in free["resumed"]["steps"]] == [4, 8, 12, 16]
  assert free["straight"]["steps"][1]["alloc/rows_in_flight"] > 0
  assert free["state_max_abs_diff"] < 0.05


def test_sara_runs_asynchronously(report):
  steps = report["sara_free"]["steps"]
  assert [s["step"] for s in steps] == [1, 2, 3]
  assert all(s["rollout/staleness_max"] <= 1 for s in steps)
  assert report["sara_free"]["generator_devices"] == [0, 1, 2, 3]
  # G = 4 from 2 probes, committed groups asking for 2 more rows under a lead of one step:
  # groups complete and are trained (a lead counted in rows held their rows back: nothing).
  assert sum(s["alloc/rollouts_in_update"] for s in steps) > 0


@pytest.mark.parametrize("run,part", [("grpo_lockstep", "straight"), ("grpo_lockstep", "resumed"),
                                      ("popo_free", "straight"), ("popo_free", "resumed"),
                                      ("sara_free", None)])
def test_the_run_counts_what_the_producer_generated(report, run, part):
  # Every rollout the producer spent (trained, discarded or dropped by SARA) and every token it
  # decoded, in the update's overlap too, is in the run's counters by the last step: the
  # counters the budgets, evaluations and sample-efficiency curves read. The per-step
  # discards and drops add up to the producer's.
  r = report[run] if part is None else report[run][part]
  last, made = r["steps"][-1], r["producer"]
  assert last["rollouts"] == made["rollouts"]
  assert last["completion_tokens"] == made["completion_tokens"]
  assert sum(s["alloc/groups_discarded"] for s in r["steps"]) == made["groups_discarded"]
  if run == "sara_free":
    assert sum(s["alloc/groups_dropped"] for s in r["steps"]) == made["groups_dropped"]


def test_every_accepted_setting_runs_and_every_refusal_is_one_line(report):
  # Drawn device counts, both meshes' layouts, schedules, chunks, staleness, pool sizes, cache
  # and correction (``async_checks.fuzz``; run once with ASYNC_FUZZ=40 locally).
  for case in report["fuzz"]:
    if "refused" in case:
      assert "\n" not in case["refused"] and case["refused"].startswith("config."), case
    else:
      assert case["steps"] == 2 and case["staleness_max"] <= case["knobs"]["max_staleness"], case
  assert any("refused" not in case for case in report["fuzz"])  # some settings ran


def test_the_bench_measures_both_sides(report):
  row = report["bench"]
  assert row["mode"] == "async 4 lockstep ahead 1" and row["steps"] == 2
  for key in ("step_s", "generator_busy_s", "trainer_busy_s", "transfer_s"):
    assert row[key] > 0, key
  assert 0 < row["generator_busy_fraction"] and 0 < row["trainer_busy_fraction"]
  assert 0 < row["staleness_mean"] <= 1
