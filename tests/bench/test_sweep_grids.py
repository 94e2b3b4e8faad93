"""The regime study's shipped grids: each loads (``grid.load`` validates every cell's config)
and holds the cells its docstring counts, so a typo in a grid fails here rather than hours
into a sweep."""

import os

import pytest

from configs import sft
from grpo_jax import assets
from grpo_jax.bench import grid

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Expected counts, worked out from each file (methods x settings x seeds):
#   movement:  8 methods x lr {3e-5, 1e-4, 2e-4} x updates {1, 4, 8} x 3 seeds = 216
#   :quick     8 x lr {3e-5, 2e-4} x updates {1, 8} x 3                        = 96
#   difficulty: 11 methods x max_number {50, 70, 100} x 3 seeds
#               + GRPO, POPO, DAPO x 3 x 2 more seeds = 99 + 18                 = 117
#   :tuned     10 methods (the 11 but Dr. GRPO and RLOO, plus POPO align_mu) x 3 x 3   = 90
#   :tuned_selection  GRPO, GRPO + MoPPS, GRPO + DPS x 3 x 3                       = 27
#   knobs: GRPO 1 + Headroom tau 4 + headroom-only 1 + drift-only tau 4
#          + POPO reuse 4 x capacity 2 + POPO age 16: reuse 2 x capacity 2
#          + rho 3 x tau_max 3 + DAPO 2 + SARA tau_lo 3
#          = 1 + 4 + 1 + 4 + 8 + 4 + 9 + 2 + 3 = 36 settings x 3 seeds          = 108
#   partial: GRPO, POPO + staleness {1, 2, 4} x {naive, decoupled} = 8 x 3 seeds   = 24
#   partial_fast: GRPO + staleness {2, 4} x {naive, decoupled} = 5 x 3 seeds      = 15
GRIDS = {
    "configs/sweeps/movement.py": ("movement", 216),
    "configs/sweeps/movement.py:quick": ("movement", 96),
    "configs/sweeps/difficulty.py": ("difficulty", 117),
    "configs/sweeps/difficulty.py:tuned": ("difficulty_tuned", 90),
    "configs/sweeps/difficulty.py:tuned_selection": ("difficulty_tuned_selection", 27),
    "configs/sweeps/knobs.py": ("knobs", 108),
    "configs/sweeps/partial.py": ("partial", 24),
    "configs/sweeps/partial_fast.py": ("partial_fast", 15),
}


@pytest.mark.parametrize("path", sorted(GRIDS))
def test_a_shipped_grid_has_its_cells_and_each_one_validates(path):
  name, count = GRIDS[path]
  g = grid.load(path)
  assert g.name == name
  cells = g.cells()
  assert len(cells) == count
  assert len({c.id for c in cells}) == count  # ids name result files: no two cells share one


def test_the_tuned_difficulty_grid_runs_at_the_movement_grids_chosen_setting():
  default, tuned = grid.load("configs/sweeps/difficulty.py"), grid.load(
      "configs/sweeps/difficulty.py:tuned")
  cell = tuned.cells()[0]
  c = tuned.config(cell)
  assert (c.opt.learning_rate, c.rl.num_minibatches) == (1e-4, 4)
  # The same cell id in the default grid keeps the defaults (lr 3e-5, 4 updates): the two
  # grids differ only in the training setting, so their gains read side by side.
  d = default.config(cell)
  assert (d.opt.learning_rate, d.rl.num_minibatches) == (3e-5, 4)
  assert d.task.countdown.max_number == c.task.countdown.max_number


def test_the_tuned_selection_grid_is_the_tuned_grids_cells_hash_for_hash():
  # Its records pair with the tuned grid's by id and config: only the methods are fewer.
  tuned, selection = grid.load("configs/sweeps/difficulty.py:tuned"), grid.load(
      "configs/sweeps/difficulty.py:tuned_selection")
  hashes = {c.id: tuned.config_hash(c) for c in tuned.cells()}
  assert {c.method for c in selection.cells()} == {"grpo", "grpo-mopps", "grpo-dps"}
  assert all(selection.config_hash(c) == hashes[c.id] for c in selection.cells())


