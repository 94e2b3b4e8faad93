"""The partial-rollout producer's data: a group's prompt, a harvested row, a group still
collecting its rows, a complete group, and the producer's counts.

``generate.producer.Producer`` schedules them; ``generate.producer_state`` writes and reads them
in a checkpoint. Shape letters: P prompt positions, T completion positions, G rows a group.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np


class Prompt(NamedTuple):
  """One group's prompt, as the producer's ``prompts`` callable returns it (a plain tuple in
  this order is accepted too).

  Attributes:
    tag: the caller's name for the group (handed back with it).
    ids: int32 [P] prompt ids, left-padded.
    mask: bool [P] the real prompt positions.
    stop: int32 [G] a position at which each row stops (a test's scripted lengths), or None.
    keys: uint32 [G, 2] key data of each row's sampling key.
  """

  tag: object
  ids: np.ndarray
  mask: np.ndarray
  stop: np.ndarray | None
  keys: np.ndarray


class Row(NamedTuple):
  """One harvested row.

  Attributes:
    tokens: int32 [T] completion ids (padding past ``length``).
    logp: float32 [T] the sampler's log-probs of them.
    versions: int32 [T] the version of the parameters that drew each token.
    length: its completion tokens.
    ended: it ended with EOS (else it reached T).
  """

  tokens: np.ndarray
  logp: np.ndarray
  versions: np.ndarray
  length: np.integer
  ended: np.bool_


@dataclasses.dataclass
class OpenGroup:
  """A group collecting its rows: admitted, some harvested, none handed out yet.

  Attributes:
    prompt: its Prompt.
    rows: row index g -> Row, the rows harvested so far.
    admitted: rows admitted so far (a rule admits them in steps).
    oldest: the version at its first admission (its oldest token's, for the staleness bound).
  """

  prompt: Prompt
  rows: dict[int, Row]
  admitted: int
  oldest: int


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
    rows_dropped, groups_dropped: rows / groups the rule dropped (``DROP``).
    rows_admitted: rows admitted (each a prefill or its share of one).
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
  rows_dropped: int = 0
  groups_dropped: int = 0
  rows_admitted: int = 0

  @property
  def positions(self) -> int:
    return self.decode_positions + self.prefill_positions + self.reprefill_positions

  @property
  def useful_fraction(self) -> float:
    return self.tokens_trained / max(self.positions, 1)

  def minus(self, other: "Counts") -> "Counts":
    return Counts(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                     for f in dataclasses.fields(self)})
