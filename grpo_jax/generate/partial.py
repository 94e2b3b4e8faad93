"""Partial rollouts: a producer of complete groups over a slot pool whose rows span updates.

A step asks for B complete groups of G rows (``take``). The producer keeps ``slots`` rows in
flight (``generate.pool``): it admits whole groups into free slots, decodes every live row a
chunk of tokens at a time, harvests each row as it ends (its slot takes a new prompt at once)
and stops as soon as B groups are complete; the rows still unfinished stay in the pool and
continue under the next parameters (Kimi k1.5, arXiv 2501.12599; APRIL, arXiv 2509.18521).
``static=True`` is today's sampler's schedule on the same code: B groups admitted together and
decoded until the longest row ends, nothing in flight between steps.

Versions and staleness (the words the docs and metrics use): a token's version is the number
of optimiser updates of the parameters that drew it; a row's is its oldest token's; a token
trained at version v has staleness v - its version. After each update (``advance``) every row
whose oldest token would exceed ``max_staleness`` is discarded, with its whole group (a GRPO
group is trained whole or not at all), and counted as generated: its positions were computed.

Accounting (``Counts``): positions computed are the decode row-steps of every slot (a decode
step runs the whole pool), the prefill positions (P per prompt prefilled: a group's rows share
its prefill) and any re-prefill positions; the useful-slot fraction is the completion tokens of
the rows handed to ``take``'s caller over those positions.

The producer is host-side scheduling around jitted pool calls: one device-to-host read per
chunk (which rows ended). Shape letters: ``types.py``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.generate import pool as pool_lib


@dataclasses.dataclass
class Counts:
  """What the producer computed and handed out (cumulative).

  Attributes:
    decode_steps: decode steps run (each computed ``slots`` positions).
    decode_positions: decode row-steps: decode_steps x slots.
    prefill_positions: P per prompt prefilled (padding rows of a fixed-size admit included).
    reprefill_positions: (P + T) per slot at each re-prefill.
    tokens_generated: completion tokens drawn (every row, discarded or not).
    tokens_trained: completion tokens of the rows handed out.
    rows_trained, rows_discarded: rows handed out / discarded for staleness.
    groups_trained, groups_discarded: the same in groups.
  """

  decode_steps: int = 0
  decode_positions: int = 0
  prefill_positions: int = 0
  reprefill_positions: int = 0
  tokens_generated: int = 0
  tokens_trained: int = 0
  rows_trained: int = 0
  rows_discarded: int = 0
  groups_trained: int = 0
  groups_discarded: int = 0

  @property
  def positions(self) -> int:
    return self.decode_positions + self.prefill_positions + self.reprefill_positions

  @property
  def useful_fraction(self) -> float:
    return self.tokens_trained / max(self.positions, 1)

  def minus(self, other: "Counts") -> "Counts":
    return Counts(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                     for f in dataclasses.fields(self)})


@dataclasses.dataclass
class Group:
  """One complete group: G rows' [G, T] tokens, log-probs and versions, [G] lengths and EOS
  flags, its prompt ([P] ids and mask) and the caller's ``tag`` for it."""

  tag: object
  prompt_ids: np.ndarray
  prompt_mask: np.ndarray
  tokens: np.ndarray
  logp: np.ndarray
  versions: np.ndarray
  lengths: np.ndarray
  ended: np.ndarray

  @property
  def oldest(self) -> int:
    return int(self.versions[:, 0].min())

  def tokens_mask(self) -> np.ndarray:
    """bool [G, T]: the rows' real tokens."""
    return np.arange(self.tokens.shape[1])[None, :] < self.lengths[:, None]


# One prompt of a group: (tag, prompt ids [P], mask [P], stop_at [G] or None, key data [G, 2]).
Prompt = tuple


