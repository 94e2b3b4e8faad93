"""The regime study's difficulty axis: every method at its paper defaults on Countdown with
numbers up to 50, 70 and 100, against the share of groups that carry no signal.

    python -m grpo_jax.bench.sweep --grid=configs/sweeps/difficulty.py \
        --out=docs/results/regime/difficulty --workdirs=runs/regime/difficulty --detach

Every method on the same finite pool of 1,024 training problems (``pool=1024``: MoPPS and DPS
need prompts that come back; ~3 epochs) and the same budget of 25,600 *generated* rollouts
(allocation methods spend theirs differently per step), 4 evaluations on the same 1,024
held-out prompts per difficulty, 3 seeds. The figure puts each method's gain over GRPO against
GRPO's measured ineffective-group fraction at that difficulty. GRPO, POPO and DAPO, the
methods of the POPO paper's headline claim (DAPO's accuracy with ~30% of its rollouts), run
two more seeds (3 and 4): at three seeds POPO's gain over GRPO was within two of the
evaluation's standard errors at every difficulty. 99 + 18 = 117 cells.

``:tuned`` is the same at the movement grid's best setting instead of the defaults: lr 1e-4
with 4 updates per batch (``configs/sweeps/movement.py``), chosen as the setting with the
highest held-out mean@8 averaged over that grid's 8 methods at its three seeds (0.415; the
defaults, lr 3e-5 with 4 updates, 0.369). It is also the best setting of 5 of those 8 methods
and the second-best of 2 (GRPO's fourth: 0.403 against its best, 0.417 at lr 2e-4). GRPO,
the replay methods (with POPO's coupled objective, align_mu, which that grid found best at the
higher learning rates) and the allocation methods, whose defaults lose on update count: at a
learning rate where each update moves further, fewer updates may cost less. Dr. GRPO and RLOO
are left out (within 0.5 points of GRPO at every difficulty at the defaults: with 8-token
completions their length terms barely differ from GRPO's). Its results go to their own folder
(grid name ``difficulty_tuned``). 10 methods x 3 x 3 = 90 cells.

    python -m grpo_jax.bench.sweep --grid=configs/sweeps/difficulty.py:tuned \
        --out=docs/results/regime/difficulty_tuned --workdirs=runs/regime/difficulty_tuned

``:tuned_selection`` is the tuned grid's prompt-selection rows with their baseline on the code as
it stands: GRPO, GRPO + MoPPS and GRPO + DPS, 27 cells with the tuned grid's configs (the same
hashes). The tuned grid's records were made on 4 December 2026; re-runs of them on later code
follow the recorded run bit for bit for 25 to 78 steps and then part by float rounding (a
sampled token flips), so its seed-0-only rows are completed here as a grid of one code, its
GRPO run again beside them, rather than mixed into the older records. Grid name
``difficulty_tuned_selection``.

    python -m grpo_jax.bench.sweep --grid=configs/sweeps/difficulty.py:tuned_selection \
        --out=docs/results/regime/difficulty_tuned_selection \
        --workdirs=runs/regime/difficulty_tuned_selection

``:x4`` is the model-size axis (the rollout-replay paper: the gain grows with model size):
GRPO, POPO and rollout replay at the defaults, on a model ~3.7x the embedded one, warm-started
to the same accuracy target by ``configs/sft.py:x4`` (build it first; it is not shipped).
Grid name ``difficulty_x4``; its cells have the default grid's ids, so the two sizes pair
cell by cell. 27 cells.

    python -m grpo_jax.sft --config=configs/sft.py:x4
    python -m grpo_jax.bench.sweep --grid=configs/sweeps/difficulty.py:x4 \
        --out=docs/results/regime/difficulty_x4 --workdirs=runs/regime/difficulty_x4

``:x4_updates`` is the x4 grid's control for rollout replay's loss: GRPO with one update per
batch (``:paper``'s update count) beside GRPO's 4 and rollout replay, at numbers to 50, 3
seeds, gains measured against the one-update GRPO (so rollout replay's gain is its replay's
alone, at equal update count). Its GRPO and rollout-replay cells have the x4 grid's configs
(the same hashes): copy their records into its ``cells/`` and only the 3 one-update cells run.
Grid name ``difficulty_x4_updates``.

    cp docs/results/regime/difficulty_x4/cells/{grpo,rollout_replay}__*max_number=50__* \
        docs/results/regime/difficulty_x4_updates/cells/
    python -m grpo_jax.bench.sweep --grid=configs/sweeps/difficulty.py:x4_updates \
        --out=docs/results/regime/difficulty_x4_updates --workdirs=runs/regime/difficulty_x4

``:x16_updates`` is the same control on the x16 model (its GRPO and rollout-replay cells are
the x16 grid's):

    cp docs/results/regime/difficulty_x16/cells/{grpo,rollout_replay}__* \
        docs/results/regime/difficulty_x16_updates/cells/
    python -m grpo_jax.bench.sweep --grid=configs/sweeps/difficulty.py:x16_updates \
        --out=docs/results/regime/difficulty_x16_updates --workdirs=runs/regime/difficulty_x16

``:x16`` is the third size, ~14x the embedded model (``configs/sft.py:x16``), at fewer cells:
the same three methods at numbers to 50 only, 3 seeds (9 cells). Numbers to 50 because it is
where accuracy is far from the floor (GRPO ~0.36; at numbers to 100 it is ~0.06, and every
gain there is under a point at both smaller sizes) and where the gains moved most between the
first two sizes; the third size asks whether that movement goes on. Grid name
``difficulty_x16``; its cells pair with both smaller grids by id.

    python -m grpo_jax.sft --config=configs/sft.py:x16
    python -m grpo_jax.bench.sweep --grid=configs/sweeps/difficulty.py:x16 \
        --out=docs/results/regime/difficulty_x16 --workdirs=runs/regime/difficulty_x16
"""