@pytest.mark.parametrize("spec", ["configs/sweeps/difficulty.py:hard",
                                  "configs/sweeps/movement.py:quik"])
def test_an_unknown_grid_variant_is_one_grid_error(spec):
  # One line for the CLI (sweep.main prints GridError's text), not a traceback from the file.
  with pytest.raises(grid.GridError, match=r"unknown variant '(hard|quik)'"):
    grid.load(spec)


@pytest.mark.parametrize("variant,model,cells,last", [
    # GRPO, POPO, rollout replay x max_number {50, 70, 100} x 3 seeds = 27
    ("x4", sft.X4_MODEL, 27, "rollout_replay__task.countdown.max_number=100__seed2"),
    # the same three at max_number 50 only: 3 x 1 x 3 = 9
    ("x16", sft.X16_MODEL, 9, "rollout_replay__task.countdown.max_number=50__seed2"),
    # GRPO with 4 and with 1 update per batch, rollout replay, at max_number 50: 3 x 1 x 3 = 9
    ("x4_updates", sft.X4_MODEL, 9, "rollout_replay__task.countdown.max_number=50__seed2"),
    ("x16_updates", sft.X16_MODEL, 9, "rollout_replay__task.countdown.max_number=50__seed2")])
def test_the_model_size_variants_need_their_model_and_then_pair_with_the_default_grid(
    tmp_path, monkeypatch, variant, model, cells, last):
  # Run from an empty folder: the model's folder (runs/models/...) is relative to it.
  spec = os.path.join(ROOT, "configs/sweeps/difficulty.py") + f":{variant}"
  monkeypatch.chdir(tmp_path)
  size = variant.split("_")[0]
  with pytest.raises(grid.GridError, match=r"not built yet: python -m grpo_jax.sft "
                                           rf"--config=configs/sft.py:{size}$"):
    grid.load(spec)
  # Any Hugging Face folder passes the check; the embedded model stands in for the real one.
  (tmp_path / "runs" / "models").mkdir(parents=True)
  os.symlink(assets.EMBEDDED_MODEL, tmp_path / model)
  g = grid.load(spec)
  assert g.name == f"difficulty_{variant}" and len(g.cells()) == cells
  default = grid.load(os.path.join(ROOT, "configs/sweeps/difficulty.py"))
  assert g.cells()[-1].id == last
  assert all(g.config(c).model.path == model for c in g.cells())
  # the sizes pair cell by cell: every GRPO cell is the default grid's on another model
  ids = {c.id: c for c in default.cells()}
  grpo = [c for c in g.cells() if c.method == "grpo"]
  assert grpo and all(c.id in ids for c in grpo)
  assert default.config(ids[grpo[0].id]).model.path == assets.EMBEDDED_MODEL
  if variant.endswith("_updates"):  # its GRPO and replay cells are its size's, hash for hash
    sized = grid.load(spec.replace("_updates", ""))
    shared = [c for c in g.cells() if c.method != "grpo-1update"]
    assert {c.method for c in shared} == {"grpo", "rollout_replay"}
    assert {g.config_hash(c) for c in shared} <= {sized.config_hash(c) for c in sized.cells()}
    # gains against the one-update GRPO: rollout replay's is its replay's at equal updates
    one = g.config([c for c in g.cells() if c.method == "grpo-1update"][0])
    assert g.baseline == "grpo-1update"
    assert (one.rl.num_minibatches, g.config(grpo[0]).rl.num_minibatches) == (1, 4)


