"""Orbax checkpoints of a run: TrainState + ReplayState + host loop state.

One ``CheckpointManager`` per workdir (``workdir/checkpoints``), keeping the last K. A step's
checkpoint holds the device pytrees (parameters, optimiser state, step, replay buffer) and a
JSON record of the host side (rollouts and tokens so far, skipped prompts, rng seed, and the
allocator's state: data position, per-prompt posteriors, its random generators). NumPy arrays
in the host record (partial rollouts' pool: every row's tokens, log-probs and versions) are
written as an orbax item of their own ("arrays", binary, read back as NumPy), each replaced
in the JSON by a reference to it: a pool of 512 rows x 4,096 tokens (tokens, log-probs,
versions) is 25.2 MB of arrays where JSON lists were 69.2 MB of text, 1.5 s to write and 0.8 s
to parse on this project's CPU (random values of the real ranges). Saves are synchronous: the train step donates its buffers, so nothing may still be
reading them when the next step runs. Orbax writes to a temporary folder and renames, so a
crash mid-save never leaves a corrupt latest checkpoint.

A save that fails for a full disk (or another operating-system error) raises ``CheckpointError``
with one line naming the step, the folder and the free space; its half-written temporary
folder is removed (it is never listed, and it holds space the user needs back), and the
previous checkpoints are untouched: orbax deletes old ones only after a save succeeds. The
reports orbax's writer threads print about that failure (tracebacks logged at ERROR,
"Event loop is closed" from writes that end after the failed save) are held during the save
and dropped, since the one line says it; a save that succeeds or fails otherwise passes them
on unchanged. Temporary folders of saves killed mid-way are removed when the next run starts.
"""

from __future__ import annotations

import errno
import gc
import glob
import logging
import os
import pathlib
import shutil
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from grpo_jax.models import CheckpointError, lora

# ENOSPC from Python's own writes; tensorstore (orbax's array writer) reports the same failure
# as a ValueError ("RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']") whose
# only trace of the cause is the operating system's text.
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")


def is_disk_full(error: BaseException) -> bool:
  """Whether ``error``, or an exception in its cause / context chain, is a full disk or quota."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
      return True
    if any(text in str(error) for text in _DISK_FULL_TEXTS):
      return True
    error = error.__cause__ or error.__context__
  return False


# orbax's threads log failed writes to absl's logger, with a traceback; asyncio logs the futures
# of a failed save's other writes ("exception was never retrieved") when they are collected.
_HELD_LOGGERS = ("absl", "asyncio")


class _HeldReports(logging.Filter):
  """While a save runs, holds absl's and asyncio's ERROR records (see ``_HELD_LOGGERS``) and
  unraisable exceptions (tensorstore writes that finish after a failed save closed its event
  loop); ``release`` drops them or passes them on as they would have been.
  """

  def __enter__(self):
    self.records, self.unraisable = [], []
    self._loggers = [logging.getLogger(name) for name in _HELD_LOGGERS]
    for logger in self._loggers:
      logger.addFilter(self)
    self._hook, sys.unraisablehook = sys.unraisablehook, self.unraisable.append
    return self

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    self.records.append(record)
    return False

  def release(self, drop: bool) -> None:
    """Ends the hold: the held reports are dropped or passed on. After a dropped (failed) save,
    tensorstore writes still in flight keep ending on the closed event loop; those "Event loop
    is closed" reports alone stay silenced from then on."""
    if self._loggers is None:
      return
    for logger in self._loggers:
      logger.removeFilter(self)
    sys.unraisablehook = _without_closed_loop(self._hook) if drop else self._hook
    if drop:
      _ignore_abandoned_full_disk_futures()
    else:
      for record in self.records:
        logging.getLogger(record.name).handle(record)
      for report in self.unraisable:
        self._hook(report)
    self._loggers = None

  def __exit__(self, *exc):
    self.release(drop=False)  # a no-op when released already


class _FullDiskFutureFilter(logging.Filter):
  """Drops asyncio's "exception was never retrieved" reports of full-disk write errors: the
  futures of a failed save's other array writes, collected after it was reported."""

  def filter(self, record: logging.LogRecord) -> bool:
    # asyncio passes the future's exception as the record's exc_info.
    return not (record.exc_info and is_disk_full(record.exc_info[1]))


_FULL_DISK_FUTURES = _FullDiskFutureFilter()


def _ignore_abandoned_full_disk_futures() -> None:
  """From a failed save on, asyncio's reports of its abandoned writes' errors stay silent
  (each is the full disk already reported; a second failed save adds nothing)."""
  logger = logging.getLogger("asyncio")
  if _FULL_DISK_FUTURES not in logger.filters:
    logger.addFilter(_FULL_DISK_FUTURES)


