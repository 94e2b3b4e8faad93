"""Static rounds on the slot pool (``generate.static_round``): the rollouts' and evaluations'
generation, which must draw exactly what one ``sampler.sample`` call on the same rows draws
(tokens, behaviour log-probs, masks, truncation), bit for bit."""

import jax
import numpy as np
import pytest

from grpo_jax.generate import sampler as sampler_lib
from grpo_jax.generate import static_round
from grpo_jax.generate.sampler import SamplingConfig

P, T = 6, 8
EOS = tuple(range(6, 128, 4))  # a quarter of the vocabulary: rows end early, at many lengths


def _prompts(group: int, groups: int, mixed: bool):
  """``groups`` prompts of P tokens (left padding of 0, 2 or 4), each repeated ``group``
  times; ``mixed`` swaps two rows of neighbouring groups, so that some runs of ``group`` rows
  are not one prompt (each row is prefilled on its own then)."""
  rng = np.random.RandomState(3)
  ids = rng.randint(6, 128, (groups, P)).astype(np.int32)
  mask = np.ones((groups, P), bool)
  for i in range(groups):
    mask[i, :2 * (i % 3)] = False
  ids[~mask] = 0
  ids, mask = np.repeat(ids, group, 0), np.repeat(mask, group, 0)
  if mixed:
    ids[[1, group]], mask[[1, group]] = ids[[group, 1]], mask[[group, 1]]
  return ids, mask


@pytest.mark.parametrize("group,groups,block,temperature,mixed", [
    (2, 4, 0, 1.0, True),   # per-row prefill where a run is not one prompt
    (2, 4, 4, 0.7, False),  # rows in blocks of 4, as sampler_rows runs them
    (4, 2, 0, 0.0, False),  # greedy: evaluation's pass
])
def test_a_round_draws_the_samplers_tokens_bit_for_bit(split, group, groups, block,
                                                        temperature, mixed):
  config = SamplingConfig(max_new_tokens=T, eos_ids=EOS, pad_id=0, temperature=temperature,
                          prompt_group=group, row_block=block)
  ids, mask = _prompts(group, groups, mixed)
  key = jax.random.key(11)
  want = jax.device_get(sampler_lib.make_sampler(split[0], config)(split[1], ids, mask, key))
  got = jax.device_get(static_round.make_round_fn(split[0], config)(split[1], ids, mask, key))
  if temperature:  # rows end at several lengths, and their finished columns hold pad and 0
    assert len(set(want.completion_mask.sum(1).tolist())) > 2, want.completion_mask.sum(1)
  for name in want.__dataclass_fields__:
    a, b = np.asarray(getattr(want, name)), np.asarray(getattr(got, name))
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name  # bits, not values
