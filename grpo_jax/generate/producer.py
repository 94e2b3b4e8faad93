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

A ``rule`` (optional) makes the allocation sequential: a new group admits ``first_rows(tag)``
rows, and whenever every row admitted to a group has ended the rule ``decide``s from them: more
rows (SARA's one more rollout, or the rest of a committed group), the group complete as it is,
or ``DROP`` (SARA's abandonment, DAPO's filter of a group whose rewards all agree): its rows
are counted as generated and never trained. Rows added to a group take slots before any new
group does. Without a rule every group admits its G rows at once and is complete when they end.

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
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.generate import producer_state as state_lib
from grpo_jax.generate import pool as pool_lib
from grpo_jax.generate.producer_types import Counts, Group, OpenGroup, Prompt, Row

__all__ = ["Counts", "DROP", "Group", "OpenGroup", "Producer", "Prompt", "Row", "Rule",
           "key_data"]


DROP = -1  # a rule's verdict: the group is dropped, its rows counted as generated


class Rule(Protocol):
  """Sequential allocation on the pool (module doc); the allocator's side of SARA or DAPO."""

  def first_rows(self) -> int:
    """Rows a new group admits first (1..G)."""

  def decide(self, prompt: Prompt, rows: list[Row]) -> int:
    """Once every admitted row of the group of ``prompt`` has ended (``rows``, in row order):
    rows to add (>= 1, at most G - len(rows)), 0 for a complete group (len(rows) = G), or
    DROP."""

  def forget(self, tag) -> None:
    """Group ``tag`` left the pool without a decision (discarded for staleness)."""


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
    rule: the sequential allocation (``Rule``; None: G rows a group, admitted at once).
    admit_cap: most rows admitted per ``take`` (0: none); a step that reaches it decodes what
      is in flight and returns the groups complete by then (DAPO's and SARA's cap of
      ``max_rounds`` x B x G rollouts a step).
    mesh: the pool's rows split over its batch axes (``pool.constrain_pool``); None: one
      device.

  Raises:
    ValueError: the slots are not a multiple of G, or the budget can never finish a row of T.
  """

  def __init__(self, graphdef, config, model_config, *, slots: int, prompt_len: int, chunk: int,
               max_staleness: int, prompts: Callable[[], Prompt], static: bool = False,
               reprefill: bool = False, budget: int = 0, rule: Rule | None = None,
               admit_cap: int = 0, mesh=None):
    g, t = config.prompt_group, config.max_new_tokens
    if slots % g:
      raise ValueError(f"rollout slots ({slots}) must be a multiple of the group size ({g})")
    if budget and not static and budget * (max_staleness + 1) < t - 1:
      raise ValueError(
          f"a decode budget of {budget} steps per step x (max_staleness {max_staleness} + 1) "
          f"= {budget * (max_staleness + 1)} decode steps can never finish a row of {t} "
          f"tokens ({t - 1} after the prefill's): raise the budget or the staleness")
    if static and rule is not None:
      raise ValueError("the static schedule admits whole groups: no rule")
    self.budget = 0 if static else budget
    self.g, self.slots, self.p = g, slots, prompt_len
    self.t = config.max_new_tokens
    self.static, self.max_staleness, self.do_reprefill = static, max_staleness, reprefill
    self.rule, self.admit_cap = rule, admit_cap
    # A chunk that divides the budget, so that a step spends it exactly.
    self.chunk = self.t if static else math.gcd(chunk, self.budget) if self.budget else chunk
    self._admit, self._decode, self._release, self._reprefill = pool_lib.make_pool_fns(
        graphdef, config, self.chunk, mesh)
    # Rows of any groups in one call: each row prefilled on its own.
    self._admit_rows = pool_lib.make_pool_fns(
        graphdef, dataclasses.replace(config, prompt_group=1), self.chunk, mesh)[0]
    self.pool = pool_lib.init(model_config, slots, prompt_len, config, mesh)
    self.prompts = prompts
    self.counts = Counts()
    self.version = 0
    self._serial = 0  # groups admitted so far: a group's rows have tickets serial * G + g
    self._groups: dict[int, OpenGroup] = {}  # serial -> the group collecting its rows
    self._pending: collections.deque[tuple[int, int]] = collections.deque()  # (serial, rows)
    self.ready: collections.deque[Group] = collections.deque()
    self._stale_cache = False  # restored rows whose cache is still to be rebuilt
    self.horizon = -max_staleness  # groups older than this version are discarded (``expire``)
    self.lead: int | None = None  # most groups ready and in flight (``work``); None: no limit
    self._admitted = 0  # rows admitted since the last ``take``

  # -- admission ---------------------------------------------------------------------------
  def _new_group(self) -> int:
    prompt = Prompt(*self.prompts())
    serial = self._serial
    self._serial += 1
    self._groups[serial] = OpenGroup(prompt, rows={}, admitted=0, oldest=self.version)
    return serial

  def _admit_groups(self, params, free: np.ndarray, cap: int, groups: int | None) -> int:
    """Admits as many whole groups as the free slots (and ``cap`` rows, and ``groups`` new
    groups unless None) hold, in calls of 2^k groups (few compilations); the rows admitted."""
    count = min(len(free), cap) // self.g
    if groups is not None:
      count = min(count, groups)
    if self.static and (self.pool_live() or count * self.g < self.slots):
      return 0
    start = admitted = 0
    while count:
      size = 1 << (count.bit_length() - 1)  # admit 2^k groups per call: few compilations
      serials = [self._new_group() for _ in range(size)]
      prompts = [self._groups[s].prompt for s in serials]
      rows = size * self.g
      ids = np.repeat(np.stack([p.ids for p in prompts]), self.g, axis=0)
      mask = np.repeat(np.stack([p.mask for p in prompts]), self.g, axis=0)
      stop = np.concatenate([np.full(self.g, self.t) if p.stop is None
                             else np.minimum(p.stop, self.t) for p in prompts]).astype(np.int32)
      keys = np.concatenate([p.keys for p in prompts]).astype(np.uint32)
      slots = free[start * self.g:start * self.g + rows]
      tickets = np.arange(serials[0] * self.g, (serials[-1] + 1) * self.g, dtype=np.int32)
      for s in serials:
        self._groups[s].admitted = self.g
      self.pool = self._admit(params, self.pool, ids, mask, slots.astype(np.int32), keys,
                              tickets, stop, jnp.int32(self.version))
      self.counts.prefill_positions += size * self.p
      self.counts.tokens_generated += rows
      start += size
      count -= size
      admitted += rows
    return admitted

  def _admit_by_rule(self, params, free: np.ndarray, cap: int, groups: int | None) -> int:
    """Admits the rows the rule asked for (oldest request first; one that does not fit holds
    back everything after it), then new groups' first rows while they fit and (unless None)
    fewer than ``groups`` new groups were admitted; the rows admitted. The rows a group
    already in flight asks for are never held back by ``groups``: the lead counted that group
    when it was admitted. Each row is prefilled on its own, in one call padded to a power of
    two rows."""
    room = min(len(free), cap)
    wanted = []  # (serial, row g)
    while self._pending and self._pending[0][1] <= room:
      serial, n = self._pending.popleft()
      group = self._groups[serial]
      wanted += [(serial, group.admitted + j) for j in range(n)]
      group.admitted += n
      room -= n
    new = 0
    while not self._pending and room and (groups is None or new < groups):
      first = self.rule.first_rows()
      if first > room:
        break
      new += 1
      serial = self._new_group()
      self._groups[serial].admitted = first
      wanted += [(serial, j) for j in range(first)]
      room -= first
    if not wanted:
      return 0
    m = len(wanted)
    size = min(1 << (m - 1).bit_length(), self.slots)  # padded: few compilations
    prompts = [self._groups[s].prompt for s, _ in wanted]
    pad = lambda a, fill: np.concatenate([a, np.full((size - m,) + a.shape[1:], fill, a.dtype)])
    ids = pad(np.stack([p.ids for p in prompts]), 0)
    mask = pad(np.stack([p.mask for p in prompts]), True)
    stop = pad(np.asarray([self.t if p.stop is None else min(int(p.stop[g]), self.t)
                           for p, (_, g) in zip(prompts, wanted)], np.int32), self.t)
    keys = pad(np.stack([p.keys[g] for p, (_, g) in zip(prompts, wanted)]).astype(np.uint32), 0)
    tickets = pad(np.asarray([s * self.g + g for s, g in wanted], np.int32), -1)
    slots = pad(free[:m].astype(np.int32), self.slots)  # slot N: dropped
    self.pool = self._admit_rows(params, self.pool, ids, mask, slots, keys, tickets, stop,
                                 jnp.int32(self.version))
    self.counts.prefill_positions += m * self.p
    self.counts.tokens_generated += m
    return m

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
      group.rows[g] = Row(*(f[i] for f in fields))
      if len(group.rows) == group.admitted:
        self._settle(serial)
    self.pool = self._release(self.pool, jnp.asarray(done))

  def _settle(self, serial: int) -> None:
    """Every admitted row of group ``serial`` has ended: ready, more rows, or dropped."""
    group = self._groups[serial]
    n = group.admitted
    rows = [group.rows[k] for k in range(n)]
    verdict = 0 if self.rule is None else self.rule.decide(group.prompt, rows)
    if verdict == DROP:
      del self._groups[serial]
      self.counts.groups_dropped += 1
      self.counts.rows_dropped += n
    elif verdict > 0:
      if n + verdict > self.g:
        raise ValueError(f"the rule asked for {verdict} more rows of a group of {n} / {self.g}")
      self._pending.append((serial, verdict))
    else:
      if n != self.g:
        raise ValueError(f"the rule completed a group of {n} rows, not {self.g}")
      del self._groups[serial]
      p = group.prompt
      self.ready.append(Group(p.tag, p.ids, p.mask, *(np.stack(c) for c in zip(*rows))))

  # -- a step ------------------------------------------------------------------------------
  def take(self, params, b: int) -> list[Group]:
    """B complete groups (first completed first), decoding until they are ready, the
    ``budget`` is spent, or the ``admit_cap`` is reached with nothing left in flight (then
    fewer); rows in flight stay."""
    self.work(params, until=lambda: len(self.ready) >= b, budget=self.budget)
    self.counts.rows_admitted += self._admitted
    self._admitted = 0
    out = [self.ready.popleft() for _ in range(min(b, len(self.ready)))]
    for group in out:
      self.counts.groups_trained += 1
      self.counts.rows_trained += self.g
      self.counts.tokens_trained += int(group.lengths.sum())
    return out

  def work(self, params, until: Callable[[], bool], budget: int = 0,
           chunks: int = 0) -> int:
    """Admits and decodes chunk after chunk until ``until()`` holds (checked before each
    chunk), nothing is in flight or admissible, or ``budget`` decode steps or ``chunks``
    chunks are spent (0: no limit). New groups are admitted while the groups ready and in
    flight are fewer than ``lead`` (None: no limit; counted in groups, whatever rows each has
    admitted so far), and rows (new groups' or those a rule asked for) while the
    ``admit_cap`` rows since the last ``take`` allow. Returns the chunks run."""
    self._rebuild_cache(params)
    spent = run = 0
    admit = self._admit_groups if self.rule is None else self._admit_by_rule
    while (not until() and (not budget or spent < budget)
           and (not chunks or run < chunks)):
      free = np.flatnonzero(~np.asarray(self.pool.live))
      room = self.admit_cap - self._admitted if self.admit_cap else len(free)
      groups = None  # the groups ready and in flight may not run ahead of the lead
      if self.lead is not None:
        groups = max(self.lead - len(self.ready) - len(self._groups), 0)
      now = admit(params, free, room, groups)
      self._admitted += now
      if len(free) == self.slots and not now:
        break  # nothing in flight and nothing admitted (the cap or the lead is reached)
      before = self.pool.length.sum()
      self.pool, steps = self._decode(params, self.pool, jnp.int32(self.version))
      steps, drawn = (int(x) for x in jax.device_get((steps, self.pool.length.sum() - before)))
      spent += steps
      run += 1
      self.counts.decode_steps += steps
      self.counts.decode_positions += steps * self.slots
      self.counts.tokens_generated += drawn
      self._harvest()
    return run

  def advance(self, params) -> None:
    """After an update: the version moves on; groups too old to train are discarded (ready,
    waiting for rows or in flight: their whole group), and with ``reprefill`` the live rows'
    cache is recomputed under ``params`` (once: a restored pool's rebuild is that one)."""
    if self.do_reprefill:
      self._stale_cache = False  # rebuilt below, after the discards, under the same params
    else:
      self._rebuild_cache(params)
    self.version += 1
    self.expire(self.version - self.max_staleness)
    if self.do_reprefill and self.pool_live():
      self.pool = self._reprefill(params, self.pool)
      self.counts.reprefill_positions += self.slots * (self.p + self.t)

  def expire(self, horizon: int) -> None:
    """No group whose oldest token is older than version ``horizon`` can be trained any more
    (the next step to take groups trains version ``horizon + max_staleness``): such groups
    are discarded, ready, waiting for rows or in flight (their whole group)."""
    self.horizon = max(self.horizon, horizon)
    kept = collections.deque()
    for group in self.ready:
      if group.oldest < self.horizon:
        self._discard(self.g)
      else:
        kept.append(group)
    self.ready = kept
    stale = {s for s, v in self._groups.items() if v.oldest < self.horizon}
    if stale:
      tickets = np.asarray(self.pool.ticket)
      drop = np.asarray(self.pool.live) & np.isin(tickets // self.g, list(stale))
      for serial in stale:
        group = self._groups.pop(serial)
        self._discard(group.admitted)
        if self.rule is not None:
          self.rule.forget(group.prompt.tag)
      self._pending = collections.deque(x for x in self._pending if x[0] not in stale)
      if drop.any():
        self.pool = self._release(self.pool, jnp.asarray(drop))

  def _discard(self, rows: int) -> None:
    self.counts.groups_discarded += 1
    self.counts.rows_discarded += rows

  # -- checkpoint ----------------------------------------------------------------------------
  def state_dict(self) -> dict:
    """Everything in flight (``producer_state.producer_state``): JSON but for its NumPy
    arrays, which the checkpoint writes as arrays (``run.checkpoint``)."""
    return state_lib.producer_state(self)

  def load_state_dict(self, state: dict) -> None:
    """Restores ``state_dict``'s rows (``producer_state.load_producer``); the pool's cache is
    rebuilt by the next ``take`` or ``advance``."""
    state_lib.load_producer(self, state)

  def _rebuild_cache(self, params) -> None:
    if self._stale_cache:
      self._stale_cache = False
      if self.pool_live():
        self.pool = self._reprefill(params, self.pool)
        self.counts.reprefill_positions += self.slots * (self.p + self.t)

  def tags_in_flight(self) -> set:
    """The tags of the groups not yet handed out, dropped or discarded."""
    return {v.prompt.tag for v in self._groups.values()} | {g.tag for g in self.ready}

  def oldest_held(self) -> int | None:
    """The version of the oldest token not yet handed out, dropped or discarded (in flight,
    waiting for rows or in a complete group waiting to be taken); None when there is none."""
    held = [v.oldest for v in self._groups.values()] + [g.oldest for g in self.ready]
    return min(held, default=None)

  def in_flight(self) -> int:
    """Rows generated or being generated and not yet handed out, dropped or discarded: live
    in the pool, ended and awaiting their group's other rows or the rule, and in complete
    groups waiting to be taken."""
    return (int(np.asarray(self.pool.live).sum())
            + sum(len(g.rows) for g in self._groups.values()) + self.g * len(self.ready))


def key_data(key, n: int) -> np.ndarray:
  """[n, 2] uint32 key data of ``n`` row keys split from ``key``."""
  return np.asarray(jax.random.key_data(jax.random.split(key, n)))