def test_the_partial_grids_cells_are_the_corrections_they_name():
  """naive cells train continued rows with the clipped pi_theta / mu, decoupled ones correct
  them (``decoupled_all``'s pass over every row, or the default's over the continued ones)."""
  from grpo_jax import configuration  # pylint: disable=g-import-not-at-top
  for path in ("configs/sweeps/partial.py", "configs/sweeps/partial_fast.py"):
    g = grid.load(path)
    for cell in g.cells():
      c = g.config(cell)
      if cell.method == "grpo":
        assert not c.rollout.partial
      elif cell.method.endswith("-naive"):
        assert c.prox.continued == "naive" and configuration.prox_pass(c) == "replayed"
      elif cell.method.endswith("-decoupled"):
        assert c.prox.continued == "decoupled" or configuration.prox_pass(c) == "all"
  fast = grid.load("configs/sweeps/partial_fast.py")
  c = fast.config(fast.cells()[0])
  assert (c.opt.learning_rate, c.rl.num_minibatches) == (2e-4, 8)


# Every committed sweep folder (docs/results) with the grid that wrote it and the cells of it
# done today, worked out from docs/benchmarks.md: every recorded cell, except partial's 9
# naive cells (staleness 1, 2, 4 x 3 seeds), which ran before the naive correction had a key (now prox.continued) and
# which the grid now sets to naive, off its default (decoupled): not the run they recorded by
# config alone (config_match); difficulty_tuned has 78 of its 90 cells.
COMMITTED = {
    "regime/movement": ("configs/sweeps/movement.py", 216),
    "regime/difficulty": ("configs/sweeps/difficulty.py", 117),
    "regime/difficulty_tuned": ("configs/sweeps/difficulty.py:tuned", 78),
    "regime/difficulty_tuned_selection": ("configs/sweeps/difficulty.py:tuned_selection", 27),
    "regime/knobs": ("configs/sweeps/knobs.py", 108),
    "regime/difficulty_x4": ("configs/sweeps/difficulty.py:x4", 27),
    "regime/difficulty_x4_updates": ("configs/sweeps/difficulty.py:x4_updates", 9),
    "regime/difficulty_x16": ("configs/sweeps/difficulty.py:x16", 9),
    "regime/difficulty_x16_updates": ("configs/sweeps/difficulty.py:x16_updates", 9),
    "partial": ("configs/sweeps/partial.py", 24 - 9),
    "partial_fast": ("configs/sweeps/partial_fast.py", 15),
    "asynchronous": ("configs/sweeps/asynchronous.py", 27),
}


@pytest.mark.parametrize("folder", sorted(COMMITTED))
def test_the_committed_cells_are_done_and_stay_done_when_a_key_is_added_at_its_default(
    tmp_path, monkeypatch, folder):
  import ml_collections  # pylint: disable=g-import-not-at-top
  from grpo_jax import schema  # pylint: disable=g-import-not-at-top
  from grpo_jax.bench import sweep  # pylint: disable=g-import-not-at-top
  spec, count = COMMITTED[folder]
  monkeypatch.chdir(tmp_path)  # the size variants' models, as above
  (tmp_path / "runs" / "models").mkdir(parents=True)
  for model in (sft.X4_MODEL, sft.X16_MODEL):
    os.symlink(assets.EMBEDDED_MODEL, tmp_path / model)
  g, out = grid.load(os.path.join(ROOT, spec)), os.path.join(ROOT, "docs", "results", folder)
  done = lambda: {c.id for c in g.cells() if sweep.finished(out, g, c)}
  ids = done()
  assert len(ids) == count and ids <= {f[:-len(".json")] for f in os.listdir(f"{out}/cells")}
  if folder == "partial":
    assert all("-naive__" in c.id for c in g.cells() if c.id not in ids)
  base = schema.base_config

  def edited(edit):
    def config():
      c = base()
      edit(c)
      return c
    return config

  def add(c):  # a knob, one in a group, a new group: each at its default
    c.new_knob = 0
    c.rollout.new_knob = 0.5
    c.new_group = ml_collections.ConfigDict({"width": 3})

  monkeypatch.setattr(schema, "base_config", edited(add))
  assert done() == ids
  # a default every cell relied on, changed: none is done
  monkeypatch.setattr(schema, "base_config", edited(lambda c: setattr(c.opt, "b2", 0.99)))
  assert not done()
