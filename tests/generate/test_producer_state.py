"""The producer's checkpoint pieces: groups round-trip through JSON exactly, and a checkpoint
written before groups recorded ``admitted``/``oldest`` gets them from its rows, by hand."""

import json

import numpy as np

from grpo_jax.generate import producer_state
from grpo_jax.generate.producer_types import OpenGroup, Prompt, Row

T = 3


def _prompt(tag):
  return Prompt(tag, np.arange(4, dtype=np.int32), np.ones(4, bool), None,
                np.array([7, 8], np.uint32))


def _row(first_version):
  return Row(np.array([5, 6, 0], np.int32), np.array([-0.5, -1.0, 0.0], np.float32),
             np.array([first_version, first_version + 1, 0], np.int32), np.int32(2), True)


def test_groups_round_trip_through_json_exactly():
  groups = {1: OpenGroup(_prompt(11), rows={0: _row(3)}, admitted=2, oldest=3)}
  saved = json.loads(json.dumps(producer_state.groups_json(groups), default=np.ndarray.tolist))
  pool = {"versions": np.zeros((2, T), np.int32), "ticket": np.array([2, 3])}
  back = producer_state.groups_from_json(saved, pool, g=2, version=9)
  assert list(back) == [1]
  got, want = back[1].prompt, groups[1].prompt
  assert isinstance(got, Prompt) and got.tag == 11 and got.stop is None
  for a, b in ((got.ids, want.ids), (got.mask, want.mask), (got.keys, want.keys)):
    assert a.dtype == b.dtype and (a == b).all()
  assert isinstance(back[1].rows[0], Row)
  for a, b in zip(back[1].rows[0], groups[1].rows[0]):
    assert np.asarray(a).dtype == np.asarray(b).dtype and (np.asarray(a) == b).all()
  assert (back[1].admitted, back[1].oldest) == (2, 3)


def test_an_old_checkpoint_gets_each_groups_oldest_version_from_its_rows():
  # g = 2: tickets 2 and 3 are group 1's rows, 4 and 5 group 2's. Slots hold tickets
  # (2, 5, 3) whose first versions are (4, 9, 6).
  versions = np.zeros((3, T), np.int32)
  versions[:, 0] = [4, 9, 6]
  pool = {"versions": versions, "ticket": np.array([2, 5, 3])}
  saved = {
      # a harvested row from version 3 and live rows from 4 and 6: oldest min(3, 4, 6) = 3
      "1": {"prompt": producer_state.prompt_json(_prompt(11)),
            "rows": {"0": [np.asarray(a) for a in _row(3)]}},
      # no row harvested, one live from version 9: oldest 9
      "2": {"prompt": producer_state.prompt_json(_prompt(12)), "rows": {}},
      # nothing anywhere: the producer's version (5)
      "7": {"prompt": producer_state.prompt_json(_prompt(17)), "rows": {}}}
  back = producer_state.groups_from_json(saved, pool, g=2, version=5)
  assert {k: (v.admitted, v.oldest) for k, v in back.items()} == {
      1: (2, 3), 2: (2, 9), 7: (2, 5)}
