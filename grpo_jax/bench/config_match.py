"""Whether a sweep's record still stands for its cell: the config it ran against today's.

A record stores the resolved config its run used (``config``: dotted path -> JSON value, the
package's own folder written ``<grpo_jax>``). It stands for its cell, so ``sweep`` counts the
cell done, when today's config of the cell is the same run (``changes`` is empty):

* a key in both has the same value in both (a changed default changes the value of every cell
  that relied on it, so those cells become stale);
* a key only today's config has (added to the package since the run) is at its default, the
  value ``grpo_jax.schema.base_config`` gives it: a new knob whose default keeps the
  old behaviour changes nothing; one that a method's file or the grid sets otherwise does;
* a key only the record has (removed since) was unset (None); any other removed key counts as
  a change (whether the code without it behaves as it did with that value, only a re-run
  tells: ``carry_over``).

Keys that moved into a group (``grpo_jax.deprecated.MOVED``: ``rl.clip_high`` is now
``rl.loss.ppo.clip_high``) are compared at their new place on both sides, as a resumed run's
saved config is (``deprecated.migrate_saved``); an old key left unset is no key at all.

Records written before records stored their config hold only ``config_hash``, the hash of the
whole resolved config (``whole_hash``): such a record stands while that hash is today's; a key
added since makes it stale, and ``rekey`` gives it the config its code commit resolved.

The rule compares configs, not code: a change of code that moves a run at the same config is
what a record's ``code`` commit and ``carry_over``'s re-runs are for.

``config_hash`` names a cell's choices: 12 hex digits of the entries that differ from the
defaults, so a key added at its default leaves it as it was. It names; it does not decide (a
changed default moves a cell's run but not its choices): the stored config decides.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from grpo_jax import deprecated

ABSENT = "<absent>"  # how ``changes`` shows the missing side of an added or removed key


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested config (its JSON form) as {dotted path: value}, every leaf once."""
  flat = {}
  for key, value in tree.items():
    if isinstance(value, dict) and value:
      flat.update(flatten(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def changes(recorded: dict[str, Any], now: dict[str, Any],
            defaults: dict[str, Any]) -> dict[str, list]:
  """What makes today's config ``now`` another run than the ``recorded`` one.

  Args:
    recorded: the flat config a record's run used.
    now: the cell's flat config today.
    defaults: today's flat base config (``grpo_jax.schema.base_config``).

  Returns:
    {path: [recorded value, today's value]} for every key by which the two runs differ (see
    the module docstring), ``ABSENT`` for a side without the key; empty when they are one run.
  """
  recorded, now = deprecated.migrate_saved(recorded), deprecated.migrate_saved(now)
  out = {}
  for key in sorted(set(recorded) | set(now)):
    if key in recorded and key in now:
      if recorded[key] != now[key]:
        out[key] = [recorded[key], now[key]]
    elif key in now:  # added since the run
      if key not in defaults or now[key] != defaults[key]:
        out[key] = [ABSENT, now[key]]
    elif recorded[key] is not None:  # removed since the run
      out[key] = [recorded[key], ABSENT]
  return out


def config_hash(now: dict[str, Any], defaults: dict[str, Any]) -> str:
  """12 hex digits of the cell's choices: the entries of ``now`` (moved keys at their new
  place) that differ from ``defaults``, an unset key the defaults lack being no choice."""
  chosen = {k: v for k, v in deprecated.migrate_saved(now).items()
            if (defaults[k] != v if k in defaults else v is not None)}
  return _digest(json.dumps(chosen, sort_keys=True))


def whole_hash(config_json: str) -> str:
  """12 hex digits of a whole config's JSON text: the hash records held before they stored
  their config (``config_hash`` of sweeps up to then)."""
  return _digest(config_json)


def _digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class Current:
  """A cell's config today, which its records are checked against.

  Attributes:
    config: the flat resolved config.
    defaults: the flat base config.
    whole: ``whole_hash`` of the resolved config (for records without a stored config).
  """
  config: dict[str, Any]
  defaults: dict[str, Any]
  whole: str

  @property
  def hash(self) -> str:
    return config_hash(self.config, self.defaults)

  def changes(self, rec: dict) -> dict[str, list] | None:
    """``changes`` from the record's stored config to today's; None for a record without one."""
    if "config" not in rec:
      return None
    return changes(rec["config"], self.config, self.defaults)

  def stands(self, rec: dict) -> bool:
    """Whether the record's run is of today's config (its status aside)."""
    found = self.changes(rec)
    return rec.get("config_hash") == self.whole if found is None else not found
