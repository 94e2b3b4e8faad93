"""Config keys that moved: accepted under their old names for one release, then retired.

A moved key (``ALIASES``) stays in ``base_config`` as an unset (None) field for one release;
``apply`` moves one that was set to its new key, for the method, rule, selector or policy loss
the config selects, prints a one-line notice and unsets it. After its release a key is
retired (``RETIRED``): no longer a field, and a config that still sets it (a config file's
``c.replay.slots = 4``; on the command line ``train.parse_flags`` says the same) is refused in
one line naming its new key. ``migrate_saved`` moves both kinds in a saved run's config.json
before a resume or a benchmark record compares it, so a run written before any move still
resumes and a recorded cell still counts. Which keys moved, and when: docs/CHANGELOG.md.
"""

from __future__ import annotations

import sys

import ml_collections

from grpo_jax import errors

# old key -> (type, new key); {method} is config.replay.method, {selector} the selector,
# {loss} the policy loss (config.rl.loss.policy).
# Moved in December 2026 (issue 58: pi_prox's four keys, from three groups into the one
# prox_plan.py plans from); accepted, with a notice, for this release.
ALIASES = {
    "rl.prox_pass": (str, "prox.rows"),
    "replay.prox": (str, "prox.estimate"),
    "replay.prox_chunks": (int, "prox.chunks"),
    "rollout.correction": (str, "prox.continued"),
}
# Retired: moved into their components' groups (task, replay and allocation in November 2026,
# the policy loss's in early December 2026), accepted for a release each, now refused.
RETIRED = {
    **{f"task.{k}": (int, f"task.countdown.{k}")
       for k in ("num_numbers", "min_number", "max_number", "min_target", "max_target")},
    "task.template": (str, "task.countdown.template"),
    "task.data_seed": (int, "task.countdown.seed"),
    "task.tfds_data_dir": (str, "task.gsm8k.data_dir"),
    **{f"replay.{k}": (str, f"replay.popo.{k}") for k in ("fill", "priority", "unfilled")},
    "replay.staleness": (int, "replay.popo.staleness"),
    "replay.insert": (str, "replay.{method}.insert"),
    "replay.slots": (int, "replay.{method}.slots"),
    "replay.max_uses": (int, "replay.{method}.max_uses"),
    "replay.max_age": (int, "replay.{method}.max_age"),
    **{f"replay.{k}": (float, f"replay.prioritized.{k}") for k in ("rho", "alpha")},
    "replay.warmup_steps": (int, "replay.prioritized.warmup_steps"),
    "replay.age_unit": (str, "replay.prioritized.age_unit"),
    "replay.drop_ineffective": (bool, "replay.prioritized.drop_ineffective"),
    "replay.candidates": (int, "replay.headroom.candidates"),
    "replay.drift_tau": (float, "replay.headroom.tau"),
    "replay.gate": (bool, "replay.headroom.gate"),
    "replay.order": (str, "replay.headroom.order"),
    "allocation.probes": (int, "allocation.sara.probes"),
    **{f"allocation.{k}": (float, f"allocation.sara.{k}")
       for k in ("tau_lo", "tau_hi", "alpha0", "beta0")},
    "allocation.oversample": (int, "allocation.dynamic_sampling.oversample"),
    "allocation.candidates_ratio": (int, "allocation.{selector}.candidates_ratio"),
    "allocation.decay": (float, "allocation.{selector}.decay"),
    **{f"rl.{k}": (float, f"rl.loss.{{loss}}.{k}") for k in ("clip_low", "clip_high", "dual_clip")},
    **{f"rl.{k}": (kind, f"rl.loss.{k}") for k, kind in (
        ("is_mode", str), ("is_cap", float), ("aggregation", str), ("norm_constant", float),
        ("kl_coef", float), ("kl_estimator", str), ("entropy_coef", float))},
}
MOVED = {**RETIRED, **ALIASES}  # every move a saved config may predate
# The key that selects the component whose group a templated alias moves to.
_SELECTOR = {"method": "replay.method", "selector": "allocation.selector",
             "loss": "rl.loss.policy"}
# A method's new name for a key of the old flat group.
_RENAMED = {("prioritized", "max_age"): "tau_max"}
# Old keys by name, for ``current``.
_OLD_KEYS = {old.split(".")[1] for old in ALIASES}
# Old replay.method values (retired: a saved config's is read as its new name).
METHOD_NAMES = {"rollout": "prioritized"}


