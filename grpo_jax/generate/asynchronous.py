"""Generation on its own devices while the update runs on the others (``rollout.devices``).

One controller holds two meshes on disjoint devices (``sharding.split``): the first K
devices generate, the rest train. The slot pool of partial rollouts (``generate.producer``) is
the queue between them: the generator decodes chunk after chunk into it, a step takes the
first B complete groups, and the rows still unfinished continue under the next parameters.
After each update is dispatched its parameters are sent to the generation mesh device to
device (``generate.transfer``; under LoRA only the adapters), and the generator switches to
them at its next chunk boundary once they have arrived (``overlap``). AReaL (arXiv
2505.24298), verl's one-step-off and fully asynchronous trainers, and tunix's separate-mesh
agentic learner bound staleness the same way: a maximum off-policy lag, enforced by the
generator.

Staleness has partial rollouts' definition: a token's version is the number of updates of
the parameters that drew it, and a token trained at step s has staleness s - its version.
``rollout.max_staleness`` = S holds exactly: before a step takes groups, and again when an
update is dispatched, every group whose oldest token is older than (the next step to take
groups) - S is discarded and counted (``Producer.expire``), and the generator admits no new
group while the groups ready and in flight already fill the steps it may prepare: the next
step and ``ahead`` more, as far as its tokens can reach (``Producer.lead`` = B x (min(ahead,
version + S - next step) + 1)): it waits rather than run ahead. When no token it could draw
would be trainable (its version + S < the next step) both hold at once: every group in flight
has expired and the lead is 0, so nothing is decoded.

``ahead`` (``rollout.ahead``) sets how stale the trained tokens are in practice: a generator
faster than the trainer fills every step it may prepare, so with ``ahead`` >= S nearly every
trained token sits at the bound S; with ``ahead`` = 0 it prepares only the next step's groups
(drawn while the previous update runs: staleness 1), and rows that span updates are what
reaches past it.

Host concurrency: one thread. JAX dispatch is asynchronous, so the train step is dispatched
and runs on its devices while the host drives the generator's chunks on the others; the host
blocks only on the generator's own results (which rows ended, one read a chunk) and, when the
generator has nothing it may do, on the parameters in transit. Scoring, the allocator's rules,
signal handling and the math-verify worker pool therefore all stay on the main thread, as in
the colocated mode (the pool's processes are forked from it, so their parent-death signal is
tied to the main thread's life). A daemon thread per update only waits on the device to time
it (``Times``); it runs no Python that touches the run's state.

Schedules (``rollout.schedule``): ``lockstep`` runs exactly ``rollout.lockstep_chunks`` chunks
while each update runs, then waits for its parameters: the same tokens run to run, so a
resumed run is bit for bit the uninterrupted one (under ``partial_cache=reprefill``, as for
partial rollouts). ``free`` decodes until the parameters have arrived (checked at each chunk
boundary), so how much is generated under the old parameters depends on timing; resume loses
nothing and holds the bound. Lockstep with 0 chunks is the colocated partial-rollout schedule
on separate devices.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import numpy as np

from grpo_jax.generate import producer as producer_lib
from grpo_jax.models import lora

SCHEDULES = ("free", "lockstep")


@dataclasses.dataclass
class Times:
  """Seconds (``time.perf_counter``) the generator and trainer spent since the last
  ``take_stats``; an update's times are counted when its parameters reach the generator.

  Attributes:
    generator_busy: running the generator's chunks (admission, decode, harvest and the rule's
      scoring of ended rows).
    generator_idle: waiting for parameters, with nothing it was allowed to do.
    trainer_busy: from an update's dispatch to its new state being ready.
    trainer_idle: from the previous update's state being ready to this one's dispatch.
    transfer: from an update's state being ready to its parameters being on the generation
      mesh.
  """

  generator_busy: float = 0.0
  generator_idle: float = 0.0
  trainer_busy: float = 0.0
  trainer_idle: float = 0.0
  transfer: float = 0.0


class _InTransit:
  """One update's parameters on their way to the generation mesh, and its timing: a daemon
  thread waits for the train state, then for the copy, and notes when each was ready."""

  def __init__(self, train_leaf, params):
    self.params = params
    self.dispatched = time.perf_counter()
    self.trained = self.arrived = None
    self._thread = threading.Thread(target=self._watch, args=(train_leaf,), daemon=True)
    self._thread.start()

  def _watch(self, train_leaf) -> None:
    jax.block_until_ready(train_leaf)
    self.trained = time.perf_counter()
    jax.block_until_ready(self.params)
    self.arrived = time.perf_counter()

  def ready(self) -> bool:
    return all(x.is_ready() for x in jax.tree.leaves(self.params))

  def wait(self):
    """The parameters on the generation mesh (blocks until they are), timing noted."""
    self._thread.join()
    return self.params


class Generator:
  """The producer of partial rollouts on the generation mesh, fed parameters by the trainer.

  Args:
    producer: the ``generate.producer.Producer`` whose pool lives on the generation mesh.
    send: ``send(trained)``: the trained parameters (all of them, or under LoRA the adapters)
      on the generation mesh, device to device (``generate.transfer.Transfer``).
    send_frozen: the same for the parameters LoRA freezes (sent once, by ``start``).
    num_groups: B, groups a step takes.
    schedule: ``free`` or ``lockstep`` (module doc).
    lockstep_chunks: chunks run while each update runs (``lockstep``).
    ahead: steps beyond the next whose groups the generator may prepare (module doc).

  ``start(params)`` gives it its first parameters (the run's, fresh or restored).
  """

  def __init__(self, producer: producer_lib.Producer, send, send_frozen=None, *,
               num_groups: int, schedule: str = "free", lockstep_chunks: int = 1,
               ahead: int = 1):
    if schedule not in SCHEDULES:
      raise ValueError(f"schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    self.producer, self.b = producer, num_groups
    self.schedule, self.lockstep_chunks, self.ahead = schedule, lockstep_chunks, ahead
    self._send, self._send_frozen = send, send_frozen
    self._frozen = None
    self.params = None
    self.times = Times()
    self._last_trained: float | None = None
    self.transfers = 0  # parameter sets received
    self.next_step = 0  # the next step to take groups (the bound is counted from it)

  def start(self, train_params) -> None:
    """The generator's parameters: a copy of ``train_params`` (the run's, of the version the
    producer records) on the generation mesh. Under LoRA the base is copied here once and
    stays; each update sends the adapters only."""
    trained, frozen = lora.trainable(train_params)
    self._frozen = None if frozen is None else self._send_frozen(frozen)
    self.params = lora.join(self._send(trained), self._frozen)
    self._last_trained = None

  @property
  def version(self) -> int:
    """The version (updates) of the parameters the generator decodes with."""
    return self.producer.version

  def _gate(self, next_step: int) -> None:
    """The bound for tokens drawn from now on, which a step ``next_step`` or later trains:
    groups that step can no longer take are discarded, and the groups ready and in flight may
    fill the next step and ``ahead`` more, up to the last one its tokens can reach."""
    p = self.producer
    self.next_step = next_step
    p.expire(next_step - p.max_staleness)
    p.lead = self.b * max(min(self.ahead, p.version + p.max_staleness - next_step) + 1, 0)

  def _busy(self, fn, *args, **kwargs):
    start = time.perf_counter()
    try:
      return fn(*args, **kwargs)
    finally:
      self.times.generator_busy += time.perf_counter() - start

  def take(self, step: int) -> list[producer_lib.Group]:
    """Step ``step``'s B complete groups (fewer if the producer's budget or cap ends it),
    generating until they are ready; the generator holds parameters of version ``step`` (a
    step is taken only after the previous update's parameters arrived: ``overlap``)."""
    if self.params is None:
      raise RuntimeError("the generator has no parameters: start(params) first")
    if self.version != step:
      raise RuntimeError(f"the generator holds version {self.version}, step {step} is asked "
                         "for: each update's parameters must reach it first (overlap)")
    self._gate(step)
    return self._busy(self.producer.take, self.params, self.b)

  def overlap(self, train_params, step: int) -> None:
    """After update ``step`` is dispatched (its new parameters ``train_params``, version
    ``step + 1``, possibly not computed yet): sends them device to device, generates under the
    current parameters while they are on their way (``lockstep``: exactly ``lockstep_chunks``
    chunks; ``free``: until they have arrived), then switches to them."""
    trained, _ = lora.trainable(train_params)
    transit = _InTransit(jax.tree.leaves(train_params)[0], self._send(trained))
    if self._last_trained is not None:
      self.times.trainer_idle += transit.dispatched - self._last_trained
    self._gate(step + 1)
    p = self.producer
    if self.schedule == "lockstep":
      if self.lockstep_chunks:
        self._busy(p.work, self.params, until=lambda: False, chunks=self.lockstep_chunks)
    else:
      self._busy(p.work, self.params, until=transit.ready)
    start = time.perf_counter()
    params = transit.wait()
    self.times.generator_idle += time.perf_counter() - start
    self.times.trainer_busy += transit.trained - transit.dispatched
    self.times.transfer += max(transit.arrived - transit.trained, 0.0)
    self._last_trained = transit.trained
    self.params = lora.join(params, self._frozen)
    self.transfers += 1
    self._busy(p.advance, self.params)  # version step + 1; with reprefill, the cache rebuilt

  def take_stats(self) -> dict:
    """``rollout/`` timing metrics since the last call (seconds), then reset."""
    t, self.times = self.times, Times()
    return {**{f"rollout/{k}_s": float(v) for k, v in dataclasses.asdict(t).items()},
            "rollout/generator_version": float(self.version)}


def staleness_stats(step: int, versions: np.ndarray, bound: int) -> dict:
  """``rollout/staleness_max``, ``_mean`` and the distribution ``rollout/staleness_<k>`` (the
  fraction of trained tokens at staleness k, k = 0..bound) of tokens of ``versions`` trained
  at ``step`` (an empty array: zeros)."""
  staleness = step - np.asarray(versions, np.int64)
  n = max(staleness.size, 1)
  counts = np.bincount(np.clip(staleness, 0, bound), minlength=bound + 1)[:bound + 1]
  return {"rollout/staleness_max": float(staleness.max()) if staleness.size else 0.0,
          "rollout/staleness_mean": float(staleness.mean()) if staleness.size else 0.0,
          **{f"rollout/staleness_{k}": float(c) / n for k, c in enumerate(counts)}}
