"""The partial-rollout producer's checkpoint pieces: its pool rows, waiting groups and ready
groups as JSON plus NumPy arrays, and back onto the device(s) they came from.

``generate.partial.Producer.state_dict`` / ``load_state_dict`` assemble these; the checkpoint
(``run.checkpoint``) writes the arrays as arrays. The KV cache is never saved: the producer
rebuilds it from the restored rows. A prompt is ``(tag, ids [P], mask [P], stop [S] | None,
key data [2])``; a harvested row ``(tokens [T], logp [T], versions [T], length, ended)``.
"""

from __future__ import annotations

import jax
import numpy as np

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


def prompt_json(prompt: tuple) -> list:
  return [np.asarray(x).tolist() if isinstance(x, (np.ndarray, np.generic)) else x
          for x in prompt]


def prompt_from_json(values: list) -> tuple:
  tag, ids, mask, stop, key = values
  return (tag, np.asarray(ids, np.int32), np.asarray(mask, bool),
          None if stop is None else np.asarray(stop, np.int32), np.asarray(key, np.uint32))


def groups_json(groups: dict) -> dict:
  """The groups waiting for rows: their prompt, harvested rows, rows admitted, oldest version."""
  return {str(k): {"prompt": prompt_json(v["prompt"]),
                   "rows": {str(g): [np.asarray(a) for a in r] for g, r in v["rows"].items()},
                   "admitted": v["admitted"], "oldest": v["oldest"]}
          for k, v in groups.items()}


def groups_from_json(saved: dict, pool: dict, g: int, version: int) -> dict:
  """``groups_json``'s inverse. ``pool``: the saved pool fields; ``g``: rows per group.

  A checkpoint written before groups recorded ``admitted`` and ``oldest`` held whole groups
  admitted at once: ``oldest`` is then the first version of any of its rows, harvested or
  still in the pool (``version`` where it has none).
  """
  oldest = np.asarray(pool["versions"])[:, 0]
  tickets = np.asarray(pool["ticket"])

  def group(k: int, v: dict) -> dict:
    rows = {int(i): tuple(np.asarray(a, d) for a, d in zip(r, ROW_DTYPES))
            for i, r in v["rows"].items()}
    if "oldest" not in v:
      live = oldest[tickets // g == k]
      firsts = [int(r[2][0]) for r in rows.values()] + [int(x) for x in live]
      v = {**v, "admitted": g, "oldest": min(firsts, default=version)}
    return {"prompt": prompt_from_json(v["prompt"]), "rows": rows,
            "admitted": int(v["admitted"]), "oldest": int(v["oldest"])}

  return {int(k): group(int(k), v) for k, v in saved.items()}


def ready_arrays(saved: dict) -> dict[str, np.ndarray]:
  """A saved complete group's arrays (all of ``partial.Group`` but its tag)."""
  return {k: np.asarray(saved[k], d) for k, d in GROUP_DTYPES.items()}