def add_fields(config: ml_collections.ConfigDict) -> None:
  """Adds every old key as an unset field of its type (so ``--config.replay.slots=4`` parses)."""
  for old, (kind, _) in ALIASES.items():
    group, key = old.split(".")
    if group in config:
      config[group][key] = ml_collections.FieldReference(None, field_type=kind)


def current(group) -> dict:
  """A group's keys without its old names (unset once ``apply`` has moved them): what a
  component's ``from_group`` reads."""
  return {k: v for k, v in group.items() if not (k in _OLD_KEYS and v is None)}


def _notice(text: str) -> None:
  print(f"grpo_jax: {text}", file=sys.stderr, flush=True)


def _get(config, path: str):
  """The value at a dotted ``path`` of a ConfigDict (None where any part is missing)."""
  for key in path.split("."):
    if not hasattr(config, "keys") or key not in config:
      return None
    config = config[key]
  return config


def _new_key(template: str, selected: dict) -> str:
  """An alias's new key, its template filled with the selected components' names."""
  *parents, name = template.format(**selected).split(".")
  return ".".join((*parents, _RENAMED.get((parents[-1], name), name)))


def migrate_saved(flat: dict) -> dict:
  """A saved run's flat config (``{"rl.clip_high": 0.28, ...}``) with the old keys that held a
  value moved to their new ones, as ``apply`` moves them in a live config: a workdir written
  before a key moved compares equal to the same run configured with the new key."""
  out = dict(flat)
  selected = {name: flat.get(path) or "" for name, path in _SELECTOR.items()}
  selected["method"] = METHOD_NAMES.get(selected["method"], selected["method"])
  if out.get("replay.method") in METHOD_NAMES:
    out["replay.method"] = selected["method"]
  selected["loss"] = selected["loss"] or "ppo"  # before the policy losses, every loss was PPO
  for old, (_, template) in MOVED.items():
    if out.get(old) is None:
      out.pop(old, None)
      continue
    out[_new_key(template, selected)] = out.pop(old)
  return out


def retired(path: str, config=None) -> str | None:
  """The one-line refusal of a retired key (``"replay.slots"``, or ``"config.replay.slots"``),
  naming its new key for the components ``config`` selects (all of them when None); None when
  ``path`` is no retired key."""
  path = path.removeprefix("config.")
  if path not in RETIRED:
    return None
  template = RETIRED[path][1]
  new = "config." + template.format(method="<method>", selector="<selector>", loss="<loss>")
  if config is not None:  # the key of the selected component, where it has one
    selected = {name: _get(config, where) or "" for name, where in _SELECTOR.items()}
    if _get(config, _new_key(template, selected)) is not None:
      new = f"config.{_new_key(template, selected)}"
  return (f"config.{path}: moved to {new}, its old name retired (docs/CHANGELOG.md): set the "
          "new key")


def apply(config) -> None:
  """Moves every old key that was set to its new key (in place), with a one-line notice each.

  Raises:
    ConfigError: a retired key is set, or the old key has no meaning for the selected
      component (``prox``'s keys always have one).
  """
  if "replay" in config and config.replay.method in METHOD_NAMES:
    errors.check(False, "replay.method", f"{config.replay.method!r} was renamed "
                 f"{METHOD_NAMES[config.replay.method]!r} and its old name retired")
  for old in RETIRED:
    group, key = old.split(".")
    if group in config and config[group].get(key) is not None:
      raise errors.ConfigError(retired(old, config))
  selected = {name: _get(config, path) or "" for name, path in _SELECTOR.items()}
  for old, (_, template) in ALIASES.items():
    group, key = old.split(".")
    if group not in config or config[group].get(key) is None:
      continue
    new = _new_key(template, selected)
    *parents, name = new.split(".")
    parent = _get(config, ".".join(parents))
    if parent is None or name not in parent:
      by = next((f"{path}={value!r}" for value, (_, path) in zip(
          selected.values(), _SELECTOR.items()) if f".{value}." in f".{'.'.join(parents)}."),
                "the selected component")
      errors.check(False, old, f"deprecated, and {by} has no {name!r} (see {group}.* in "
                   "grpo_jax/schema/defaults.py)")
    _notice(f"config.{old} is deprecated: use config.{new} (applied)")
    parent[name] = config[group][key]
    config[group][key] = None