import os

from grpo_jax.schema import files

sft = files.module("sft")  # configs/sft.py, found from any working directory


def get_grid(arg=None):
  if arg not in (None, "tuned", "tuned_selection", "x4", "x4_updates", "x16", "x16_updates"):
    raise ValueError(f"difficulty grid: unknown variant {arg!r} (expected none, 'tuned', "
                     "'tuned_selection', 'x4', 'x4_updates', 'x16' or 'x16_updates')")
  tuned = arg in ("tuned", "tuned_selection")
  methods = {"grpo": "grpo", "drgrpo": "drgrpo", "rloo": "rloo", "dapo": "dapo",
             "popo": "popo", "rollout_replay": "rollout_replay:paper",
             "headroom": "headroom", "sara": "sara", "sara-dps": "sara:dps",
             "grpo-mopps": "grpo:mopps", "grpo-dps": "grpo:dps"}
  overrides = {"eval.num_prompts": 1024}
  if tuned:
    methods = {k: v for k, v in methods.items() if k not in ("drgrpo", "rloo")}
    methods["popo-align_mu"] = "popo:align_mu"
    overrides.update({"opt.learning_rate": 1e-4, "rl.num_minibatches": 4})
  if arg == "tuned_selection":
    methods = {k: methods[k] for k in ("grpo", "grpo-mopps", "grpo-dps")}
  numbers = [50, 70, 100]
  if arg in ("x4", "x4_updates", "x16", "x16_updates"):
    size = arg.split("_")[0]
    model = sft.X16_MODEL if size == "x16" else sft.X4_MODEL
    if not os.path.isfile(os.path.join(model, "config.json")):
      raise ValueError(f"the {arg} variant trains {model}, which is not built yet: "
                       f"python -m grpo_jax.sft --config=configs/sft.py:{size}")
    methods = {k: methods[k] for k in ("grpo", "popo", "rollout_replay")}
    if arg.endswith("_updates"):
      methods = {"grpo": "grpo", "grpo-1update": "grpo:minibatches=1",
                 "rollout_replay": methods["rollout_replay"]}
    overrides["model.path"] = model
    numbers = numbers if arg == "x4" else [50]
  default = arg is None
  return dict(
      name="difficulty" if default else f"difficulty_{arg}",
      baseline="grpo-1update" if arg and arg.endswith("_updates") else "grpo",
      targets=["dapo"] if "dapo" in methods else [],  # POPO: DAPO's accuracy, ~30% of its rollouts
      methods=methods,
      seeds=[0, 1, 2], presets="pool=1024",
      more_seeds={m: [3, 4] for m in ("grpo", "popo", "dapo")} if default else {},
      budget={"rollouts": 25600}, evaluations=4,
      overrides=overrides,
      axes={"task.countdown.max_number": numbers},
      plot={"x": "task.countdown.max_number", "panels": None,
            "x_measured": "ineffective_fraction"})