def _without_closed_loop(hook):
  """``hook`` for unraisable exceptions, minus asyncio's "Event loop is closed" RuntimeError."""
  def filtered(report):
    if not (isinstance(report.exc_value, RuntimeError)
            and str(report.exc_value) == "Event loop is closed"):
      hook(report)
  filtered.without_closed_loop = True
  return hook if getattr(hook, "without_closed_loop", False) else filtered


def _size(nbytes: float) -> str:
  """``1536`` -> ``1.5 KB`` (decimal units, as ``df -H``)."""
  if nbytes < 1000:
    return f"{nbytes:.0f} bytes"
  for unit in ("KB", "MB", "GB"):
    nbytes /= 1000
    if nbytes < 1000:
      return f"{nbytes:.1f} {unit}"
  return f"{nbytes / 1000:,.1f} TB"


def _join_new_threads(before: set, timeout_s: float) -> None:
  """Waits (``timeout_s`` at most in all) for the threads started since ``before`` to end."""
  deadline = time.monotonic() + timeout_s
  for thread in set(threading.enumerate()) - before:
    if thread is threading.current_thread():
      continue
    while True:
      try:
        thread.join(max(0.0, deadline - time.monotonic()))
        break
      except RuntimeError:  # listed while still starting: join() refuses until it has started
        if time.monotonic() >= deadline:
          break
        time.sleep(0.01)


def _finalize_abandoned_writes() -> None:
  """Finalises, now and quietly, the write coroutines a failed save leaves unreferenced.

  When one array write fails (a full disk), ``asyncio.gather`` in orbax's serializer returns
  the first error and the other fragments' coroutines are dropped unfinished. Collected at
  interpreter exit, their clean-up runs while Python is shutting down and prints "Exception
  ignored ... sys.meta_path is None" tracebacks after the run's one-line error (seen once,
  on a loaded machine). Collected here, their clean-up runs while everything is importable;
  whatever it raises belongs to the save already reported, so it is not printed.
  """
  previous = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  try:
    gc.collect()
  finally:
    sys.unraisablehook = previous


_ARRAY = "__array__"  # a host record's reference to an array of the "arrays" item


def _arrays_out(tree, arrays: dict):
  """``tree`` (the host record) with every non-empty NumPy array moved into ``arrays`` under a
  fresh key and replaced by ``{_ARRAY: key}``; empty ones become (JSON) lists."""
  if isinstance(tree, np.ndarray):
    if not tree.size:
      return tree.tolist()
    key = f"a{len(arrays)}"
    arrays[key] = tree
    return {_ARRAY: key}
  if isinstance(tree, dict):
    return {k: _arrays_out(v, arrays) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_arrays_out(v, arrays) for v in tree]
  return tree


def _arrays_in(tree, arrays: dict):
  """``_arrays_out`` undone: each reference replaced by its array."""
  if isinstance(tree, dict):
    if set(tree) == {_ARRAY}:
      return arrays[tree[_ARRAY]]
    return {k: _arrays_in(v, arrays) for k, v in tree.items()}
  if isinstance(tree, list):
    return [_arrays_in(v, arrays) for v in tree]
  return tree


