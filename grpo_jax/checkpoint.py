"""Orbax checkpoints of a run: TrainState + ReplayState + host loop state.

One ``CheckpointManager`` per workdir (``workdir/checkpoints``), keeping the last K. A step's
checkpoint holds the device pytrees (parameters, optimiser state, step, replay buffer) and a
JSON record of the host side (rollouts and tokens so far, skipped prompts, rng seed, and the
allocator's state: data position, per-prompt posteriors, its random generators). Saves are synchronous: the train step donates its buffers, so nothing may still be
reading them when the next step runs. Orbax writes to a temporary folder and renames, so a
crash mid-save never leaves a corrupt latest checkpoint.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Save / restore of (train state, replay state, host record) under ``workdir``."""

  def __init__(self, workdir: str, keep: int):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  @staticmethod
  def _tree(state, replay) -> dict:
    # A capacity-0 buffer (plain GRPO) has only zero-size arrays, which orbax refuses; it
    # holds nothing, so it is left out and recreated empty on restore.
    return {"train": state, "replay": replay} if replay.capacity else {"train": state}

  def save(self, step: int, state, replay, host: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(self._tree(state, replay)),
        host=ocp.args.JsonSave(host)), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, state, replay):
    """Restores into the structure, shapes and dtypes of the given (template) pytrees."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._tree(state, replay))
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()))
    return (restored.state["train"], restored.state.get("replay", replay),
            dict(restored.host))

  def host(self, step: int) -> dict:
    """The host record of one checkpoint alone (no device arrays are read)."""
    restored = self.manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))
    return dict(restored.host)

  def close(self):
    self.manager.close()