class Producer:
  """Complete groups from a slot pool, rows in flight across steps (see the module doc).

  Args:
    graphdef: the model's graph (``nnx.split``).
    config: sampling settings; ``prompt_group`` must be G.
    model_config: the model's config (the cache's shape).
    slots: N, rows in flight (a multiple of G).
    prompt_len: P.
    chunk: decode steps between two looks at which rows ended (``static``: T).
    max_staleness: most updates between a trained token's version and the trained one.
    prompts: ``prompts()`` gives the next group's ``Prompt``.
    static: today's schedule (see the module doc).
    reprefill: recompute the live rows' cache under the new parameters after each update.
    budget: most decode steps per ``take`` (0: none); a step that reaches it returns the groups
      complete by then, fewer than B. A row of T tokens can then finish within the staleness
      bound only if budget x (max_staleness + 1) >= T - 1 (token 0 comes with the prefill):
      refused otherwise.

  Raises:
    ValueError: the slots are not a multiple of G, or the budget can never finish a row of T.
  """

  def __init__(self, graphdef, config, model_config, *, slots: int, prompt_len: int, chunk: int,
               max_staleness: int, prompts: Callable[[], Prompt], static: bool = False,
               reprefill: bool = False, budget: int = 0):
    g, t = config.prompt_group, config.max_new_tokens
    if slots % g:
      raise ValueError(f"rollout slots ({slots}) must be a multiple of the group size ({g})")
    if budget and not static and budget * (max_staleness + 1) < t - 1:
      raise ValueError(
          f"a decode budget of {budget} steps per step x (max_staleness {max_staleness} + 1) "
          f"= {budget * (max_staleness + 1)} decode steps can never finish a row of {t} "
          f"tokens ({t - 1} after the prefill's): raise the budget or the staleness")
    self.budget = 0 if static else budget
    self.g, self.slots, self.p = g, slots, prompt_len
    self.t = config.max_new_tokens
    self.static, self.max_staleness, self.do_reprefill = static, max_staleness, reprefill
    # A chunk that divides the budget, so that a step spends it exactly.
    self.chunk = self.t if static else math.gcd(chunk, self.budget) if self.budget else chunk
    self._admit, self._decode, self._release, self._reprefill = pool_lib.make_pool_fns(
        graphdef, config, self.chunk)
    self.pool = pool_lib.init(model_config, slots, prompt_len, config)
    self.prompts = prompts
    self.counts = Counts()
    self.version = 0
    self._serial = 0  # groups admitted so far: a group's rows have tickets serial * G + g
    self._groups: dict[int, dict] = {}  # serial -> {prompt, rows: {g: arrays}, slots}
    self.ready: collections.deque[Group] = collections.deque()
    self._stale_cache = False  # restored rows whose cache is still to be rebuilt

  # -- admission ---------------------------------------------------------------------------
  def _admit_groups(self, params, free: np.ndarray) -> None:
    """Admits as many whole groups as the free slots hold (in calls of 2^k groups)."""
    count = len(free) // self.g
    if self.static and (self.pool_live() or count * self.g < self.slots):
      return
    start = 0
    while count:
      size = 1 << (count.bit_length() - 1)  # admit 2^k groups per call: few compilations
      prompts = [self.prompts() for _ in range(size)]
      rows = size * self.g
      ids = np.repeat(np.stack([p[1] for p in prompts]), self.g, axis=0)
      mask = np.repeat(np.stack([p[2] for p in prompts]), self.g, axis=0)
      stop = np.concatenate([np.full(self.g, self.t) if p[3] is None else np.minimum(p[3], self.t)
                             for p in prompts]).astype(np.int32)
      keys = np.concatenate([p[4] for p in prompts]).astype(np.uint32)
      slots = free[start * self.g:start * self.g + rows]
      tickets = np.arange(self._serial * self.g, (self._serial + size) * self.g, dtype=np.int32)
      for j, p in enumerate(prompts):
        self._groups[self._serial + j] = {"prompt": p, "rows": {}}
      self._serial += size
      self.pool = self._admit(params, self.pool, ids, mask, slots.astype(np.int32), keys,
                              tickets, stop, jnp.int32(self.version))
      self.counts.prefill_positions += size * self.p
      self.counts.tokens_generated += rows
      start += size
      count -= size

  def pool_live(self) -> bool:
    return bool(np.asarray(self.pool.live).any())

  # -- harvest -----------------------------------------------------------------------------
  def _harvest(self) -> None:
    done = np.asarray(self.pool.done & self.pool.live)
    if not done.any():
      return
    slots = np.flatnonzero(done)
    tickets = np.asarray(self.pool.ticket)[slots]
    fields = [np.asarray(a)[slots] for a in (self.pool.tokens, self.pool.logp,
                                            self.pool.versions, self.pool.length,
                                            self.pool.ended)]
    for i, ticket in enumerate(tickets):
      serial, g = divmod(int(ticket), self.g)
      group = self._groups.get(serial)
      if group is None:  # its group was discarded
        continue
      group["rows"][g] = tuple(f[i] for f in fields)
      if len(group["rows"]) == self.g:
        del self._groups[serial]
        rows = [group["rows"][k] for k in range(self.g)]
        tag, ids, mask = group["prompt"][:3]
        self.ready.append(Group(tag, ids, mask, *(np.stack(c) for c in zip(*rows))))
    self.pool = self._release(self.pool, jnp.asarray(done))

  # -- a step ------------------------------------------------------------------------------
  def take(self, params, b: int) -> list[Group]:
    """B complete groups (first completed first), decoding until they are ready or the
    ``budget`` is spent (then fewer); rows in flight stay."""
    self._rebuild_cache(params)
    spent = 0
    while len(self.ready) < b and (not self.budget or spent < self.budget):
      free = np.flatnonzero(~np.asarray(self.pool.live))
      self._admit_groups(params, free)
      before = self.pool.length.sum()
      self.pool, steps = self._decode(params, self.pool, jnp.int32(self.version))
      steps, drawn = (int(x) for x in jax.device_get((steps, self.pool.length.sum() - before)))
      spent += steps
      self.counts.decode_steps += steps
      self.counts.decode_positions += steps * self.slots
      self.counts.tokens_generated += drawn
      self._harvest()
    out = [self.ready.popleft() for _ in range(min(b, len(self.ready)))]
    for group in out:
      self.counts.groups_trained += 1
      self.counts.rows_trained += self.g
      self.counts.tokens_trained += int(group.lengths.sum())
    return out

  def advance(self, params) -> None:
    """After an update: the version moves on; rows too old to train are discarded (whole
    groups), and with ``reprefill`` the live rows' cache is recomputed under ``params``."""
    self._rebuild_cache(params)
    self.version += 1
    oldest_allowed = self.version - self.max_staleness
    kept = collections.deque()
    for group in self.ready:
      if group.oldest < oldest_allowed:
        self._discard(self.g)
      else:
        kept.append(group)
    self.ready = kept
    live = np.asarray(self.pool.live)
    stale = live & (np.asarray(self.pool.oldest) < oldest_allowed)
    if stale.any():
      tickets = np.asarray(self.pool.ticket)
      serials = {int(t) // self.g for t in tickets[stale]}
      drop = live & np.isin(tickets // self.g, list(serials))
      for serial in serials:
        self._groups.pop(serial, None)
        self._discard(self.g)
      self.pool = self._release(self.pool, jnp.asarray(drop))
    if self.do_reprefill and self.pool_live():
      self.pool = self._reprefill(params, self.pool)
      self.counts.reprefill_positions += self.slots * (self.p + self.t)

  def _discard(self, rows: int) -> None:
    self.counts.groups_discarded += 1
    self.counts.rows_discarded += rows

  # -- checkpoint ----------------------------------------------------------------------------
  def state_dict(self) -> dict:
    """Everything in flight, JSON-ready: the pool's rows (not its KV cache, which ``restore``
    rebuilds), the groups waiting for rows, the ready queue, the version and the counts."""
    pool = {f: np.asarray(getattr(self.pool, f)).tolist() for f in _POOL_FIELDS}
    groups = {str(k): {"prompt": _prompt_json(v["prompt"]),
                       "rows": {str(g): [np.asarray(a).tolist() for a in r]
                                for g, r in v["rows"].items()}}
              for k, v in self._groups.items()}
    ready = [{f.name: _jsonable(getattr(g, f.name)) for f in dataclasses.fields(Group)}
             for g in self.ready]
    return {"version": self.version, "serial": self._serial, "counts": vars(self.counts),
            "pool": pool, "groups": groups, "ready": ready}

  def load_state_dict(self, state: dict) -> None:
    """Restores ``state_dict``'s rows; the pool's cache is rebuilt (a forward pass under the
    parameters of the next ``take`` or ``advance``): exact under ``reprefill``, and under
    ``keep`` the continued rows then attend to keys and values of the resumed parameters
    where the run that saved them held those of older ones."""
    self.version, self._serial = int(state["version"]), int(state["serial"])
    self.counts = Counts(**state["counts"])
    fields = {f: jnp.asarray(np.asarray(state["pool"][f], np.asarray(getattr(
        self.pool, f)).dtype)) for f in _POOL_FIELDS}
    self.pool = self.pool.replace(**fields)
    self._groups = {int(k): {"prompt": _prompt_from_json(v["prompt"]),
                             "rows": {int(g): tuple(np.asarray(a, d) for a, d in zip(r, _ROW_DTYPES))
                                      for g, r in v["rows"].items()}}
                    for k, v in state["groups"].items()}
    self.ready = collections.deque(
        Group(tag=g["tag"], **{k: np.asarray(g[k], d) for k, d in _GROUP_DTYPES.items()})
        for g in state["ready"])
    self._stale_cache = True

  def _rebuild_cache(self, params) -> None:
    if self._stale_cache:
      self._stale_cache = False
      if self.pool_live():
        self.pool = self._reprefill(params, self.pool)
        self.counts.reprefill_positions += self.slots * (self.p + self.t)

  def tags_in_flight(self) -> set:
    """The tags of the groups not yet handed out or discarded."""
    return {v["prompt"][0] for v in self._groups.values()} | {g.tag for g in self.ready}

  def in_flight(self) -> int:
    """Rows live in the pool (unfinished or awaiting their group's other rows)."""
    return int(np.asarray(self.pool.live).sum()) + sum(
        len(g["rows"]) for g in self._groups.values())


_POOL_FIELDS = ("prompt_ids", "prompt_mask", "tokens", "logp", "versions", "length", "live",
                "done", "ended", "key", "stop_at", "ticket")
# A harvested row: (tokens, logp, versions, length, ended).
_ROW_DTYPES = (np.int32, np.float32, np.int32, np.int32, bool)
_GROUP_DTYPES = {"prompt_ids": np.int32, "prompt_mask": bool, "tokens": np.int32,
                 "logp": np.float32, "versions": np.int32, "lengths": np.int32, "ended": bool}


def _jsonable(x):
  return np.asarray(x).tolist() if isinstance(x, (np.ndarray, np.generic)) else x


def _prompt_json(prompt: Prompt) -> list:
  return [_jsonable(x) for x in prompt]


def _prompt_from_json(values: list) -> Prompt:
  tag, ids, mask, stop, key = values
  return (tag, np.asarray(ids, np.int32), np.asarray(mask, bool),
          None if stop is None else np.asarray(stop, np.int32), np.asarray(key, np.uint32))


def key_data(key, n: int) -> np.ndarray:
  """[n, 2] uint32 key data of ``n`` row keys split from ``key``."""
  return np.asarray(jax.random.key_data(jax.random.split(key, n)))
