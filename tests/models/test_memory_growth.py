"""The train step's compiled memory grows linearly in completion length with the blocked kernel.

Compile only (nothing allocated or run): ``bench.memory.step_memory`` of the embedded model's GRPO
step (``model.attention=blocked``, blocks of 256, 2 rows, P = 32, one minibatch, no remat) at
T = 1,024 and 4,096, and the ratio of XLA's planned scratch (``memory_analysis()``'s temp): at
most 1.1x the ratio of key slots P + T (3.91), i.e. linear growth with 10% to spare. Measured
under the suite's XLA flags (tests/conftest.py), the ratio:

=========================================================  ======  ======
code                                                       padded  packed
=========================================================  ======  ======
the fix (``flash.saved_by``, ``flash.in_loop``)            3.75    3.20
before it (``dots_saveable``, masks hoisted)               8.84    10.51
the policy without the kernels' residuals' name            8.51    8.76
without ``in_loop``                                        4.70    7.41
=========================================================  ======  ======

``dots_saveable`` alone makes the layer scan keep every (query block, key block) tile's products
for the backward pass, and JAX's partial evaluation of the layer scan moves every tile's mask
out of it; both are stacked over the block pairs, [M, N, K, Q, 256, 256], quadratic in length.
"""

import pytest

from configs import grpo
from grpo_jax.bench import memory

PROMPT = 32
LENGTHS = (1024, 4096)
SLACK = 1.1


def _config(completion_len: int, packing: str):
  c = grpo.get_config()
  c.model.attention = "blocked"
  c.model.attention_block = 256
  c.model.remat = "none"
  c.rollout.update(prompt_len=PROMPT, completion_len=completion_len, batch_prompts=1,
                   group_size=2)
  c.rl.num_minibatches = 1
  c.rl.packing = packing
  return c


@pytest.mark.parametrize("packing", ["none", "tokens"])
def test_blocked_step_memory_grows_linearly_in_length(packing):
  short, long = (memory.step_memory(_config(t, packing))["temp"] for t in LENGTHS)
  keys = (PROMPT + LENGTHS[1]) / (PROMPT + LENGTHS[0])
  assert long / short <= SLACK * keys, (
      f"temp {short / 2 ** 20:.1f} -> {long / 2 ** 20:.1f} MiB from T = {LENGTHS[0]} to "
      f"{LENGTHS[1]}: x{long / short:.2f}, against x{keys:.2f} key slots")
