"""A sweep's grid: methods x settings x seeds, read from a Python file, and each cell's config.

A grid file is like a config file: ``get_grid(arg) -> dict`` (``arg`` the text after ':' in
``--grid=configs/sweeps/movement.py:smoke``), with the keys

    name          the grid's name (default: the file's stem)
    methods       {label: "config[:presets]"}: configs/<config>.py with its presets, e.g.
                  {"grpo": "grpo", "popo-pi_old": "popo:pi_old", "replay": "rollout_replay:paper"}
    seeds         [0, 1, 2]
    more_seeds    {label: [3, 4]}: more seeds for some methods only, e.g. where a difference is
                  within two standard errors at the common seeds; every such seed must also be
                  the baseline's (its own ``more_seeds``), so each run is paired
    budget        one of {"steps": S}, {"rollouts": R} (stop once R rollouts were *generated*),
                  {"tokens": N} (once N completion tokens were generated)
    evaluations   held-out evaluations over the budget besides the one at the start (default 4)
    presets       presets added to every method's, e.g. "countdown_hard,pool=1024" (default "")
    overrides     {"config.path": value} set in every cell, e.g. {"eval.num_prompts": 1024}
    axes          {"config.path": [values]}: every method runs at every combination
    method_axes   {label: {"config.path": [values]}}: a method's own axes (e.g. Headroom-Drift's
                  tau), crossed with ``axes`` for that method only; in the summary each own
                  value is a row of its own ("headroom [tau=0.001]") paired with the
                  baseline at the same shared setting (so not the baseline's or a target's)
    baseline      the label gains are measured against (default "grpo", or the first method)
    targets       more labels whose final accuracy the summary measures every method's
                  rollouts to, e.g. ["dapo"] (default none)
    plot          {"x": axis path, "panels": axis path or None, "x_measured": a summary column
                  of the baseline to put on the x axis instead of the axis value (e.g.
                  "ineffective_fraction" for a difficulty axis)}; default: the first two axes

Cells are ordered seed-major (every setting and method at the first seed, then the next), so a
sweep stopped half way has the whole map at fewer seeds rather than part of it at all of them.
A config path that does not exist, or a value the validator refuses, fails here in one line,
before any cell runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import os
from typing import Any

import ml_collections

from grpo_jax import configuration, schema
from grpo_jax.bench import config_match
from grpo_jax.schema import files

BUDGETS = ("steps", "rollouts", "tokens")
_KEYS = {"name", "methods", "seeds", "more_seeds", "budget", "evaluations", "presets", "overrides", "axes",
         "method_axes", "baseline", "targets", "plot"}


class GridError(ValueError):
  """A grid file that cannot be run, with the reason in one line."""


@dataclasses.dataclass(frozen=True)
class Cell:
  """One run of a sweep: a method at one setting of the axes and one seed."""
  method: str
  setting: tuple[tuple[str, Any], ...]  # (config path, value) of every axis, in grid order
  seed: int

  @property
  def id(self) -> str:
    """A file-name-safe id, e.g. ``popo-pi_old__opt.learning_rate=0.0001__seed1``."""
    parts = [self.method] + [f"{path}={value_text(v)}" for path, v in self.setting]
    return "__".join(parts + [f"seed{self.seed}"]).replace("/", "_").replace(" ", "")

  @property
  def setting_key(self) -> str:
    """The setting alone (no method, no seed): the cells compared with each other."""
    return ",".join(f"{path}={value_text(v)}" for path, v in self.setting) or "(defaults)"


@dataclasses.dataclass(frozen=True)
class Grid:
  """A parsed grid file (see the module docstring for the fields)."""
  name: str
  methods: dict[str, str]
  seeds: tuple[int, ...]
  budget: tuple[str, int]
  evaluations: int
  presets: str
  overrides: dict[str, Any]
  axes: dict[str, tuple]
  method_axes: dict[str, dict[str, tuple]]
  baseline: str
  plot: dict[str, Any]
  targets: tuple[str, ...] = ()
  more_seeds: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

  def seeds_of(self, method: str) -> tuple[int, ...]:
    """The seeds ``method`` runs at: the grid's, then its ``more_seeds``."""
    return self.seeds + tuple(s for s in self.more_seeds.get(method, ()) if s not in self.seeds)

  def cells(self) -> list[Cell]:
    """Every cell, seed-major, then setting, then method (the order they run in); the
    ``more_seeds`` come after the grid's seeds."""
    out = []
    for seed in dict.fromkeys(s for m in self.methods for s in self.seeds_of(m)):
      for values in _product(self.axes):
        for method in self.methods:
          if seed not in self.seeds_of(method):
            continue
          for own in _product(self.method_axes.get(method, {})):
            out.append(Cell(method, tuple(values) + tuple(own), seed))
    return out

  def compared_as(self, method: str, setting: dict[str, Any]) -> tuple[str, str]:
    """(setting key, label) a finished cell of ``method`` at ``setting`` is summarised under.

    The key holds the shared ``axes`` only, so a method's own-axis cells are paired with the
    baseline's run of the same shared setting and seed; the label is the method with its own
    axes' values, e.g. ``("(defaults)", "headroom [tau=0.001]")``. Without own axes both are
    the cell's own (``Cell.setting_key``, the method).
    """
    own = self.method_axes.get(method, {})
    key = Cell(method, tuple((p, v) for p, v in setting.items() if p not in own), 0).setting_key
    if not own:
      return key, method
    tails = [p.rsplit(".", 1)[-1] for p in own]
    names = tails if len(set(tails)) == len(tails) else list(own)
    return key, f"{method} [" + ",".join(f"{n}={value_text(setting[p])}"
                                         for n, p in zip(names, own)) + "]"

  def config(self, cell: Cell) -> ml_collections.ConfigDict:
    """The cell's full config: the method's file and presets, the budget, the overrides, the
    setting, the seed."""
    name, _, presets = self.methods[cell.method].partition(":")
    module = files.module(name)
    arg = ",".join(filter(None, [presets.replace("+", ","), self.presets]))
    c = module.get_config(arg or None)
    per_step = c.rollout.batch_prompts * c.rollout.group_size
    kind, amount = self.budget
    every = max(1, amount // self.evaluations)
    c.log_every = 1  # each evaluation's token count is read from the step record before it
    if kind == "steps":
      c.total_steps, c.eval.every = amount, every
    else:
      # Every step generates at least B x G rollouts (and a token per rollout): the budget,
      # not total_steps, ends the run.
      c.total_steps = -(-amount // per_step)
      c.eval.every = c.total_steps
      if kind == "rollouts":
        c.total_rollouts, c.eval.every_rollouts = amount, every
      else:
        c.total_tokens, c.eval.every_tokens = amount, every
    # A checkpoint at about every evaluation: an interrupted cell resumes from the last one.
    c.checkpoint.every = max(1, c.total_steps // self.evaluations)
    for path, value in list(self.overrides.items()) + list(cell.setting):
      _set(c, path, value, f"{cell.method} ({self.methods[cell.method]})")
    c.seed = cell.seed
    return c

  def current(self, cell: Cell) -> config_match.Current:
    """The cell's config today, which its records are checked against (``config_match``)."""
    text = config_json(self.config(cell))
    return config_match.Current(config_match.flatten(json.loads(text)), defaults(),
                                config_match.whole_hash(text))

  def config_hash(self, cell: Cell) -> str:
    """12 hex digits of the cell's choices: its resolved config's entries that differ from
    the defaults (``config_match.config_hash``)."""
    return self.current(cell).hash


def config_json(c: ml_collections.ConfigDict) -> str:
  """``c`` as JSON with the package's own folder written as ``<grpo_jax>``: the embedded
  model's path is absolute, and the same cell run from another checkout (a git worktree, a
  clone elsewhere) is the same config."""
  return c.to_json(sort_keys=True).replace(_PACKAGE, "<grpo_jax>")


def flat_config(c: ml_collections.ConfigDict) -> dict[str, Any]:
  """``c`` as {dotted path: JSON value}, as a record stores the config its run used."""
  return config_match.flatten(json.loads(config_json(c)))


def defaults() -> dict[str, Any]:
  """Today's base config (``grpo_jax.schema.base_config``), flat: the value a key added to the package
  since a record was written must have for the record to stand."""
  return flat_config(schema.base_config())


def config_hash(c: ml_collections.ConfigDict) -> str:
  """12 hex digits of the entries of ``c`` that differ from ``defaults()``."""
  return config_match.config_hash(flat_config(c), defaults())


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../grpo_jax


def select(grid: Grid, only: list[str]) -> list[Cell]:
  """The grid's cells (in run order) that match every ``KEY=V1,V2`` in ``only``.

  ``KEY`` is ``seed``, ``method`` or an axis path; a cell matches when its value is one of
  the listed ones (numbers compare as numbers: ``2e-4`` matches ``0.0002``). E.g.
  ``["seed=1", "opt.learning_rate=1e-4,2e-4"]``: seed 1 at the two larger learning rates.

  Raises:
    GridError: a term without ``=``, or a key that is not seed, method or an axis.
  """
  paths = set(grid.axes) | {p for axes in grid.method_axes.values() for p in axes}
  terms = []
  for term in only:
    key, sep, values = term.partition("=")
    key = key.strip()
    if not sep or not values.strip():
      raise GridError(f"--only {term!r}: write KEY=V1,V2 (KEY: seed, method or an axis)")
    if key not in paths | {"seed", "method"}:
      raise GridError(f"--only {term!r}: {key!r} is not seed, method or an axis of the grid "
                      f"({', '.join(sorted(paths)) or 'none'})")
    terms.append((key, [v.strip() for v in values.split(",")]))

  def same(value: Any, text: str) -> bool:
    if value_text(value) == text or str(value) == text:
      return True
    try:
      return isinstance(value, (int, float)) and float(text) == float(value)
    except ValueError:
      return False

  def matches(cell: Cell) -> bool:
    setting = dict(cell.setting)
    for key, texts in terms:
      if key not in ("seed", "method") and key not in setting:
        return False  # an axis of another method's cells
      value = {"seed": cell.seed, "method": cell.method}.get(key, setting.get(key))
      if not any(same(value, t) for t in texts):
        return False
    return True

  return [c for c in grid.cells() if matches(c)]


def load(spec: str) -> Grid:
  """Reads ``path/to/grid.py[:arg]`` and checks every cell's config.

  Raises:
    GridError: no such file, no ``get_grid``, a ValueError from it (an unknown variant), an
      unknown or missing key, a bad budget, an
      unknown config file, preset or config path, or a cell config the validator refuses.
  """
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise GridError(f"no such grid file: {path}")
  module_spec = importlib.util.spec_from_file_location("_grpo_jax_grid", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_grid"):
    raise GridError(f"{path}: a grid file defines get_grid(arg) -> dict")
  try:
    raw = module.get_grid(arg or None)
  except ValueError as e:  # a grid file's own check, e.g. an unknown variant after ':'
    raise GridError(f"{path}: {e}") from None
  unknown = set(raw) - _KEYS
  if unknown:
    raise GridError(f"{path}: unknown grid key(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
  for key in ("methods", "seeds", "budget"):
    if not raw.get(key):
      raise GridError(f"{path}: the grid needs {key!r}")
  budget = dict(raw["budget"])
  if len(budget) != 1 or next(iter(budget)) not in BUDGETS:
    raise GridError(f"{path}: budget is one of {{'steps': S}}, {{'rollouts': R}}, "
                    f"{{'tokens': N}}, got {raw['budget']!r}")
  kind, amount = next(iter(budget.items()))
  evaluations = int(raw.get("evaluations", 4))
  if not isinstance(amount, int) or amount < 1 or evaluations < 1:
    raise GridError(f"{path}: the budget and the evaluations must be positive integers")
  methods = dict(raw["methods"])
  method_axes = {m: {p: tuple(v) for p, v in axes.items()}
                 for m, axes in dict(raw.get("method_axes", {})).items()}
  for m in method_axes:
    if m not in methods:
      raise GridError(f"{path}: method_axes names {m!r}, not one of the methods {list(methods)}")
  axes = {p: tuple(v) for p, v in dict(raw.get("axes", {})).items()}
  for p, values in list(axes.items()) + [x for a in method_axes.values() for x in a.items()]:
    if not values:
      raise GridError(f"{path}: axis {p!r} has no values")
  baseline = raw.get("baseline", "grpo" if "grpo" in methods else next(iter(methods)))
  if baseline not in methods:
    raise GridError(f"{path}: the baseline {baseline!r} is not one of the methods")
  targets = tuple(raw.get("targets", ()))
  for m in targets:
    if m not in methods:
      raise GridError(f"{path}: targets names {m!r}, not one of the methods {list(methods)}")
  for m in (baseline,) + targets:
    if m in method_axes:
      raise GridError(f"{path}: {m!r} is the baseline or a target and has method_axes: each "
                      "setting needs one run of it to compare against (give it no own axes)")
  more_seeds = {m: tuple(int(x) for x in seeds)
                for m, seeds in dict(raw.get("more_seeds", {})).items()}
  for m, seeds in more_seeds.items():
    if m not in methods:
      raise GridError(f"{path}: more_seeds names {m!r}, not one of the methods {list(methods)}")
    unpaired = sorted(set(seeds) - {int(x) for x in raw["seeds"]}
                      - set(more_seeds.get(baseline, ())))
    if unpaired and m != baseline:
      raise GridError(f"{path}: more_seeds gives {m!r} seeds {unpaired} that the baseline "
                      f"{baseline!r} does not run: add them to more_seeds[{baseline!r}]")
  names = list(axes)
  plot = {"x": names[0] if names else None, "panels": names[1] if len(names) > 1 else None,
          "x_measured": None, **dict(raw.get("plot", {}))}
  grid = Grid(name=raw.get("name", os.path.splitext(os.path.basename(path))[0]),
              methods=methods, seeds=tuple(int(s) for s in raw["seeds"]),
              budget=(kind, amount), evaluations=evaluations,
              presets=raw.get("presets", ""), overrides=dict(raw.get("overrides", {})),
              axes=axes, method_axes=method_axes, baseline=baseline, plot=plot,
              targets=targets, more_seeds=more_seeds)
  for cell in grid.cells():
    try:
      configuration.validate(grid.config(cell))
    except (configuration.ConfigError, ValueError, FileNotFoundError) as e:
      if isinstance(e, GridError):
        raise
      raise GridError(f"{path}: cell {cell.id}: {e}") from None
  return grid


def _set(c: ml_collections.ConfigDict, path: str, value: Any, where: str) -> None:
  """c.<path> = value for an existing field; an unknown path is a GridError."""
  *parents, leaf = path.split(".")
  node = c
  for part in parents:
    if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
      raise GridError(f"{where}: no config group {path.rsplit('.', 1)[0]!r} (in {path!r})")
    node = node[part]
  if leaf not in node:
    raise GridError(f"{where}: no config field {path!r}; the fields are in grpo_jax/schema/defaults.py")
  try:
    node[leaf] = value
  except TypeError as e:  # ml_collections refuses a value of another type than the field's
    raise GridError(f"{where}: {path}={value!r}: {e}") from None


def _product(axes: dict[str, tuple]) -> list[list[tuple[str, Any]]]:
  """Every combination of the axes' values, as [(path, value), ...] lists, in axis order."""
  return [list(zip(axes, values)) for values in itertools.product(*axes.values())]


def value_text(value: Any) -> str:
  """A value as it appears in cell ids, tables and figures (floats in their shortest form)."""
  return repr(value) if isinstance(value, float) else json.dumps(value).strip('"')