class Checkpointer:
  """Save / restore of (train state, replay state, host record) under ``workdir``."""

  def __init__(self, workdir: str, keep: int):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=False,
                                             cleanup_tmp_directories=True))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  @staticmethod
  def _tree(state, replay) -> dict:
    # Under LoRA only the adapters (and their optimiser state) are saved: the base weights
    # never change and are the model folder's (``lora.trainable``).
    state = state.replace(params=lora.trainable(state.params)[0])
    # A capacity-0 buffer (plain GRPO) has only zero-size arrays, which orbax refuses; it
    # holds nothing, so it is left out and recreated empty on restore.
    return {"train": state, "replay": replay} if replay.capacity else {"train": state}

  def save(self, step: int, state, replay, host: dict) -> None:
    """Writes checkpoint ``step``.

    Raises:
      CheckpointError: the disk (or quota) is full, or the operating system refused a write;
        the message names the step, the folder, the free space and the last good checkpoint,
        which is left as it was.
    """
    threads = set(threading.enumerate())
    with _HeldReports() as held:
      try:
        arrays = {}
        host = _arrays_out(host, arrays)
        items = {"arrays": ocp.args.StandardSave(arrays)} if arrays else {}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(self._tree(state, replay)),
            host=ocp.args.JsonSave(host), **items), force=True)
        self.manager.wait_until_finished()
      except Exception as e:  # pylint: disable=broad-except
        if not (is_disk_full(e) or isinstance(e, OSError)):
          raise
        # Writes of the failed save still under way would recreate what is removed.
        _join_new_threads(threads, timeout_s=60.0)
        _finalize_abandoned_writes()
        self._discard_unfinished(step)
        held.release(drop=True)
        raise CheckpointError(self._failure_message(step, e)) from e

  def _discard_unfinished(self, step: int) -> None:
    """Removes the temporary folder of a failed save of ``step`` (never a finished one).

    Tensorstore's own (C++) threads may still be ending writes into it, which makes a removal
    fail half-way, so it is retried for a few seconds; whatever is left is removed when the
    next run starts (``cleanup_tmp_directories``).
    """
    pattern = os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")
    for _ in range(50):
      for path in glob.glob(pattern):
        shutil.rmtree(path, ignore_errors=True)
      if not glob.glob(pattern):
        break
      time.sleep(0.1)
    self.manager.reload()

  def _failure_message(self, step: int, error: BaseException) -> str:
    last = self.manager.latest_step()
    kept = (f"the last good checkpoint (step {last}) is intact" if last is not None else
            "there is no earlier checkpoint: the run will start again from step 0")
    try:
      free = f" ({_size(shutil.disk_usage(self.directory).free)} free)"
    except OSError:
      free = ""
    if is_disk_full(error):
      return (f"checkpoint of step {step} not written: no space left on device in "
              f"{self.directory}{free}; {kept}. Free some space (each save needs room for one "
              "more checkpoint while checkpoint.keep are kept) and run the same command to "
              "resume")
    return (f"checkpoint of step {step} not written in {self.directory}: "
            f"{type(error).__name__}: {error}; {kept}. Fix the folder and run the same command "
            "to resume")

  def restore(self, step: int, state, replay):
    """Restores into the structure, shapes and dtypes of the given (template) pytrees; under
    LoRA the template's base weights are kept.

    Raises:
      CheckpointError: the checkpoint holds one set of parameters per decoder layer, as
        written before the layers were stacked (this version cannot read it).
    """
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self._tree(state, replay))
    row_versions = self._row_versions(step, abstract)
    if row_versions is not None:  # written before tokens carried their own version
      abstract = row_versions
    items = {"arrays": ocp.args.StandardRestore()} if self._has_arrays(step) else {}
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore(), **items))
    except Exception:
      if self._per_layer(step):
        raise CheckpointError(
            f"checkpoint {step} in {self.directory} holds its parameters layer by layer "
            "(params/layers/0, params/layers/1, ...): it was written before grpo_jax stacked "
            "the decoder layers into one array per parameter ([L, ...]), and this version "
            "cannot restore it; export it with the version that wrote it "
            "(python -m grpo_jax.export), or start the run in a new workdir") from None
      raise
    if row_versions is not None:  # each stored row's version, given to each of its tokens
      old = restored.state["replay"]
      version = jnp.broadcast_to(old.rollouts.version[..., None],
                                 old.rollouts.completion_ids.shape)
      restored.state["replay"] = old.replace(rollouts=old.rollouts.replace(version=version))
    train = restored.state["train"]
    # The saved adapters joined to the template's base weights (as they were loaded).
    train = train.replace(params=lora.join(train.params, lora.trainable(state.params)[1]))
    host = dict(restored.host)
    if items:
      host = _arrays_in(host, dict(restored.arrays))
    return train, restored.state.get("replay", replay), host

  def _has_arrays(self, step: int) -> bool:
    """Whether checkpoint ``step`` has an "arrays" item (its host record referred to some)."""
    return os.path.isdir(os.path.join(self.directory, str(step), "arrays"))

  def _row_versions(self, step: int, abstract: dict) -> dict | None:
    """``abstract`` with the buffer's ``rollouts.version`` as [C, E] when checkpoint ``step``
    stores it so (one version per row, before each token had its own), else None."""
    if "replay" not in abstract:
      return None
    try:
      tree = ocp.StandardCheckpointHandler().metadata(
          pathlib.Path(self.directory, str(step), "state"))
      saved = tree["replay"]["rollouts"]["version"].shape
    except Exception:  # pylint: disable=broad-except
      return None
    want = abstract["replay"].rollouts.version
    if len(saved) != len(want.shape) - 1:
      return None
    old = jax.ShapeDtypeStruct(want.shape[:-1], want.dtype, sharding=want.sharding)
    replay = abstract["replay"]
    return {**abstract, "replay": replay.replace(rollouts=replay.rollouts.replace(version=old))}

  def _per_layer(self, step: int) -> bool:
    """Whether checkpoint ``step`` keeps a subtree per decoder layer (``layers/0/...``)."""
    try:
      tree = ocp.StandardCheckpointHandler().metadata(
          pathlib.Path(self.directory, str(step), "state"))
      layers = tree["train"]["params"]["layers"]
    except Exception:  # pylint: disable=broad-except
      return False  # unreadable, or without a decoder: not this case
    return any(str(key).isdigit() for key in layers)

  def host(self, step: int) -> dict:
    """The host record of one checkpoint alone (no device arrays are read; the host's own
    arrays stay references, ``{"__array__": key}``)."""
    restored = self.manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))
    return dict(restored.host)

  def close(self):
    self.manager.close()
