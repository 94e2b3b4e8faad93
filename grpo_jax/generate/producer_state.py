"""The partial-rollout producer's checkpoint: its pool rows, the groups collecting rows and the
ready groups as JSON plus NumPy arrays, and back onto the device(s) they came from.

``producer_state`` / ``load_producer`` are ``generate.producer.Producer.state_dict`` /
``load_state_dict``; the checkpoint (``run.checkpoint``) writes the arrays as arrays. The KV
cache is never saved: the producer rebuilds it from the restored rows. The data types
(``Prompt``, ``Row``, ``OpenGroup``, ``Group``, ``Counts``) are ``generate.producer_types``'; in
the JSON a prompt and a row are lists in their fields' order.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from grpo_jax.generate.producer_types import Counts, Group, OpenGroup, Prompt, Row

# The pool's per-slot fields a checkpoint keeps (everything but the KV cache).
POOL_FIELDS = ("prompt_ids", "prompt_mask", "tokens", "logp", "versions", "length", "live",
               "done", "ended", "key", "stop_at", "ticket")
# A harvested row: (tokens, logp, versions, length, ended).
ROW_DTYPES = (np.int32, np.float32, np.int32, np.int32, bool)
# A complete group's arrays (``partial.Group``'s fields but its tag).
GROUP_DTYPES = {"prompt_ids": np.int32, "prompt_mask": bool, "tokens": np.int32,
                "logp": np.float32, "versions": np.int32, "lengths": np.int32, "ended": bool}


def pool_arrays(pool) -> dict[str, np.ndarray]:
  """The pool's saved fields on the host."""
  return {f: np.asarray(getattr(pool, f)) for f in POOL_FIELDS}


def restore_pool(pool, saved: dict):
  """``pool`` with the saved fields, each on the device(s) and layout of the one it replaces."""
  return pool.replace(**{f: jax.device_put(np.asarray(saved[f], getattr(pool, f).dtype),
                                           getattr(pool, f).sharding) for f in POOL_FIELDS})


def prompt_json(prompt: Prompt) -> list:
  return [np.asarray(x).tolist() if isinstance(x, (np.ndarray, np.generic)) else x
          for x in prompt]


def prompt_from_json(values: list) -> Prompt:
  tag, ids, mask, stop, key = values
  return Prompt(tag, np.asarray(ids, np.int32), np.asarray(mask, bool),
                None if stop is None else np.asarray(stop, np.int32), np.asarray(key, np.uint32))


def groups_json(groups: dict[int, OpenGroup]) -> dict:
  """The groups collecting rows: their prompt, harvested rows, rows admitted, oldest version."""
  return {str(k): {"prompt": prompt_json(v.prompt),
                   "rows": {str(g): [np.asarray(a) for a in r] for g, r in v.rows.items()},
                   "admitted": v.admitted, "oldest": v.oldest}
          for k, v in groups.items()}


def groups_from_json(saved: dict, pool: dict, g: int, version: int) -> dict[int, OpenGroup]:
  """``groups_json``'s inverse. ``pool``: the saved pool fields; ``g``: rows per group.

  A checkpoint written before groups recorded ``admitted`` and ``oldest`` held whole groups
  admitted at once: ``oldest`` is then the first version of any of its rows, harvested or
  still in the pool (``version`` where it has none).
  """
  oldest = np.asarray(pool["versions"])[:, 0]
  tickets = np.asarray(pool["ticket"])

  def group(k: int, v: dict) -> OpenGroup:
    rows = {int(i): Row(*(np.asarray(a, d) for a, d in zip(r, ROW_DTYPES)))
            for i, r in v["rows"].items()}
    if "oldest" not in v:
      live = oldest[tickets // g == k]
      firsts = [int(r.versions[0]) for r in rows.values()] + [int(x) for x in live]
      v = {**v, "admitted": g, "oldest": min(firsts, default=version)}
    return OpenGroup(prompt_from_json(v["prompt"]), rows=rows, admitted=int(v["admitted"]),
                     oldest=int(v["oldest"]))

  return {int(k): group(int(k), v) for k, v in saved.items()}


def ready_arrays(saved: dict) -> dict[str, np.ndarray]:
  """A saved complete group's arrays (all of ``partial.Group`` but its tag)."""
  return {k: np.asarray(saved[k], d) for k, d in GROUP_DTYPES.items()}


def producer_state(producer) -> dict:
  """Everything a ``Producer`` holds in flight: the pool's rows (not its KV cache), the groups
  collecting rows, the rule's requests, the ready queue, the version and the counts."""
  ready = [{f.name: getattr(g, f.name) for f in dataclasses.fields(Group)}
           for g in producer.ready]
  # pylint: disable=protected-access
  return {"version": producer.version, "horizon": producer.horizon,
          "serial": producer._serial, "admitted": producer._admitted,
          "counts": vars(producer.counts), "pool": pool_arrays(producer.pool),
          "groups": groups_json(producer._groups), "ready": ready,
          "pending": [list(x) for x in producer._pending]}


def load_producer(producer, state: dict) -> None:
  """Restores ``producer_state``'s rows into ``producer`` (built with the same settings). Its
  cache is marked stale: the next ``take`` or ``advance`` rebuilds it by a forward pass under
  that call's parameters, exact under ``reprefill``; under ``keep`` the continued rows then
  attend to keys and values of the resumed parameters where the run that saved them held those
  of older ones."""
  # pylint: disable=protected-access
  producer.version, producer._serial = int(state["version"]), int(state["serial"])
  producer.horizon = int(state.get("horizon", producer.version - producer.max_staleness))
  producer._admitted = int(state.get("admitted", 0))
  producer.counts = Counts(**state["counts"])
  producer.pool = restore_pool(producer.pool, state["pool"])
  producer._groups = groups_from_json(state["groups"], state["pool"], producer.g,
                                      producer.version)
  producer._pending = collections.deque(tuple(x) for x in state.get("pending", []))
  producer.ready = collections.deque(Group(tag=g["tag"], **ready_arrays(g))
                                     for g in state["ready"])
  producer._stale_cache = True
